"""RoPE: the rotary frequencies of every scaling type the supported families use, computed in one place.

Each type follows transformers' `modeling_rope_utils.ROPE_INIT_FUNCTIONS` formula by formula (default, linear,
llama3, yarn, longrope, dynamic, proportional), so a float32 model rotates exactly as transformers does; "factors" is
the form a GGUF file stores Llama 3 scaling in (llama.cpp's `rope_freqs` tensor: each frequency divided by its
factor). Proportional (Gemma 4's full-attention layers) rotates the whole head with the first share of its
frequencies and zeros for the rest: rotate-half pairs dim i with i + D/2, so the dims it leaves alone sit in
the middle of each half, not at the end as partial rotary's do.

Two types change with the sequence length in transformers, which a paged KV cache cannot follow (a cached key
keeps the rotation it was written with), so they are fixed here the way a cache can hold them:
- longrope (Phi-3): the long factors when the model's context is past the original one (what llama.cpp does at
  its full context), the short ones otherwise; it equals transformers on every sequence longer than the
  original context of such a model.
- dynamic (NTK): each position rotates with the base transformers uses when it decodes that position (the base
  for a sequence of position + 1 tokens, never below the original context): it equals transformers' cached
  generation whenever the prompt fits the original context.
Cos and sin tables cover every position up to the largest seen (grown on demand) and already carry the
attention factor of yarn and longrope, so the torch path and the fused C step read the same numbers.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pagedllm.errors import ModelLoadError
from pagedllm.model.config import rope_type


def _base_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    inv_l = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, inv_l)


def _yarn(dim: int, theta: float, s: dict[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    orig = float(s["original_max_position_embeddings"])
    factor = float(s.get("factor") or max_positions / orig)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = s.get("attention_factor")
    if attn is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attn)


def _longrope(dim: int, theta: float, s: dict[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    orig = int(s["original_max_position_embeddings"])
    factor = float(s.get("factor") or max_positions / orig)
    attn = s.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = torch.tensor(s["long_factor"] if max_positions > orig else s["short_factor"], dtype=torch.float32)
    inv = 1.0 / (ext * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv, float(attn)


def inv_freq(dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int) -> tuple[torch.Tensor, float]:
    """float32 inverse frequencies [dim / 2] and the attention factor cos/sin are multiplied by; `max_positions`
    is the model's context (what longrope and yarn derive their factor from when the config gives none).
    Dynamic scaling is position dependent: this is its frequency inside the original context."""
    kind = rope_type(scaling)
    base = _base_inv_freq(dim, theta)
    s = scaling or {}
    if kind in ("default", "dynamic"):
        return base, 1.0
    if kind == "linear":
        return base / float(s["factor"]), 1.0
    if kind == "llama3":
        return _llama3(base, s), 1.0
    if kind == "factors":
        factors = torch.tensor(s["factors"], dtype=torch.float32)
        if factors.numel() != base.numel():
            raise ModelLoadError(f"rope_freqs has {factors.numel()} factors, expected {base.numel()} (rotary dim / 2)")
        return base / factors, 1.0
    if kind == "proportional":  # Gemma 4: the first share of the frequencies turn, the rest (0) leave dims alone
        turning = int(float(s.get("partial_rotary_factor", 1.0)) * dim // 2)
        return torch.cat([base[:turning], torch.zeros(dim // 2 - turning)]) / float(s.get("factor", 1.0)), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, s, max_positions)
    return _longrope(dim, theta, s, max_positions)


def _dynamic_freqs(dim: int, theta: float, s: dict[str, Any], positions: torch.Tensor) -> torch.Tensor:
    """[n, dim / 2] angles per position for dynamic NTK: the base of a sequence of position + 1 tokens."""
    orig = float(s["original_max_position_embeddings"])
    factor = float(s["factor"])
    seq = torch.clamp(positions.double() + 1, min=orig)
    base = theta * ((factor * seq / orig) - (factor - 1)) ** (dim / (dim - 2))
    exps = torch.arange(0, dim, 2, dtype=torch.int64).double() / dim
    inv = (1.0 / (base[:, None] ** exps[None, :])).float()
    return positions.float()[:, None] * inv


class RotaryEmbedding:
    """cos/sin tables (float32 [positions, rotary_dim]) of one rotation: grown on demand, shared by its layers."""

    def __init__(
        self, rotary_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int, device: torch.device
    ) -> None:
        self.rotary_dim, self.theta, self.scaling = rotary_dim, theta, scaling
        self.dynamic = rope_type(scaling) == "dynamic"
        self.inv_freq, self.attn_factor = inv_freq(rotary_dim, theta, scaling, max_positions)
        self.inv_freq = self.inv_freq.to(device)
        self.cos_cache = torch.empty(0, rotary_dim, device=device)
        self.sin_cache = torch.empty(0, rotary_dim, device=device)
        self._build(min(max_positions, 8192))

    def _build(self, n: int) -> None:
        pos = torch.arange(n, device=self.inv_freq.device, dtype=torch.float32)
        if self.dynamic:
            freqs = _dynamic_freqs(self.rotary_dim, self.theta, self.scaling or {}, pos.cpu()).to(pos.device)
        else:
            freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_cache = emb.cos() * self.attn_factor
        self.sin_cache = emb.sin() * self.attn_factor

    def ensure(self, max_position: int) -> None:
        """Tables long enough to index `max_position`."""
        if max_position >= self.cos_cache.shape[0]:
            self._build(max(max_position + 1, 2 * self.cos_cache.shape[0]))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, rotary_dim] in `dtype`, for broadcasting over heads."""
        if positions.numel():
            self.ensure(int(positions.max()))
        return self.cos_cache[positions].to(dtype)[:, None, :], self.sin_cache[positions].to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; rotate-half RoPE on the first cos.shape[-1] dims (all of them but for partial
    rotary, Phi-3 / Phi-4-mini), in the Hugging Face layout (GGUF's permutation is undone at load)."""
    rd = cos.shape[-1]
    rot_in = x if rd == x.shape[-1] else x[..., :rd]
    half = rd // 2
    rotated = torch.cat((-rot_in[..., half:], rot_in[..., :half]), dim=-1)
    out = rot_in * cos + rotated * sin
    return out if rd == x.shape[-1] else torch.cat((out, x[..., rd:]), dim=-1)


def shift_rotary(x: torch.Tensor, inv_freq: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """Keys already rotated for their position p -> the same keys rotated for p + delta (`delta` [T] int, any sign).

    RoPE at p is a rotation by p * inv_freq per frequency pair, so rotating by delta * inv_freq composes to the
    rotation at p + delta (exact up to rounding). The attention factor of yarn / longrope is a scale already in
    the stored key, so it is not applied again. The angles are taken in float64 so a shift over thousands of
    positions loses no more than the float32 tables themselves. x: [T, heads, head_dim] float32; only the first
    2 * len(inv_freq) dims rotate (partial rotary)."""
    angles = delta.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
    return apply_rotary(x, cos, sin)
