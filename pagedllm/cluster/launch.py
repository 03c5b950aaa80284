"""Running the cluster from typed settings: start (or join) Ray, deploy the application, serve until SIGINT /
SIGTERM, then take it down. `pagedllm serve --replicas N` (entrypoints/serve_cluster.py) parses the flags and
calls `serve_cluster`; nothing here imports Ray until the cluster runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pagedllm.cluster.loopback import loopback_only
from pagedllm.errors import UserError

if TYPE_CHECKING:  # nothing here imports Ray (or the engine) until the cluster runs
    from pagedllm.cluster.config import ClusterConfig
    from pagedllm.cluster.ingress import IngressSettings
    from pagedllm.engine.config import EngineConfig

OBJECT_STORE_BYTES = 100 * 2**20  # a local Ray's object store: requests and outputs are small, RAM is shared
TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


def _ray_init(ray: Any, address: str | None) -> None:
    """Join `address`, or start a small local Ray: no dashboard, a small object store (the machine is shared),
    every port on loopback (loopback.py). A cluster that cannot be reached is one line naming the flag,
    not Ray's traceback ending in advice about an `--address` flag pagedllm does not have."""
    if address:
        _check_answers(address)
        try:
            ray.init(address=address)
        except (ConnectionError, TimeoutError) as e:
            message = str(e).split(". Please specify")[0].rstrip(".")
            raise UserError(
                f"--ray-address {address}: cannot join a Ray cluster there ({message}); start one "
                "(`ray start --head`) or leave --ray-address out to start a local one"
            ) from None
    else:
        loopback_only()
        with _drop_logs(TOKEN_AUTH_LOGGER, "Token authentication is enabled"):
            ray.init(num_cpus=os.cpu_count(), include_dashboard=False, object_store_memory=OBJECT_STORE_BYTES)


def _check_answers(address: str) -> None:
    """A host:port where nothing listens is refused at once: Ray would retry it for minutes, then print a
    traceback. `auto` (Ray's own search) and anything that is not host:port are left to Ray."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
    except OSError as e:
        raise UserError(f"--ray-address {address}: no Ray cluster answers there ({e.strerror or e})") from None


def check_resources(total: dict[str, float], replicas: int, cpus: float, gpus: float) -> None:
    """Replicas that could never be placed would leave Ray waiting for ever: refuse them up front."""
    if replicas * cpus > total.get("CPU", 0):
        raise UserError(
            f"--cpus-per-replica: {replicas} replicas x {cpus:g} CPUs need {replicas * cpus:g}; the "
            f"Ray cluster has {total.get('CPU', 0):g}"
        )
    if replicas * gpus > total.get("GPU", 0):
        raise UserError(
            f"--num-gpus-per-replica: {replicas} replicas x {gpus:g} GPUs need {replicas * gpus:g}; "
            f"the Ray cluster has {total.get('GPU', 0):g}"
        )


def _local_resources(gpus: float) -> dict[str, float]:
    total = {"CPU": float(os.cpu_count() or 1), "GPU": 0.0}
    if gpus:
        import torch

        total["GPU"] = float(torch.cuda.device_count())
    return total


def serve_cluster(config: EngineConfig, options: ClusterConfig, ingress: IngressSettings) -> int:
    """Start (or join) Ray (--ray-address), deploy the application, serve on the server's --host / --port until
    SIGINT / SIGTERM, then take it down: all of Ray if this call started it, only this application if it joined
    a cluster."""
    from pagedllm.cluster.app import APP_NAME, build_application

    host, port, ray_address, replicas = ingress.server.host, ingress.server.port, options.ray_address, options.replicas
    assert replicas is not None, "the cluster runs only with --replicas"

    if not ray_address:  # before a local Ray takes its seconds to start
        check_resources(
            _local_resources(options.num_gpus_per_replica),
            replicas,
            options.cpus_per_replica,
            options.num_gpus_per_replica,
        )
    import ray
    from ray import serve

    _ray_init(ray, ray_address)
    try:
        check_resources(ray.cluster_resources(), replicas, options.cpus_per_replica, options.num_gpus_per_replica)
        serve.start(http_options={"host": host, "port": port})
        print(
            f"pagedllm serve: starting {options.replicas} replicas ({ingress.routing} routing) ...",
            file=sys.stderr,
            flush=True,
        )
        with _drop_logs("ray.serve", "will not be applied"):
            try:
                serve.run(build_application(config, options, ingress), name=APP_NAME, route_prefix="/")
            except RuntimeError:
                cause = replica_failure(_engine_status_message(serve))
                if cause is None:
                    raise
                raise UserError(f"the engine replicas failed to start: {cause}") from None
        print(
            f"pagedllm serve: serving {', '.join(ingress.served_model_names)} on http://{host}:{port} "
            f"({options.replicas} replicas, {ingress.routing} routing)",
            file=sys.stderr,
            flush=True,
        )
        _wait_for_signal()
    finally:
        if ray_address:
            serve.delete(APP_NAME)
        else:
            serve.shutdown()
        ray.shutdown()
    return 0


def _engine_status_message(serve: Any) -> str:
    from pagedllm.cluster.app import APP_NAME, ENGINE_DEPLOYMENT

    app = serve.status().applications.get(APP_NAME)
    deployment = app.deployments.get(ENGINE_DEPLOYMENT) if app is not None else None
    return deployment.message if deployment is not None else ""


def replica_failure(message: str) -> str | None:
    """What a replica that failed to start raised, as one line, when it is a user's mistake: Ray Serve retries
    the replica, gives up and raises "Deploying application ... failed", with the replica's traceback only in its
    deployment's status `message`, whose last line is the exception (`pagedllm.model.lora.LoRAError: LoRA adapter
    'x': ...` for an adapter that does not fit the model). Any other exception: None (Ray's error stands)."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return None
    name, _, text = lines[-1].partition(": ")
    return text if name.startswith("pagedllm.") and name.endswith("Error") and text else None


@contextlib.contextmanager
def _drop_logs(logger_name: str, text: str) -> Iterator[None]:
    """Ray logs two alarming lines that are not true of what pagedllm does: advice to opt out of the token
    authentication a new local Ray turns on (it stays on: README), and, as `serve.run` starts Serve once more
    without options, that "New http_options ... will not be applied" to the Serve that `serve.start` just
    started with this command's options. Only records of `logger_name` containing `text` go."""
    target = logging.getLogger(logger_name)

    def drop(record: logging.LogRecord) -> bool:
        return text not in record.getMessage()

    target.addFilter(drop)
    try:
        yield
    finally:
        target.removeFilter(drop)


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
