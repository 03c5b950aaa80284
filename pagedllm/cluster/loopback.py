"""Keeping a local Ray that `pagedllm serve --replicas N` starts off the network. A Ray head binds its GCS,
raylet, workers and agents to the machine's address, on every interface, so that other machines can join;
a single `pagedllm serve` has no other machine, and anyone who can reach those ports can run code in it.
Ray's one-machine mode (what it runs on macOS and Windows) binds them all to 127.0.0.1; one port Ray Serve
2.60 opens in every replica ignores it, and the replica side here binds that one to loopback too. Replicas on
other machines: start the cluster yourself (`ray start --head`) and pass --ray-address.
"""

from __future__ import annotations

import os
from typing import Any

LOOPBACK = "127.0.0.1"
_patched: list[bool] = []  # whether this replica process already rebinds Serve's gRPC server


def loopback_only() -> None:
    """Before a local `ray.init()`: Ray's one-machine mode, a flag Ray reads when it is imported (this process
    may have imported it already, so the module's copy too) and that the processes it starts inherit."""
    from ray._private import ray_constants

    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def replica_grpc_on_loopback() -> None:
    """In a replica's constructor, which Serve runs before it starts the replica's inter-deployment gRPC server:
    Serve 2.60 binds that server to `[::]:0` (every interface) whatever the node's address, so on a node whose
    address is loopback it goes to 127.0.0.1 instead (callers dial the node's address, so they still reach
    it). On any other node, or a Ray without that hook, nothing changes."""
    import ray
    from ray.serve._private import replica

    add = getattr(replica, "add_port_to_grpc_server", None)
    if _patched or add is None or ray.util.get_node_ip_address() != LOOPBACK:
        return

    def add_on_loopback(server: Any, address: str) -> int:
        port: int = add(server, address.replace("[::]", LOOPBACK, 1))
        return port

    replica.add_port_to_grpc_server = add_on_loopback
    _patched.append(True)
