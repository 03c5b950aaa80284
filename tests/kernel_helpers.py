"""Where the C kernels are meant to exist: skipped only without a C compiler (or with the torch path forced);
where a compiler exists, a kernel that fails to build fails the tests that need it instead of skipping them."""

from __future__ import annotations

import os
import shlex
import shutil

import numpy as np
import pytest

from pagedllm.model.kernels.quant_linear import QuantParts

CC = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or ""]
KERNEL_EXPECTED = bool(CC[0]) and os.environ.get("PAGEDLLM_ATTENTION", "").lower() != "torch"
needs_kernel = pytest.mark.skipif(not KERNEL_EXPECTED, reason="no C compiler: the kernel is not built here")


def random_parts(fmt: str, n: int, k: int, seed: int) -> QuantParts:
    """A random quantized weight [n, k] in plain form: codes of the format's range, small float16 scales."""
    rng = np.random.default_rng(seed)
    g = k // 32
    if fmt == "q4_1":
        return QuantParts(
            "q4_1",
            rng.integers(0, 16, (n, k)).astype(np.uint8),
            rng.normal(0, 0.01, (n, g)).astype(np.float16),
            rng.normal(0, 0.05, (n, g)).astype(np.float16),
            "test",
        )
    return QuantParts(
        "q8_0",
        rng.integers(-128, 128, (n, k)).astype(np.int8),
        rng.normal(0, 0.001, (n, g)).astype(np.float16),
        None,
        "test",
    )


# where each type keeps its float16 scales: (byte offset in the block, how many)
