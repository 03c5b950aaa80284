"""Whole engines side by side with the anchors, at the sizes people run."""
