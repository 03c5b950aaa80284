"""The KV cache: memory, accuracy, the disk tier, the /kv page."""
