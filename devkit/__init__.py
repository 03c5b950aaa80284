"""What the tests and the benchmarks both build on, and neither owns: tiny random checkpoints of every family
(HF folders and GGUF files), random GGML blocks, a tiny tokenizer, a busy KV pool, the headless browser. Not part
of the pagedllm package (never installed); importable from the repository root (pytest's `pythonpath`, and
`python -m benchmarks.<name>`)."""
