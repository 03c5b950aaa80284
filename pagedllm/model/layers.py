"""The small layers of a Llama-family decoder: RMSNorm, rotary embeddings, the gated MLP.

Numerics deliberately follow Hugging Face transformers (norm in float32 then cast, rotary cos/sin computed in
float32 then cast, rotate-half formulation) so that float32 results agree to ~1e-5 and bfloat16 ones mostly
pick the same top token. Nothing here is CPU-specific: tensors live on whatever device the weights do.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model.cpu_linear import linear
from pagedllm.model.quant import QuantWeight


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """An uninitialised, frozen parameter: weights always come from a checkpoint, so random init is wasted time."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    """y = w * (x / rms(x)), computed in float32 and cast back, as transformers does."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = empty_param(hidden_size, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32) and the attention scaling for default, linear and llama3 RoPE."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq, 1.0
    rtype = scaling.get("rope_type") or scaling.get("type")
    if rtype == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if rtype == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        inv_l = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, inv_l), 1.0
    raise ValueError(f"unsupported rope_scaling type {rtype!r} (supported: linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables (float32) for every position; `cos_sin(positions)` is one index per step."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        inv_freq, attn_scale = rope_inv_freq(head_dim, theta, scaling)
        self.max_positions = max_positions
        self._build(inv_freq.to(device), attn_scale, max_positions)
        self.inv_freq = inv_freq.to(device)
        self.attn_scale = attn_scale

    def _build(self, inv_freq: torch.Tensor, attn_scale: float, n: int) -> None:
        pos = torch.arange(n, device=inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_cache = emb.cos() * attn_scale
        self.sin_cache = emb.sin() * attn_scale

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_dim] in `dtype`, for broadcasting over heads."""
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self.cos_cache.shape[0]:  # positions past the config's max: extend rather than fail
            self._build(self.inv_freq, self.attn_scale, max(need, 2 * self.cos_cache.shape[0]))
        return self.cos_cache[positions].to(dtype)[:, None, :], self.sin_cache[positions].to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; rotate-half RoPE (the Hugging Face layout, after undoing GGUF's permutation)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up merged into one matmul (one weight read, one kernel call)."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.inter = inter
        self.gate_up_weight = empty_param(2 * inter, hidden, dtype=dtype, device=device)
        self.down_weight = empty_param(hidden, inter, dtype=dtype, device=device)
        self.packed: dict[str, torch.Tensor] = {}
        self.quant: dict[str, QuantWeight] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = linear(
            x, self.gate_up_weight, packed=self.packed.get("gate_up_weight"), quant=self.quant.get("gate_up_weight")
        )
        g, u = gu.split(self.inter, dim=-1)
        return linear(
            F.silu(g) * u, self.down_weight, packed=self.packed.get("down_weight"), quant=self.quant.get("down_weight")
        )
