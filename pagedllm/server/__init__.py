"""The OpenAI-compatible HTTP server (`pagedllm serve`, and the cluster's ingress): build_app, Server, the request
and response models, errors, streaming, tool parsers and the /kv page."""
