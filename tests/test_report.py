"""`bench sweep` and `rag bench` print with one table formatter and one latency summary: a figure that was not
measured is None in the results and "-" in both tables, never NaN or 0."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from pagedllm.bench import sweep
from pagedllm.rag.bench import make_row, markdown_table
from pagedllm.report import Column, Latency, format_table


def test_latency_summary_is_numpys_and_none_without_values():
    assert Latency.of([1.0, 2.0, 3.0, 4.0]) == Latency(2.5, pytest.approx(3.97))
    assert Latency.of([]) == Latency(None, None)


def test_a_rag_row_without_answers_reports_no_latency_and_prints_dashes():
    row = make_row("canonical", "on", [], 0.0, [])
    assert (row.ttft_median_ms, row.ttft_p99_ms, row.tpot_median_ms, row.retrieval_median_ms) == (None,) * 4
    cells = markdown_table([asdict(row)]).splitlines()[2].strip("|").split("|")
    assert [c.strip() for c in cells][5:7] == ["-", "-"] and "nan" not in " ".join(cells).lower()


def test_sweep_and_rag_tables_are_one_formatter():
    rows = [{"name": "a", "ms": 1.25}, {"name": "bb", "ms": None}]
    columns = [Column("name", "name", align="<"), Column("ms", "TTFT ms", "{:.1f}")]
    assert format_table(rows, columns).splitlines() == ["name  TTFT ms", "a         1.2", "bb          -"]
    assert format_table(rows, columns, markdown=True).splitlines()[1:] == ["|---|---|", "| a | 1.2 |", "| bb | - |"]
    assert sweep.format_table([{"setting": "x", "median_ttft_ms": None}]).splitlines()[1].split()[-1] == "-"
