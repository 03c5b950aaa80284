"""The KV cache takes memory as requests write it, not all at start-up (issue 27, item 4): a large cache adds
(almost) nothing resident when it is made, reads as zeros, and a step on it gives what a step on a small cache
gives. Memory is counted (/proc/self/statm), never timed."""

from __future__ import annotations

import os

import pytest
import torch

from pagedllm.model import ModelRunner, SeqChunk

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux's /proc/self/statm")


def resident_mib() -> float:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_a_large_cache_is_resident_only_where_written(model_fp32):
    small = ModelRunner(model_fp32, num_blocks=4, block_size=16)
    before = resident_mib()
    big = ModelRunner(model_fp32, num_blocks=4096, block_size=16)
    made = resident_mib() - before
    cache_mib = big.kv_cache_bytes() / 2**20
    assert cache_mib > 256 and made < 16, (cache_mib, made)
    k, v = big.kv_caches[-1]
    assert not k[-1].any() and not v[0].any()
    prompt = list(range(20, 60))
    want = small.execute([SeqChunk(prompt, 0, [0, 1, 2])])
    got = big.execute([SeqChunk(prompt, 0, [4093, 17, 4095])])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert resident_mib() - before < 64
