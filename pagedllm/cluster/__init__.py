"""Past one machine: engine replicas on Ray Serve behind a prefix-cache-aware router (`pagedllm serve --replicas N`).

`routing` (the policy) and `launch` (starting Ray) import without Ray; `router`, `replica`, `ingress` and `app`
need the `cluster` extra (`pip install 'pagedllm[cluster]'`). The flags are parsed in
`pagedllm.entrypoints.serve_cluster`: this package takes typed settings and imports nothing from entrypoints/
but the OpenAI app.
"""
