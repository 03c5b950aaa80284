"""A step of a quantized model as one C call (csrc/model_step.c) instead of ~1,200 torch ops.

Used by `ModelRunner` for every step (decode tokens and prefill chunks alike) when every matmul weight, the
embedding table and the LM head are kept quantized (`--quantization gguf|int8|int4`) and the kernels are built. The
structures are the C ones, read from csrc/model_step.h; they are filled once per runner (weights, caches), and what
changes per step is a few int64 arrays: `attention.group_step_index`, the builder the torch path uses too (each
layer reads its KV-cache group's tables and slots: a Gemma 3 has a table per group). Every family runs here: what a
layer does beyond the plain Llama one is read from the decoder's own modules (which norms it has, with their
offsets; q/k norms; its RoPE; its `attn_spec`: window, scale, soft-cap, sinks; a sparse layer's router, routed
experts (the structure moe_kernel.py built for the torch path) and their latent projections, shared expert and the
dense MLP beside them with its norms and the router's scales (Gemma 4's 26B-A4B); a linear layer's recurrent mixer
(recurrent.h's RecMixer: Gated DeltaNet, Mamba2, short conv, over the runner's state slots); Gemma 4's per-layer
head sizes, shared KV, keys equal to values, per-layer inputs and scalars) and the config's multipliers, so the C
step computes what the torch path computes, number for number (a router's logits to rounding: the C step sums its
dot products in its own order).

Rows under LoRA adapters get their term in the same call (csrc/lora.c, the rows from LoRAManager.fused_step).

With --dtype bfloat16 on a CPU with AMX, matmuls of at least the measured number of rows (kernel_choice.py)
run on AMX with their inputs rounded to bfloat16; everything else computes in float32.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

import pagedllm.model.kernels.cpu_kernel as cpu_kernel
import pagedllm.model.kernels.kv_quant as kv_quant
from pagedllm.model.config import ModelConfig
from pagedllm.model.kernels.quant_linear import FORMATS, QuantWeight, bf16_kernel, log_once
from pagedllm.model.layers.attention import StepIndex, group_step_index
from pagedllm.model.layers.common import RMSNorm
from pagedllm.model.layers.decoder import CausalLM, DecoderLayer, Mixer
from pagedllm.model.layers.deltanet import GatedDeltaNet
from pagedllm.model.layers.linear import Linear
from pagedllm.model.layers.mamba2 import Mamba2
from pagedllm.model.layers.moe import SparseMoE
from pagedllm.model.layers.shortconv import ShortConv
from pagedllm.model.lora import FusedLoRA

# the C structures (csrc/model_step.h), read from the header itself; cpu_kernel.load() checks their sizes
_STRUCTS = cpu_kernel.c_structs("model_step.h")
_Layer, _Model, _Batch = _STRUCTS["StepLayer"], _STRUCTS["StepModel"], _STRUCTS["StepBatch"]
_Mixer = cpu_kernel.c_structs("recurrent.h")["RecMixer"]


PHASES = ("norm", "qkv", "rope+kv write", "attention", "o", "gate_up", "act", "down", "lm_head", "router", "experts")


ERRORS = {
    -1: "out of memory",
    -2: "bad sizes",
    -3: "a context length outside the block table",
    -4: "a block id outside the cache",
    -5: "a token id, position, slot or row out of range",
}


ROPES = {"none": 0, "global": 1, "local": 2}  # DecoderLayer.rope -> StepLayer.rope (ROPE_NONE ...)
ACTS = {"silu": 0, "gelu_pytorch_tanh": 1, "relu2": 2}  # ModelConfig.hidden_act -> StepModel.act (ACT_SILU ...)
ROUTERS = {"softmax_topk": 0, "topk_softmax": 1, "sigmoid": 2}  # ModelConfig.moe_router -> StepModel.router
MIXERS = {GatedDeltaNet: 0, Mamba2: 1, ShortConv: 2}  # a linear layer's mixer -> RecMixer.kind (MIX_*)
States = dict[int, tuple[torch.Tensor, torch.Tensor]]  # model layer -> its (conv, recurrent) state rows (runner.py)


def _model_blockers(cfg: ModelConfig) -> list[str]:
    """What of a model's config the C step does not compute (its check() would refuse the sizes)."""
    checks = [
        (cfg.hidden_act not in ACTS, f"activation {cfg.hidden_act}"),
        (cfg.rotary_dim % 2 != 0, "an odd rotary width"),
        (cfg.num_experts > 0 and cfg.moe_router not in ROUTERS, f"MoE router {cfg.moe_router}"),
    ]
    return [why for hit, why in checks if hit]


