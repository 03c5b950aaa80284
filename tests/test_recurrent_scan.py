"""recurrent.c's chunked scans (Gated DeltaNet's, Mamba2's SSD form) against their token loops (rec_scan_as,
chunked 1 / 0), built for every CPU class this machine runs: the same layer rows, the same output rows (after
DeltaNet's gated norm; Mamba2's before its norm) and state rows (the slots and every mark's row) within float32
rounding.

Cases cross the scan's 64-token chunks and its marks: a 150-token prompt marked at every 16-token block boundary
and off them (1, 63, 64, 65, 100), a 1-token and a 70-token sequence beside it, from carried states and from
zeros; value heads as wide as a vector or not (8, 24 floats: the scalar columns past the last vector), and
Qwen3.5's 128. Mamba2: head dims and state sizes as wide as a vector or not, one group or several (heads sharing
B and C), and Granite-4.0-H's / Nemotron-H's 64 x 128 heads.
"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.kernels.recurrent_scan import DeltaNetScan, Mamba2Scan
from pagedllm.model.kernels import cpu_kernel

TOL = 2e-5  # of the largest output or state value: float32 sums in another order over up to 150 tokens


@pytest.fixture(params=cpu_kernel.runnable_targets())
def target(request, monkeypatch):
    """The kernels of one class while the test runs (as tests/test_cpu_targets.py selects them)."""
    monkeypatch.setenv("PAGEDLLM_CPU_TARGET", request.param)
    cpu_kernel.load.cache_clear()
    yield request.param
    monkeypatch.delenv("PAGEDLLM_CPU_TARGET")
    cpu_kernel.load.cache_clear()


MARKS = [[1, 16, 32, 48, 63, 64, 65, 80, 96, 100, 112, 128, 144], [], [64]]  # at block boundaries and off them
LENS = [150, 1, 70]


@pytest.mark.parametrize(
    "key_heads,value_heads,dk,dv",
    [(2, 4, 16, 8), (1, 3, 32, 24), (2, 2, 128, 128)],
)
@pytest.mark.parametrize("carried", [True, False])
def test_the_chunked_scan_equals_the_token_loop(target, key_heads, value_heads, dk, dv, carried):
    scan = DeltaNetScan(key_heads, value_heads, dv, LENS, MARKS, carried=carried, dk=dk, seed=dv)
    (want, want_state), (got, got_state) = scan.run(False), scan.run(True)
    assert np.abs(want_state[scan.slots - 1]).max() > 0  # the last mark's row was written
    assert np.abs(got - want).max() < TOL * np.abs(want).max()
    assert np.abs(got_state - want_state).max() < TOL * max(1.0, np.abs(want_state).max())


@pytest.mark.parametrize("heads,head_dim,state,groups", [(4, 8, 16, 2), (3, 24, 40, 1), (6, 16, 8, 3), (2, 64, 128, 1)])
@pytest.mark.parametrize("carried", [True, False])
def test_mamba2s_chunked_scan_equals_the_token_loop(target, heads, head_dim, state, groups, carried):
    scan = Mamba2Scan(heads, head_dim, state, groups, LENS, MARKS, carried=carried, seed=head_dim)
    (want, want_state), (got, got_state) = scan.run(False), scan.run(True)
    assert np.abs(want_state[scan.slots - 1]).max() > 0  # the last mark's row was written
    assert not np.array_equal(got, want)  # the chunked form ran (its sums in another order), not the loop again
    assert np.abs(got - want).max() < TOL * np.abs(want).max()
    assert np.abs(got_state - want_state).max() < TOL * max(1.0, np.abs(want_state).max())
