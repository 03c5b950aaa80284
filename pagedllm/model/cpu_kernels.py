"""C++ kernels for the CPU, compiled on first use with torch's cpp_extension and cached by torch.

The portable torch attention gathers every sequence's blocks into a padded tensor before a decode step, so it
copies the whole context of the batch in every layer; `csrc/paged_decode.cpp` reads the cache in place instead.
If the build fails (no compiler), the engine warns once and keeps the portable kernel. PAGEDLLM_ATTENTION=torch
forces the portable kernel (to compare the two, or to skip the ~1 minute first build).
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable

log = logging.getLogger("pagedllm")

_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "paged_decode.cpp")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math"]
_kernel: Callable | None = None
_tried = False


def paged_decode_kernel() -> Callable | None:
    """`paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale)`, or None where it cannot be had."""
    global _kernel, _tried
    if os.environ.get("PAGEDLLM_ATTENTION", "auto") == "torch":
        return None
    if not _tried:
        _tried = True
        try:
            from torch.utils.cpp_extension import load

            _kernel = load(name="pagedllm_paged_decode", sources=[_SOURCE], extra_cflags=_FLAGS,
                           extra_ldflags=["-fopenmp"]).paged_decode
        except Exception as e:  # a missing compiler or ninja must not stop the engine
            log.warning("could not build the C++ decode-attention kernel (%s); using the portable torch kernel", e)
    return _kernel