def _moe_blocker(model: CausalLM) -> str | None:
    """Why the C step cannot run a model's sparse blocks (None: it can): it runs the routed experts as moe.c
    does (every expert quantized, one format), and reads the router's and the shared gate's float weights."""
    for layer in model.decoder_layers:
        moe = layer.moe
        if moe is None:
            continue
        if moe.experts_kernel() is None:
            return "experts the MoE kernel does not run"
        gates = [lin for lin in (moe.router, moe.shared_gate) if lin is not None]
        if any(lin.quant is not None or lin.weight.numel() == 0 for lin in gates):
            return "a quantized router"
    return None


def _state_arrays(
    state_slots: list[int] | None, state_marks: list[list[tuple[int, int]]] | None
) -> tuple[np.ndarray | None, ...]:
    """StepBatch's state_slots, mark_first, mark_at, mark_row (model_step.h) of each sequence's slot and (t, row)
    marks; None for the slots of a model without recurrent layers, and for the marks where no sequence has one
    (the step writes its final states only)."""
    slots = None if state_slots is None else np.array(state_slots, dtype=np.int64)
    if not state_marks or not any(state_marks):
        return slots, None, None, None
    first = np.cumsum([0] + [len(m) for m in state_marks], dtype=np.int64)
    pairs = np.array([p for m in state_marks for p in m], dtype=np.int64).reshape(-1, 2)
    return slots, first, np.ascontiguousarray(pairs[:, 0]), np.ascontiguousarray(pairs[:, 1])


def unfused_reason(
    model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], states: States | None = None
) -> str | None:
    """Why the C step cannot run this model over these caches and recurrent states (None: it can). It needs the
    kernels, every weight quantized, CPU caches and states it reads, and a model it computes (see
    _model_blockers)."""
    if cpu_kernel.load() is None:
        return "the C kernels are not built"
    ple = model.per_layer
    if (
        model.embed.quant is None
        or (ple is not None and ple.embed.quant is None)
        or any(lin.quant is None for lin in model.linears() if not lin.keep_dense)
    ):
        return "not every weight is quantized"
    if any(kc.device.type != "cpu" or kc.dtype not in kv_quant.KINDS for kc, _ in kv_caches):
        return "a KV cache the C step does not read"
    if not all(_rows_read(kc) and _rows_read(vc) for kc, vc in kv_caches):
        return "a KV cache the C step does not read"
    if model.config.linear_layers and not _states_read(model.config.linear_layers, states):
        return "recurrent states the C step does not read"
    blockers = _model_blockers(model.config)
    if not blockers and (why := _moe_blocker(model)) is not None:
        blockers = [why]
    return None if not blockers else f"{model.config.family} uses " + ", ".join(blockers)


def _rows_read(cache: torch.Tensor) -> bool:
    """A [blocks, block_size, KV heads, row] cache whose heads lie side by side at the front of each token's row,
    block after block: the whole tensor, or runner.layer_view's front of a wider slot (StepLayer.kv_stride)."""
    _, bs, heads, row = cache.shape
    return (
        cache.stride(3) == 1
        and cache.stride(2) == row
        and cache.stride(1) >= heads * row
        and (cache.stride(0) == bs * cache.stride(1))
    )


def _states_read(layers: list[int], states: States | None) -> bool:
    """Every linear layer's states are CPU tensors the C step reads: float32 (the conv's bfloat16 too)."""
    if states is None or any(i not in states for i in layers):
        return False
    ok = (torch.float32, torch.bfloat16), (torch.float32,)
    return all(
        t.device.type == "cpu" and t.is_contiguous() and t.dtype in dtypes
        for conv, rec in states.values()
        for t, dtypes in zip((conv, rec), ok)
    )


