"""Serving benchmarks: `pagedllm bench serve` (any OpenAI-compatible server over HTTP) and `pagedllm bench sweep`
(the same workload against in-process engines built with different KV-cache settings).

Modules: `datasets` (workloads with prompt lengths exact in the model's tokens), `arrivals` (Poisson / gamma
request schedules), `client` (async streaming OpenAI client), `metrics` (vLLM's metric definitions),
`plot`, `serve` and `sweep` (the subcommands).
"""
