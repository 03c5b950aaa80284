"""The cluster's figures from its replicas': engine stats added up, Prometheus pages labelled per replica.

Each replica keeps its own metrics (vLLM's names, fed by its engine thread, exactly as the single-process server
does); the cluster's /metrics is their pages with a `replica` label on every sample, so a dashboard sums over
the label for the cluster and splits by it per replica, and bench serve's prefix-cache hit rate (which sums the
counters over label sets) is the cluster's.
"""

from __future__ import annotations

from dataclasses import MISSING, Field, fields, is_dataclass
from itertools import zip_longest
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.engine.metrics import write_page
from pagedllm.engine.stats import EngineStats


def sum_stats(stats: list[EngineStats]) -> EngineStats:
    """Counters and gauges added up across replicas (per-position lists position by position); kv_usage is the
    share of all their blocks in use."""
    total: dict[str, Any] = {
        f.name: _add([getattr(s, f.name) for s in stats]) if stats else _empty(f) for f in fields(EngineStats)
    }
    total["block_size"] = stats[0].block_size if stats else 0
    total["kv_usage"] = 1 - total["num_free_blocks"] / total["num_blocks"] if total["num_blocks"] else 0.0
    return EngineStats(**total)


def _empty(f: Field) -> Any:
    """A field's value with no replica reporting: its default (an empty list, no state), else zero."""
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else 0


# What replicas of one model share in a group's or the recurrent state's figures: taken from the first, not added
SHAPE = frozenset({"window", "layers", "bytes_per_request", "checkpoint_blocks_each"})


def _add(values: list) -> Any:
    """Replicas' values of one field added: numbers summed, lists position by position, a KV group's or the
    recurrent state's figures field by field (its shape kept); None where no replica has one."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    first = present[0]
    if is_dataclass(first) and not isinstance(first, type):
        return type(first)(
            **{
                f.name: getattr(first, f.name) if f.name in SHAPE else _add([getattr(v, f.name) for v in present])
                for f in fields(first)
            }
        )
    if isinstance(first, list):
        if first and is_dataclass(first[0]):
            return [_add(list(column)) for column in zip(*present)]
        return [sum(column) for column in zip_longest(*present, fillvalue=0)]
    return sum(present)


def with_replica_labels(pages: dict[str, str]) -> str:
    """One Prometheus page from each replica's (prometheus_client parses and writes them): every sample gets a
    `replica` label, every family its HELP and TYPE once, with the samples of all replicas together."""
    merged: dict[str, Metric] = {}
    for replica, page in pages.items():
        for family in text_string_to_metric_families(page):
            into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type, family.unit))
            into.samples += [s._replace(labels={"replica": replica, **s.labels}) for s in family.samples]
    return write_page(list(merged.values())).decode()