def fusable(model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], states: States | None = None) -> bool:
    """Whether the C step can run this model (the reason it cannot is logged once)."""
    why = unfused_reason(model, kv_caches, states)
    if why is not None and model.embed.quant is not None:
        log_once(f"steps run on the torch path, not the fused C step: {why}")
    return why is None


def mixer_eps(mixer: Mixer) -> float:
    """The gated norm's epsilon (a short conv has no norm)."""
    return 0.0 if isinstance(mixer, ShortConv) else mixer.eps


def deltanet_perm(mixer: GatedDeltaNet) -> np.ndarray | None:
    """The projections' row as stored (`ModelConfig.linear_proj`) -> the canonical row [q, k, v, z, b, a] of every
    head (recurrent.h), as GatedDeltaNet._project splits it; None where they are stored canonical ("split").
    Qwen3-Next's in_qkvz holds [q, k, v, z] per key head; its in_ba (and llama.cpp's ssm_ba) [b, a] per key head."""
    if mixer.proj == "split":
        return None
    dk, dv, hk, r = mixer.dk, mixer.dv, mixer.hk, mixer.hv // mixer.hk
    ba = mixer.conv_dim + mixer.value_dim
    if mixer.proj == "fused":
        group = 2 * dk + 2 * r * dv
        parts = [(0, dk, group), (dk, dk, group), (2 * dk, r * dv, group), (2 * dk + r * dv, r * dv, group)]
        idx = [start + j * stride + c for start, size, stride in parts for j in range(hk) for c in range(size)]
    else:  # "qkv_z_ba": q, k, v and z as they are
        idx = list(range(ba))
    idx += [start + j * 2 * r + c for start in (ba, ba + r) for j in range(hk) for c in range(r)]
    return np.array(idx, dtype=np.int64)


def i8_kinds(model: CausalLM) -> int:
    """StepModel.i8_kinds: bit p set where the matmuls of profile slot p (PHASES: the kinds of CausalLM.weights_by_kind)
    take the int8 route, bit len(PHASES) where those of no kind do (a recurrent mixer's projections, a per-layer
    input's, a sparse block's latent projections: the C step plans them under the slots of qkv, o, gate_up, down or
    experts, but their route is their own). The torch path takes the route per weight (QuantWeight.i8_min_rows), the
    C step per kind, so the two agree where a kind's weights agree, as the loader and the benchmarks set them (every
    weight under --quantized-activations int8; some kinds under dot_accuracy's and prefill_ttft's --int8-on, which
    measure which matmul carries the route's error: docs/benchmarks.md, "per matmul")."""
    kinds = {id(w): k for k, ws in model.weights_by_kind().items() for w in ws}
    skip = {id(model.embed.quant)} | ({id(model.per_layer.embed.quant)} if model.per_layer is not None else set())
    for layer in model.decoder_layers:  # the routed experts: their own route (MoeLayer.i8_min_rows)
        skip |= {id(m.quant) for k, m in layer.slots().items() if k.startswith("experts_") and isinstance(m, Linear)}
    skip -= set(kinds)  # a tied head: the embedding table's weight, a matmul here
    bits = 0
    for w in model.quant_weights():
        if w.i8_min_rows > 0 and id(w) not in skip:
            kind = kinds.get(id(w))
            bits |= 1 << (PHASES.index(kind) if kind is not None else len(PHASES))
    return bits


def _quant(lin: Linear) -> QuantWeight:
    w = lin.quant
    assert w is not None, "fusable() checked every weight is quantized"
    return w


