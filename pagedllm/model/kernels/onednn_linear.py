"""Linear layers on CPU through oneDNN with weights packed once at load time.

Why: `F.linear` on CPU hands the weight to MKL, which copies it into its blocked layout on every call. With a
step of a few dozen tokens (decoding), that copy and the cold weight reads it causes are a large share of the
matmul. oneDNN can reorder a weight once into the layout its kernels want; each call then streams the packed
weight once. Measured on this project's CPU for 64 tokens, cold caches: lm_head (49,152 x 576) 75 -> 34 ms,
gate/up (3,072 x 576) 4.2 -> 3.0 ms; a whole decode step of the default model about a third faster.

Packing is best effort: where oneDNN lacks a kernel (bfloat16 on a CPU without AVX-512 BF16 or AVX-NE-CONVERT)
or the op is missing, the weight stays as it is and `F.linear` serves it.

Packing is the last step of loading a model for CPU inference: a packed layer keeps its weight outside its
parameters (which are emptied to save the memory), so it is not meant to be moved, saved or reloaded after
(linear.py's PackedMethod).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.model.kernels.quant_linear import QuantWeight, qlinear

BATCH_HINT = 64  # the step size oneDNN tunes its layout for; any number of rows works


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight [out, in] in oneDNN's layout, or None where that is not available.

    The probe call matters: oneDNN may reorder a weight it then has no matmul kernel for (bfloat16 on AVX2), and
    finding that out here beats failing in the middle of a request."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
        probe = torch.ones(2, weight.shape[1], dtype=weight.dtype)
        torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (RuntimeError, AttributeError, NotImplementedError):
        return None
    return packed


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
    quant: QuantWeight | None = None,
) -> torch.Tensor:
    """x @ weight.T + bias: callers pass `packed` or `quant` when they have it, so one call site serves every
    form of a weight (dense, oneDNN-packed, quantized) on CPU and GPU."""
    if quant is not None:
        return qlinear(x, quant, bias)
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
