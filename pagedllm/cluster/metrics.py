"""The cluster's figures from its replicas': engine stats added up, Prometheus pages labelled per replica.

Each replica keeps its own metrics (vLLM's names, fed by its engine thread, exactly as the single-process server
does); the cluster's /metrics is their pages with a `replica` label on every sample, so a dashboard sums over
the label for the cluster and splits by it per replica, and bench serve's prefix-cache hit rate (which sums the
counters over label sets) is the cluster's.
"""
from __future__ import annotations

from dataclasses import fields
from itertools import zip_longest

from pagedllm.engine.stats import EngineStats


def sum_stats(stats: list[EngineStats]) -> EngineStats:
    """Counters and gauges added up across replicas (per-position lists position by position); kv_usage is the
    share of all their blocks in use."""
    total = {f.name: _add([getattr(s, f.name) for s in stats]) for f in fields(EngineStats)}
    total["block_size"] = stats[0].block_size if stats else 0
    total["kv_usage"] = 1 - total["num_free_blocks"] / total["num_blocks"] if total["num_blocks"] else 0.0
    return EngineStats(**total)


def _add(values: list) -> int | float | list[int]:
    if values and isinstance(values[0], list):
        return [sum(column) for column in zip_longest(*values, fillvalue=0)]
    return sum(values)


def with_replica_labels(pages: dict[str, str]) -> str:
    """One Prometheus page from each replica's: every sample gets a `replica` label, every family its HELP and
    TYPE once, followed by the samples of all replicas (the text format wants a family's samples together)."""
    heads: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for replica, page in pages.items():
        family = ""
        for line in page.splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                family = line.split()[2]
                head = heads.setdefault(family, [])
                if line not in head:
                    head.append(line)
                samples.setdefault(family, [])
            elif line and not line.startswith("#"):
                samples.setdefault(family, []).append(_labelled(line, replica))
                heads.setdefault(family, [])
    return "".join("\n".join(heads[f] + samples[f]) + "\n" for f in heads)


def _labelled(sample: str, replica: str) -> str:
    label = f'replica="{replica}"'
    name, brace, rest = sample.partition("{")
    if not brace:
        name, _, value = sample.partition(" ")
        return f"{name}{{{label}}} {value}"
    return f"{name}{{{label}{'' if rest.startswith('}') else ','}{rest}"
