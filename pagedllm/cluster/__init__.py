"""Past one machine: engine replicas on Ray Serve behind a prefix-cache-aware router (`pagedllm serve --replicas N`).

`routing` (the policy, no Ray) and `launch` (the flags) import without Ray; `router`, `replica`, `ingress` and
`app` need the `cluster` extra (`pip install 'pagedllm[cluster]'`).
"""
