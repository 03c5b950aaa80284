"""The OpenAI-compatible HTTP server (`pagedllm serve`): build_app, Server, request models, errors, metrics."""
