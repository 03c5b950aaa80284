"""Checkpoint files as stored: the GGUF reader and block formats, weights into the decoder, the tokenizer and
its cache."""
