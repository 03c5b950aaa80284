"""The cluster's figures from its replicas': engine stats added up, Prometheus pages labelled per replica.

Each replica keeps its own metrics (vLLM's names, fed by its engine thread, exactly as the single-process server
does); the cluster's /metrics is their pages with a `replica` label on every sample, so a dashboard sums over
the label for the cluster and splits by it per replica, and bench serve's prefix-cache hit rate (which sums the
counters over label sets) is the cluster's.
"""

from __future__ import annotations

from dataclasses import fields
from itertools import zip_longest
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.engine.metrics import write_page
from pagedllm.engine.stats import EngineStats


def sum_stats(stats: list[EngineStats]) -> EngineStats:
    """Counters and gauges added up across replicas (per-position lists position by position); kv_usage is the
    share of all their blocks in use."""
    total: dict[str, Any] = {f.name: _add([getattr(s, f.name) for s in stats]) for f in fields(EngineStats)}
    total["block_size"] = stats[0].block_size if stats else 0
    total["kv_usage"] = 1 - total["num_free_blocks"] / total["num_blocks"] if total["num_blocks"] else 0.0
    return EngineStats(**total)


def _add(values: list) -> int | float | list[int]:
    if values and isinstance(values[0], list):
        return [sum(column) for column in zip_longest(*values, fillvalue=0)]
    return sum(values)


def with_replica_labels(pages: dict[str, str]) -> str:
    """One Prometheus page from each replica's (prometheus_client parses and writes them): every sample gets a
    `replica` label, every family its HELP and TYPE once, with the samples of all replicas together."""
    merged: dict[str, Metric] = {}
    for replica, page in pages.items():
        for family in text_string_to_metric_families(page):
            into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type, family.unit))
            into.samples += [s._replace(labels={"replica": replica, **s.labels}) for s in family.samples]
    return write_page(list(merged.values())).decode()
