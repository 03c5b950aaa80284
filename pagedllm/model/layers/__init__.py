"""The decoder and its parts: attention over the paged cache, RoPE, linear layers, norms and MLPs, the MoE
block."""