class FusedStep:
    """Runs steps of one model over one set of KV caches."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        layer_group: Sequence[int] | None = None,
        states: States | None = None,
    ) -> None:
        """`kv_caches[i]`: layer i's K and V (its slot's); `layer_group[i]`: the KV-cache group whose tables layer
        i reads (kv_spec.py; default: one group of every layer); `states[i]`: linear layer i's conv and recurrent
        state rows, one per state slot (the runner's), advanced in place by each step."""
        lib = cpu_kernel.load()
        assert lib is not None, "built only where fusable() found the kernels"
        self.lib = lib
        self.model, self.block_size = model, block_size
        groups = list(layer_group) if layer_group is not None else [0] * len(model.layers)
        self.num_groups = max(groups) + 1
        self._keep: list[object] = []  # what the C structures point into: float32 copies, the experts' kernels
        self._reads = torch.zeros(1, dtype=torch.int64)  # experts read by a step (StepModel.expert_reads)
        self.states = states or {}
        self.layers = (_Layer * len(model.layers))(
            *[
                self._layer(layer, kc, vc, g)
                for layer, (kc, vc), g in zip(model.decoder_layers, kv_caches, groups, strict=True)
            ]
        )
        self.dims = self._model(kv_caches[0][0])
        self.lora_group_rows = int(lib.lora_group_rows())  # LoRA rows of one adapter that share a read (lora.c)
        self.profile: np.ndarray | None = None  # float64 [len(PHASES)]: seconds per phase, summed, when set

    def _f32(self, t: torch.Tensor | None) -> int | None:
        if t is None:
            return None
        t = t.detach().float().contiguous()
        self._keep.append(t)
        return t.data_ptr()

    def _norm(self, norm: RMSNorm | None) -> int | None:
        """A norm's weight with its offset added in float32 as RMSNorm adds it (Gemma's 1 + w), or None (NULL:
        the layer has no such norm)."""
        if norm is None:
            return None
        w = norm.weight.detach().float()
        return self._f32(norm.offset + w if norm.offset else w)

    def _layer(self, layer: DecoderLayer, k_cache: torch.Tensor, v_cache: torch.Tensor, group: int) -> ctypes.Structure:
        spec = layer.attn_spec
        fields: dict[str, float | int | None] = {
            "window": spec.window or 0,
            "scale": spec.scale if spec.scale is not None else layer.head_dim**-0.5,
            "softcap": spec.softcap or 0.0,
            "attn_norm": self._norm(layer.attn_norm),
            "ffn_norm": self._norm(layer.mlp_norm),
            "attn_out_norm": self._norm(layer.attn_out_norm),
            "ffn_out_norm": self._norm(layer.mlp_out_norm),
            "q_norm": self._norm(layer.q_norm),
            "k_norm": self._norm(layer.k_norm),
            "qk_norm_full": int(layer.qk_norm == "full"),
            "rope": ROPES[layer.rope],
            "qkv_bias": self._f32(layer.qkv.bias) if layer.attends else None,
            "o_bias": self._f32(layer.o.bias) if layer.attends else None,
            "k_cache": k_cache.data_ptr(),
            "v_cache": v_cache.data_ptr(),
            "group": group,
            "sinks": self._f32(spec.sinks),
        }
        rope = self.model.ropes.get(layer.rope)
        fields |= {
            "head_dim": layer.head_dim,
            "kv_heads": layer.num_kv_heads,
            "rotary_dim": 0 if rope is None else rope.cos_cache.shape[-1],
            "inter": self.model.config.layer_intermediate_size(layer.index),
            "kv_parts": layer.kv_parts,
            "v_norm": int(layer.v_norm),
            "kv_stride": k_cache.stride(1),  # wider than its heads where its rows are the front of a slot's
            "scalar": None if layer.scalar is None else self._f32(layer.scalar.weight),
            "no_mixer": int(not layer.has_mixer),  # a single-block layer's (Nemotron-H)
            "no_mlp": int(not layer.has_mlp),
        }
        ple = layer.per_layer_input
        if ple is not None:
            gate, proj = _quant(ple.gate), _quant(ple.proj)
            fields |= {"ple_gate": gate.tiles.data_ptr(), "ple_gate_fmt": FORMATS[gate.fmt]}
            fields |= {"ple_proj": proj.tiles.data_ptr(), "ple_proj_fmt": FORMATS[proj.fmt]}
            fields["ple_norm"] = self._norm(ple.norm)
        mixer = layer.linear_attn
        if mixer is not None:
            fields["mixer"] = self._mixer(mixer, *self.states[layer.index])
        moe = layer.moe
        mlp = list(zip(("gate_up", "down"), layer.dense_linears()))  # a sparse layer's: the MLP beside (Gemma 4)
        if moe is not None:
            fields |= self._sparse(layer, moe)
            if moe.shared is not None:
                mlp += [("shared_gate_up", moe.shared.gate_up), ("shared_down", moe.shared.down)]
            if moe.latent_in is not None and moe.latent_out is not None:
                mlp += [("latent_in", moe.latent_in), ("latent_out", moe.latent_out)]
        attn = [("qkv", layer.qkv), ("o", layer.o)] if layer.attends else []
        for name, lin in (*attn, *mlp):
            w = _quant(lin)
            fields[name], fields[f"{name}_fmt"] = w.tiles.data_ptr(), FORMATS[w.fmt]
        return _Layer(**fields)

    def _mixer(self, mixer: Mixer, conv: torch.Tensor, rec: torch.Tensor) -> int:
        """A linear layer's RecMixer (recurrent.h): its projections' tiles in the canonical row's order, the
        conv's and the recurrence's float32 parameters, and its state rows, which each step advances in place."""
        fields: dict[str, Any] = {"kind": MIXERS[type(mixer)], "kernel": mixer.kernel, "eps": mixer_eps(mixer)}
        if isinstance(mixer, GatedDeltaNet):
            ins = mixer.linears()[:-1]  # the input projections as stored (`linear_proj`), then `out`
            heads, groups, dk, dv = mixer.hv, mixer.hk, mixer.dk, mixer.dv
            fields |= {"conv_dim": mixer.conv_dim, "out_k": mixer.value_dim, "norm": self._f32(mixer.norm.weight)}
            fields |= {"a_log": self._f32(mixer.a_log.weight), "dt_bias": self._f32(mixer.dt_bias.weight)}
            conv_w, conv_b, out = mixer.conv.weight[:, 0], None, mixer.out
            perm = deltanet_perm(mixer)
            fields["tiled"] = int(mixer.tiled)  # value head h reads key head h % groups
        elif isinstance(mixer, Mamba2):
            ins, perm = [mixer.in_proj], None
            heads, groups, dk, dv = mixer.heads, mixer.groups, mixer.head_dim, mixer.state_size
            fields |= {"conv_dim": mixer.conv_dim, "out_k": mixer.inner, "norm": self._f32(mixer.norm.weight)}
            fields |= {"a_log": self._f32(mixer.a_log.weight), "dt_bias": self._f32(mixer.dt_bias.weight)}
            fields |= {"d": self._f32(mixer.d.weight), "dt_min": mixer.dt_min, "dt_max": mixer.dt_max}
            conv_w, conv_b, out = mixer.conv.weight, mixer.conv.bias, mixer.out_proj
        else:
            ins, perm = [mixer.in_proj], None
            heads, groups, dk, dv = 1, 1, 1, 1
            fields |= {"conv_dim": mixer.hidden, "out_k": mixer.hidden}
            conv_w, conv_b, out = mixer.conv.weight, mixer.conv.bias, mixer.out_proj
        weights = [_quant(lin) for lin in ins]
        arrays = (
            (ctypes.c_void_p * len(ins))(*[w.tiles.data_ptr() for w in weights]),
            np.array([w.n for w in weights], dtype=np.int64),
            np.array([FORMATS[w.fmt] for w in weights], dtype=np.int64),
            (ctypes.c_void_p * len(ins))(*[self._f32(lin.bias) for lin in ins]),
            perm,
        )
        self._keep.append(arrays)
        out_w = _quant(out)
        struct = _Mixer(
            **fields,
            width=sum(w.n for w in weights),
            heads=heads,
            groups=groups,
            dk=dk,
            dv=dv,
            n_in=len(ins),
            **{"in": ctypes.addressof(arrays[0])},
            in_n=arrays[1].ctypes.data,
            in_fmt=arrays[2].ctypes.data,
            in_bias=ctypes.addressof(arrays[3]),
            perm=None if perm is None else perm.ctypes.data,
            out=out_w.tiles.data_ptr(),
            out_fmt=FORMATS[out_w.fmt],
            out_bias=self._f32(out.bias),
            conv_w=self._f32(conv_w),
            conv_b=self._f32(conv_b),
            conv_state=conv.data_ptr(),
            rec_state=rec.data_ptr() if rec.numel() else None,
            conv_bf16=int(conv.dtype == torch.bfloat16),
            slots=conv.shape[0],
        )
        self._keep.append(struct)
        return ctypes.addressof(struct)

    def _sparse(self, layer: DecoderLayer, moe: SparseMoE) -> dict[str, float | int | None]:
        """A sparse layer's fields: the routed experts as moe_kernel.py built them for the torch path (the same
        structure, so both paths run the same kernel on the same tiles), the router's float32 weight and bias,
        the shared expert's gate, and the layer's row of the model's expert counters; beside a dense MLP (Gemma
        4), the experts' and the MLPs' output norms, the router's norm of the stream (its learned scale times
        hidden^-0.5 as the norm's weight: SparseMoE._router_input) and the per-expert scales."""
        kernel = moe.experts_kernel()
        assert kernel is not None and kernel.load is not None, "fusable() checked the experts run on moe.c"
        kernel.sync_routes(self.model.dtype == torch.bfloat16)
        self._keep.append(kernel)
        rs = moe.router_scale
        return {
            "moe": ctypes.addressof(kernel.layer),
            "router": self._f32(moe.router.weight),
            "router_bias": self._f32(moe.router.bias),
            "score_bias": self._f32(None if moe.score_bias is None else moe.score_bias.weight),
            "expert_load": kernel.load.data_ptr(),
            "shared_gate": self._f32(None if moe.shared_gate is None else moe.shared_gate.weight.reshape(-1)),
            "moe_norm": self._norm(layer.moe_norm),
            "dense_out_norm": self._norm(layer.mlp_out_norm_1),
            "moe_out_norm": self._norm(layer.moe_out_norm),
            "router_norm": self._f32(None if rs is None else rs.weight.float() * self.model.config.hidden_size**-0.5),
            "expert_scale": self._f32(None if moe.expert_scale is None else moe.expert_scale.weight),
        }

    def _model(self, k_cache: torch.Tensor) -> Any:
        m, cfg = self.model, self.model.config
        embed, head = m.embed.quant, _quant(m.lm_head)
        assert embed is not None, "fusable() checked the embedding table is quantized"
        amx = head.amx_min_rows if m.dtype == torch.bfloat16 and bf16_kernel() is not None else 0
        layers = range(cfg.num_layers)  # the widest of each layer's shape (Gemma 4's kinds differ)
        ple = {}
        if m.per_layer is not None:
            table, proj = m.per_layer.embed.quant, _quant(m.per_layer.projection)
            assert table is not None, "fusable() checked the per-layer table is quantized"
            ple = {
                "ple_width": cfg.hidden_size_per_layer_input,
                "ple_vocab": cfg.vocab_size_per_layer_input,
                "ple_embed": table.tiles.data_ptr(),
                "ple_embed_fmt": FORMATS[table.fmt],
                "ple_projection": proj.tiles.data_ptr(),
                "ple_projection_fmt": FORMATS[proj.fmt],
                "ple_proj_norm": self._norm(m.per_layer.norm),
            }
        return _Model(
            **ple,
            hidden=cfg.hidden_size,
            inter=max(cfg.layer_intermediate_size(i) for i in layers),
            heads=cfg.num_heads,
            kv_heads=max(cfg.layer_kv_heads(i) for i in layers),
            head_dim=max(cfg.layer_head_dim(i) for i in layers),
            layers=cfg.num_layers,
            vocab=cfg.vocab_size,
            block_size=self.block_size,
            cache_kind=kv_quant.KINDS[k_cache.dtype],
            amx_min_rows=amx,
            dot=int(head.dot),
            i8_min_rows=max((w.i8_min_rows for w in m.quant_weights()), default=0),
            i8_kinds=i8_kinds(m),
            num_blocks=k_cache.shape[0],
            act=ACTS[cfg.hidden_act],
            rotary_dim=cfg.rotary_dim,
            eps=cfg.rms_norm_eps,
            embed_scale=cfg.embedding_multiplier,
            residual_scale=cfg.residual_multiplier,
            logit_divisor=cfg.logits_divisor,
            logit_softcap=cfg.final_logit_softcapping or 0.0,
            final_norm=self._norm(m.norm),
            embed=embed.tiles.data_ptr(),
            lm_head=head.tiles.data_ptr(),
            embed_fmt=FORMATS[embed.fmt],
            lm_head_fmt=FORMATS[head.fmt],
            experts=cfg.num_experts,
            topk=cfg.num_experts_per_tok,
            moe_ffn=cfg.moe_intermediate_size,
            shared_inter=cfg.shared_expert_intermediate_size,
            router=ROUTERS.get(cfg.moe_router, 0),
            norm_topk=int(cfg.norm_topk_prob),
            expert_groups=cfg.num_expert_group,
            topk_group=cfg.topk_group,
            moe_latent=cfg.moe_latent_size,
            route_scale=cfg.routed_scaling_factor,
            expert_reads=self._reads.data_ptr(),
            attn_gate=int(cfg.attn_output_gate),
        )

    def _rotary(self, max_pos: int) -> None:
        """Point at the cos/sin tables (the global rotation's and Gemma 3's local one), growing them first if a
        position is past their end."""
        for name, rot in self.model.ropes.items():
            rot.ensure(max_pos)
            prefix = "" if name == "global" else "local_"
            setattr(self.dims, prefix + "cos", rot.cos_cache.data_ptr())
            setattr(self.dims, prefix + "sin", rot.sin_cache.data_ptr())
            setattr(self.dims, f"max_{prefix}positions", rot.cos_cache.shape[0])

    def run(
        self,
        token_ids: list[list[int]],
        starts: list[int],
        group_tables: list[list[list[int]]],
        num_logits: list[int],
        index: list[StepIndex] | None = None,
        lora: FusedLoRA | None = None,
        state_slots: list[int] | None = None,
        state_marks: list[list[tuple[int, int]]] | None = None,
    ) -> torch.Tensor:
        """float32 logits of sequence i adding `token_ids[i]` after `starts[i]` cached tokens: the last
        `num_logits[i]` rows of each sequence, in order ([sum(num_logits), vocab]). `group_tables[g][i]`: sequence
        i's block table in KV-cache group g. `index`: the step's indices per group (`group_step_index`), when the
        caller has built them already. `lora`: the rows that run under LoRA adapters (LoRAManager.fused_step).
        `state_slots[i]`: sequence i's recurrent-state slot (a hybrid model's; from zeros at position 0);
        `state_marks[i]`: its (t, row) checkpoints (SeqChunk.state_marks), its states after t tokens into row `row`."""
        if len(group_tables) != self.num_groups:
            raise ValueError(f"a step of this model needs {self.num_groups} groups' tables, got {len(group_tables)}")
        ixs = index or group_step_index([len(t) for t in token_ids], starts, group_tables, self.block_size)
        ix = ixs[0]
        # [groups, T] slots and [groups, S, max_blocks] tables: every group's tables are as wide (one need per sequence)
        slots = ix.slots if len(ixs) == 1 else np.stack([g.slots for g in ixs])
        tables = ix.tables if len(ixs) == 1 else np.stack([g.tables for g in ixs])
        T, lens, first = len(ix.seq), ix.lens, ix.first
        toks = np.fromiter((t for ids in token_ids for t in ids), dtype=np.int64, count=T)
        want = np.array(num_logits, dtype=np.int64)
        rows = (
            np.arange(T, dtype=np.int64)
            if (want == lens).all()
            else np.concatenate(
                [np.arange(e - k, e, dtype=np.int64) for e, k in zip((first + lens).tolist(), want.tolist())]
            )
        )
        logits = torch.empty(len(rows), self.model.config.vocab_size, dtype=torch.float32)
        self._rotary(int(ix.positions.max()))
        states = _state_arrays(state_slots, state_marks)
        batch = _Batch(
            toks.ctypes.data,
            ix.positions.ctypes.data,
            ix.seq.ctypes.data,
            slots.ctypes.data,
            tables.ctypes.data,
            rows.ctypes.data,
            T,
            len(lens),
            ix.tables.shape[1],
            len(rows),
            len(ixs),
            logits.data_ptr(),
            None if self.profile is None else self.profile.ctypes.data,
            None if lora is None else ctypes.addressof(lora.step),
            *(None if a is None else a.ctypes.data for a in states),
        )
        rc = self.lib.model_step(ctypes.byref(self.dims), self.layers, ctypes.byref(batch), torch.get_num_threads())
        self.model.expert_load.reads[0] += int(self._reads[0])
        self._reads.zero_()
        if rc != 0:
            raise RuntimeError(f"model_step failed: {ERRORS.get(rc, rc)}")
        return logits
