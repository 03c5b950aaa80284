"""The CPU kernels and their plumbing: the C sources (csrc/) and their build, quantized and oneDNN linears, KV
quantization, the measured kernel choice. Nothing here knows a model: the rooms above describe and run it."""
