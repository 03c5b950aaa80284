"""The C++ decode kernel reads the same attention as the portable torch kernel, through the same block tables."""
from __future__ import annotations

import pytest
import torch

from pagedllm.model.attention import TorchPagedAttention, build_metadata
from pagedllm.model.cpu_kernels import paged_decode_kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_matches_torch_path(dtype):
    kernel = paged_decode_kernel()
    if kernel is None:
        pytest.skip("no C++ compiler here: the engine runs the portable kernel")
    torch.manual_seed(0)
    nb, bs, kvh, h, d = 64, 8, 2, 6, 32
    starts = [0, 5, 17, 40, 63]
    tables = [torch.randperm(nb)[:(s + 1 + bs - 1) // bs].tolist() for s in starts]  # shuffled, non-contiguous
    meta = build_metadata([1] * len(starts), starts, tables, bs, torch.device("cpu"))
    q = torch.randn(len(starts), h, d, dtype=dtype)
    k = torch.randn(len(starts), kvh, d, dtype=dtype)
    v = torch.randn(len(starts), kvh, d, dtype=dtype)
    caches = [torch.randn(nb, bs, kvh, d, dtype=dtype) for _ in range(4)]
    ref = TorchPagedAttention().forward(q, k, v, caches[0], caches[1], meta)
    caches[2].copy_(caches[0])
    caches[3].copy_(caches[1])
    out = TorchPagedAttention(decode_kernel=kernel).forward(q, k, v, caches[2], caches[3], meta)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype and torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol)
    assert torch.equal(caches[0], caches[2])  # the new K/V were written to the same slots
