"""What the benchmarks print, written once: a latency summary (median and percentiles, None where nothing was
measured, never NaN or 0 that a table would show as a figure) and one table formatter (plain or Markdown) that
`bench sweep` and `rag bench` share, so a missing figure reads "-" in both."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


def percentile(values: Sequence[float], q: float) -> float | None:
    """numpy's percentile (linear interpolation); None for no values."""
    return float(np.percentile(values, q)) if len(values) else None


@dataclass(frozen=True)
class Latency:
    """Median and p99 of some latencies, in the unit they came in; None where there were none."""

    median: float | None
    p99: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> Latency:
        return cls(percentile(values, 50), percentile(values, 99))


@dataclass(frozen=True)
class Column:
    key: str  # the row dict's key
    header: str
    fmt: str = "{}"  # applied to a value that is not None; None prints "-"
    align: str = ">"  # ">" numbers, "<" names (plain tables only)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[Column], markdown: bool = False) -> str:
    """`rows` as a table of `columns`: aligned plain text, or Markdown."""
    cells = [[c.header for c in columns]]
    for r in rows:
        cells.append(["-" if r.get(c.key) is None else c.fmt.format(r[c.key]) for c in columns])
    if markdown:
        lines = ["| " + " | ".join(cells[0]) + " |", "|" + "|".join("---" for _ in columns) + "|"]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells[1:]])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(f"{row[i]:{c.align}{widths[i]}}" for i, c in enumerate(columns)).rstrip() for row in cells
    )


__all__ = ["Column", "Latency", "format_table", "percentile"]
