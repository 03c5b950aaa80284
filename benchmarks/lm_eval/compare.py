"""Compare two lm-evaluation-harness runs of the same loglikelihood task, sample by sample: how often the two
pick the same answer, and the largest difference in a choice's loglikelihood.

Usage: python benchmarks/lm_eval/compare.py RUN_A/samples_tiny_facts_*.jsonl RUN_B/samples_tiny_facts_*.jsonl
(the files lm_eval writes with --log_samples); see docs/benchmarks.md, "Scoring with lm-evaluation-harness".
"""

from __future__ import annotations

import json
import sys


def _load(path: str) -> dict[int, tuple[list[float], float, float]]:
    """doc id -> (loglikelihood per choice, acc, acc_norm)."""
    out = {}
    with open(path) as f:
        for line in f:
            d = json.loads(line)
            out[d["doc_id"]] = ([float(r[0]) for r in d["filtered_resps"]], d["acc"], d["acc_norm"])
    return out


def main(a_path: str, b_path: str) -> None:
    a, b = _load(a_path), _load(b_path)
    assert a.keys() == b.keys(), "the two runs scored different documents"
    same_pick = sum(
        max(range(len(a[k][0])), key=a[k][0].__getitem__) == max(range(len(b[k][0])), key=b[k][0].__getitem__)
        for k in a
    )
    diff = max(abs(x - y) for k in a for x, y in zip(a[k][0], b[k][0]))
    acc = [sum(run[k][1] for k in run) / len(run) for run in (a, b)]
    print(
        f"documents {len(a)}; same answer picked {same_pick}/{len(a)}; acc {acc[0]:.3f} vs {acc[1]:.3f}; "
        f"largest |loglikelihood difference| {diff:.2e}"
    )


if __name__ == "__main__":
    main(*sys.argv[1:3])
