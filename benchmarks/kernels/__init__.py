"""The C kernels alone, and where a step's time goes."""
