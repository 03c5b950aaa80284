"""The one decoder every family runs on, over a flat batch of tokens with a paged KV cache.

A family (model/families/) is data in `ModelConfig`: which norms a layer has (before and / or after attention
and the MLP, Gemma's (1 + w)), q/k norms per head (Qwen3, Gemma 3) or over the whole projection (OLMo2), the
activation (SwiGLU, GeGLU), multipliers (Gemma's embedding scale, Granite's four), per-layer RoPE (Gemma 3's
two bases, SmolLM3's NoPE layers, Phi's partial rotary) and the attention's scale / soft-cap / window.

A sparse layer (cfg.is_moe_layer) has a mixture of experts (moe.py) in the MLP's place. A layer may have one of
the two blocks only (cfg.layer_has_mixer / layer_has_mlp: Nemotron-H's layers are each a Mamba2 mixer, attention
or an ungated relu2 MLP, behind one pre-norm): the other block, its norms and its residual add are not there.
A linear-attention layer (cfg.is_linear_layer: Qwen3.5, Qwen3-Next) has a Gated DeltaNet mixer (deltanet.py) in
attention's place, which reads and writes its request's recurrent state instead of the KV cache (Granite 4.0-H:
Mamba2, mamba2.py; LFM2: a short conv, shortconv.py; cfg.recurrent_mixer picks); their full-attention layers may
gate the attention's output by sigmoid(gate), the gate's rows stored beside each head's query rows (attn_output_gate).

Q, K and V are one merged projection and gate/up another, so each layer is four matmuls whatever the
checkpoint stores (split or fused, as Phi-3); logits are computed only for the rows the caller asks for
(usually one per sequence), which skips the big vocabulary matmul for every prompt token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedllm.model.config import ModelConfig
from pagedllm.model.kernels.quant_linear import QuantWeight
from pagedllm.model.layers.attention import (
    AttentionMetadata,
    AttentionSpec,
    PagedAttentionBackend,
    make_attention_backend,
)
from pagedllm.model.layers.common import AttentionSinks, GatedMLP, Learned, RMSNorm, rms_normalize
from pagedllm.model.layers.deltanet import GatedDeltaNet, RecurrentStep
from pagedllm.model.layers.linear import Embedding, Linear
from pagedllm.model.layers.mamba2 import Mamba2
from pagedllm.model.layers.moe import ExpertLoad, SparseMoE
from pagedllm.model.layers.per_layer_input import PerLayerEmbedding, PerLayerInput
from pagedllm.model.layers.rope import RotaryEmbedding, apply_rotary
from pagedllm.model.layers.shortconv import ShortConv

CosSin = tuple[torch.Tensor, torch.Tensor]
Mixer = GatedDeltaNet | Mamba2 | ShortConv


def recurrent_mixer(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> Mixer:
    """A linear layer's mixer by cfg.recurrent_mixer. Each has the same face: `state_shapes()` (one slot's conv
    and float32 states, the runner allocates them), `slots()` / `linears()` (its weights), and forward(x,
    conv_cache, rec_cache, step) that leaves its new states in step.pending."""
    if cfg.recurrent_mixer == "mamba2":
        return Mamba2(cfg, dtype, device)
    if cfg.recurrent_mixer == "short_conv":
        return ShortConv(cfg, dtype, device)
    return GatedDeltaNet(cfg, dtype, device)


# A decoder layer's matmul slots (DecoderLayer.slots) by kind: the profile slots of the fused C step's matmuls
# (fused_step.PHASES), the unit the int8 route is chosen in (StepModel.i8_kinds); the routed experts have their own
SLOT_KINDS = {"q": "qkv", "qk": "qkv", "qkv": "qkv", "o": "o", "gate_up": "gate_up", "down": "down"}
SLOT_KINDS |= {"shared_gate_up": "gate_up", "shared_down": "down"}
MATMUL_KINDS = ("qkv", "o", "gate_up", "down", "lm_head")


class DecoderLayer(nn.Module):
    """Attention (or a recurrent mixer) then a gated MLP, each added to the residual stream, with the norms its
    family has; either block may be absent (a single-block layer)."""

    def __init__(
        self,
        cfg: ModelConfig,
        index: int,
        dtype: torch.dtype,
        device: torch.device | str,
        load: ExpertLoad | None = None,
    ) -> None:
        """`load`: the model's expert counters, given to a sparse layer (cfg.is_moe_layer) only."""
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads, self.head_dim = cfg.layer_kv_heads(index), cfg.layer_head_dim(index)
        self.q_size, self.kv_size = cfg.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # K and V projections: 2; 1 where keys are the values (Gemma 4's attention_k_eq_v, full layers); 0 in a
        # layer that reads another's KV (Gemma 4's shared layers: it projects and writes none)
        k_eq_v = cfg.attention_k_eq_v and cfg.layer_window(index) is None
        self.kv_parts = 0 if cfg.kv_source(index) != index else 1 if k_eq_v else 2
        self.v_norm, self.eps = cfg.v_norm, cfg.rms_norm_eps

        def norm(size: int, present: bool) -> RMSNorm | None:
            return RMSNorm(size, cfg.rms_norm_eps, dtype, device, cfg.norm_offset) if present else None

        hidden = cfg.hidden_size
        self.has_mixer, self.has_mlp = cfg.layer_has_mixer(index), cfg.layer_has_mlp(index)
        self.attn_norm, self.mlp_norm = (
            norm(hidden, cfg.pre_norms and self.has_mixer),
            norm(hidden, cfg.pre_norms and self.has_mlp),
        )
        self.attn_out_norm = norm(hidden, cfg.post_norms and self.has_mixer)
        self.mlp_out_norm = norm(hidden, cfg.post_norms and self.has_mlp)
        self.qk_norm = cfg.qk_norm
        self.index = index
        self.linear_attn = recurrent_mixer(cfg, dtype, device) if cfg.is_linear_layer(index) else None
        attn = self.linear_attn is None and self.has_mixer
        self.attends = attn  # reads and writes the KV cache (read by the fused step too)
        self._attention_weights(cfg, attn, norm, dtype, device)
        # A sparse layer has `moe` and no `mlp`.
        self.moe = (
            SparseMoE(cfg, dtype, device, load, sum(map(cfg.is_moe_layer, range(index)))) if load is not None else None
        )
        if self.has_mlp and (self.moe is None or cfg.moe_beside_mlp):
            inter = cfg.layer_intermediate_size(index)
            self.mlp = GatedMLP(hidden, inter, cfg.hidden_act, dtype, device, has_gate=cfg.mlp_gated)
        beside = self.moe is not None and cfg.moe_beside_mlp  # Gemma 4: both, each with its own norms
        self.moe_norm, self.mlp_out_norm_1 = norm(hidden, beside), norm(hidden, beside)
        self.moe_out_norm = norm(hidden, beside)
        width = cfg.hidden_size_per_layer_input
        self.per_layer_input = (
            PerLayerInput(hidden, width, cfg.hidden_act, cfg.rms_norm_eps, dtype, device) if width else None
        )
        self.scalar = Learned(1, dtype, device) if cfg.layer_scalar else None
        self.rope = cfg.layer_rope(index)
        self.sinks = AttentionSinks(cfg.num_heads, device) if cfg.attention_sinks else None
        sinks = None if self.sinks is None else self.sinks.weight
        self.attn_spec = AttentionSpec.for_layer(cfg, index, sinks)  # read by the torch path and the fused C step
        self.residual_multiplier = cfg.residual_multiplier

    def _attention_weights(
        self,
        cfg: ModelConfig,
        attn: bool,
        norm: Callable[[int, bool], RMSNorm | None],
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        """The q/k norms and the qkv and o projections, for a layer that attends (`attn`); a recurrent mixer's or
        a single-block MLP layer's are none."""
        per_head = cfg.qk_norm == "head"
        self.q_norm = norm(self.head_dim if per_head else self.q_size, cfg.qk_norm is not None and attn)
        k_norm = cfg.qk_norm is not None and attn and self.kv_parts > 0
        self.k_norm = norm(self.head_dim if per_head else self.kv_size, k_norm)
        self.gated = cfg.attn_output_gate
        self.q_rows = self.q_size * (2 if self.gated else 1)  # the query's rows of qkv (and the gate's, beside)
        if attn:
            hidden = cfg.hidden_size
            self.qkv = Linear(self.q_rows + self.kv_parts * self.kv_size, hidden, cfg.attention_bias, dtype, device)
            self.o = Linear(hidden, self.q_size, cfg.o_proj_bias, dtype, device)

    def slots(self) -> dict[str, nn.Module]:
        """This layer's weights by the slot names of the families' tensor tables (families/base.py)."""
        dense = {"gate_up": self.mlp.gate_up, "down": self.mlp.down} if hasattr(self, "mlp") else {}
        mlp = (self.moe.slots() if self.moe is not None else {}) | dense
        ple = self.per_layer_input
        mixer = (
            {("q", "qk", "qkv")[self.kv_parts]: self.qkv, "o": self.o}
            if self.attends
            else {}
            if self.linear_attn is None
            else dict(self.linear_attn.slots().items())
        )
        mods: dict[str, nn.Module | None] = {
            **mixer,
            **mlp,
            "attn_norm": self.attn_norm,
            "mlp_norm": self.mlp_norm,
            "attn_out_norm": self.attn_out_norm,
            "mlp_out_norm": self.mlp_out_norm,
            "q_norm": self.q_norm,
            "k_norm": self.k_norm,
            "sinks": self.sinks,
            "ple_gate": None if ple is None else ple.gate,
            "ple_proj": None if ple is None else ple.proj,
            "ple_norm": None if ple is None else ple.norm,
            "layer_scalar": self.scalar,
            "moe_norm": self.moe_norm,
            "mlp_out_norm_1": self.mlp_out_norm_1,
            "moe_out_norm": self.moe_out_norm,
        }
        return {k: m for k, m in mods.items() if m is not None}

    def linears(self) -> list[Linear]:
        """The layer's matmuls: q/k/v, o, then the MLP's gate/up and down (a sparse block's router, experts,
        shared expert and its gate)."""
        mlp = (self.moe.linears() if self.moe is not None else []) + self.dense_linears()
        ple = [] if self.per_layer_input is None else [self.per_layer_input.gate, self.per_layer_input.proj]
        return [*self._mixer_linears(), *mlp, *ple]

    def _mixer_linears(self) -> list[Linear]:
        if self.linear_attn is not None:
            return self.linear_attn.linears()
        return [self.qkv, self.o] if self.attends else []

    def dense_linears(self) -> list[Linear]:
        """The dense MLP's gate/up and down: a dense layer's, a sparse layer's beside its experts (Gemma 4), or none
        (a sparse layer's block in the MLP's place)."""
        return [self.mlp.gate_up, self.mlp.down] if hasattr(self, "mlp") else []

    def main_linears(self) -> list[Linear]:
        """q/k/v, o, gate/up and down (a sparse layer's first expert's): the four kernel_choice.py times (of a
        single-block layer, its block's two)."""
        mixer = self._mixer_linears()
        out = [mixer[0], mixer[-1]] if mixer else []
        if not self.has_mlp:
            return out
        mlp = self.moe.experts[0] if self.moe is not None else self.mlp
        assert isinstance(mlp, GatedMLP)
        return [*out, mlp.gate_up, mlp.down]

    def _qkv(
        self, x: torch.Tensor, rope: CosSin | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """q, k, v [T, heads, head_dim], normed and rotated (no k and v in a layer that reads another's KV; with
        keys equal to values, V is K's projection before K's norm and RoPE), and the output gate [T, q_size] (None:
        ungated)."""
        T = x.shape[0]
        q, *kv = self.qkv(x).split([self.q_rows] + [self.kv_size] * self.kv_parts, dim=-1)
        k, v = (kv[0], kv[-1]) if kv else (None, None)
        gate = None
        if self.gated:  # per head: its query's rows, then its gate's
            q, gate = q.reshape(T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            q, gate = q.reshape(T, self.q_size), gate.reshape(T, self.q_size)
        if self.q_norm is not None and self.qk_norm == "full":
            q = self.q_norm(q)
        if self.k_norm is not None and k is not None and self.qk_norm == "full":
            k = self.k_norm(k)
        q = q.reshape(T, self.num_heads, self.head_dim)
        if self.q_norm is not None and self.qk_norm == "head":
            q = self.q_norm(q)
        q = q if rope is None else apply_rotary(q, *rope)
        if k is None or v is None:
            return q, None, None, gate
        k = k.reshape(T, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None and self.qk_norm == "head":
            k = self.k_norm(k)
        k = k if rope is None else apply_rotary(k, *rope)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        return q, k, rms_normalize(v, self.eps) if self.v_norm else v, gate

    def _mlp(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The MLP's output for its normed input `x`: dense, sparse, or both (Gemma 4: each output normed, the
        experts reading their own norm of the stream `h`, the router `h` itself)."""
        if self.moe is None:
            return self.mlp(x)
        if self.moe_norm is None or self.mlp_out_norm_1 is None or self.moe_out_norm is None:
            return self.moe(x)
        return self.mlp_out_norm_1(self.mlp(x)) + self.moe_out_norm(self.moe(self.moe_norm(h), h))

    def _mix(
        self,
        h: torch.Tensor,
        rope: CosSin | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: PagedAttentionBackend,
        recurrent: RecurrentStep | None,
    ) -> torch.Tensor:
        """The mixer's output (attention or the recurrent mixer) for the stream `h`, normed before."""
        x = h if self.attn_norm is None else self.attn_norm(h)
        if self.linear_attn is not None:
            if recurrent is None:
                raise ValueError(f"layer {self.index} is a linear-attention layer: the step needs its state slots")
            return self.linear_attn(x, *recurrent.caches[self.index], recurrent)
        q, k, v, gate = self._qkv(x, rope)
        a = backend.forward(q, k, v, k_cache, v_cache, meta, self.attn_spec).reshape(h.shape[0], self.q_size)
        return self.o(a if gate is None else a * torch.sigmoid(gate))

    def _add(self, h: torch.Tensor, out: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        """A block's output (normed where the family norms it) added to the residual stream (Granite: scaled)."""
        out = out if norm is None else norm(out)
        return h + (out if self.residual_multiplier == 1.0 else out * self.residual_multiplier)

    def forward(
        self,
        h: torch.Tensor,
        rope: CosSin | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: PagedAttentionBackend,
        recurrent: RecurrentStep | None = None,
        per_layer: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`recurrent`: the step's state slots, which a linear-attention layer reads instead of the KV cache;
        `per_layer`: this layer's per-layer input embedding of each token (Gemma 4's PLE), if the model has them."""
        if self.has_mixer:
            h = self._add(h, self._mix(h, rope, k_cache, v_cache, meta, backend, recurrent), self.attn_out_norm)
        if self.has_mlp:
            h = self._add(h, self._mlp(h if self.mlp_norm is None else self.mlp_norm(h), h), self.mlp_out_norm)
        if self.per_layer_input is not None and per_layer is not None:
            h = self.per_layer_input(h, per_layer)
        return h if self.scalar is None else h * self.scalar.weight


class CausalLM(nn.Module):
    """Embeddings, N decoder layers, final norm, LM head (tied to the embeddings or not)."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        backend: PagedAttentionBackend | None = None,
    ) -> None:
        super().__init__()
        self.config, self.dtype = cfg, dtype
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
        sparse = sum(map(cfg.is_moe_layer, range(cfg.num_layers)))
        # tokens per expert of each sparse layer, and expert weights read, since load (the engine's /metrics)
        self.expert_load = ExpertLoad(torch.zeros(sparse, cfg.num_experts, dtype=torch.int64))
        self.decoder_layers = [
            DecoderLayer(cfg, i, dtype, device, self.expert_load if cfg.is_moe_layer(i) else None)
            for i in range(cfg.num_layers)
        ]
        self.layers = nn.ModuleList(self.decoder_layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, cfg.norm_offset)
        width = cfg.hidden_size_per_layer_input
        self.per_layer = (
            PerLayerEmbedding(
                cfg.vocab_size_per_layer_input, cfg.hidden_size, cfg.num_layers, width, cfg.rms_norm_eps, dtype, device
            )
            if width
            else None
        )
        tied = self.embed.weight if cfg.tie_word_embeddings else None
        self.lm_head = Linear(cfg.vocab_size, cfg.hidden_size, False, dtype, device, tied_to=tied)
        dev = torch.device(device)
        self.ropes: dict[str, RotaryEmbedding] = {
            "global": RotaryEmbedding(
                cfg.global_rotary_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, dev
            )
        }
        if any(layer.rope == "local" for layer in self.decoder_layers) and cfg.rope_local_theta is not None:
            self.ropes["local"] = RotaryEmbedding(
                cfg.rotary_dim, cfg.rope_local_theta, None, cfg.max_position_embeddings, dev
            )
        self.backend: PagedAttentionBackend = backend or make_attention_backend(device)

    def linears(self) -> list[Linear]:
        """Every matmul layer: each decoder layer's (four, or a sparse layer's with its experts'), the LM head."""
        out: list[Linear] = []
        for layer in self.decoder_layers:
            out += layer.linears()
        return out + ([] if self.per_layer is None else [self.per_layer.projection]) + [self.lm_head]

    def finish_load(self) -> None:
        """A tied LM head serves the quantized table the embedding was given."""
        if self.lm_head.tied and self.embed.quant is not None:
            self.lm_head.set_quantized(self.embed.quant)

    def pack_cpu_weights(self) -> None:
        """Pack every dense matmul weight for oneDNN (see onednn_linear.py); the embedding table stays as it is for
        lookups, and a tied LM head gets its own packed copy. A router (keep_dense) stays as it is: it is small,
        and the fused C step reads its float weight. bfloat16 experts are first kept as bfloat16 tiles for moe.c
        where the CPU has vdpbf16ps (SparseMoE.keep_experts_bf16)."""
        for m in self.modules():
            if isinstance(m, SparseMoE):
                m.keep_experts_bf16()
        for lin in self.linears():
            if not lin.keep_dense:
                lin.pack_for_cpu()

    def quant_weights(self) -> list[QuantWeight]:
        """Every weight kept quantized, each once: the embedding table, each layer's, the LM head."""
        found = [self.embed.quant] + [lin.quant for lin in self.linears()]
        found += [] if self.per_layer is None else [self.per_layer.embed.quant]
        out: dict[int, QuantWeight] = {id(w): w for w in found if w is not None}
        return list(out.values())

    def weights_by_kind(self) -> dict[str, list[QuantWeight]]:
        """The quantized weights of each matmul kind (MATMUL_KINDS): the decoder layers' slots, the LM head."""
        out: dict[str, list[QuantWeight]] = {k: [] for k in MATMUL_KINDS}
        for layer in self.decoder_layers:
            for slot, mod in layer.slots().items():
                w = getattr(mod, "quant", None)
                if slot in SLOT_KINDS and w is not None:
                    out[SLOT_KINDS[slot]].append(w)
        if self.lm_head.quant is not None:
            out["lm_head"].append(self.lm_head.quant)
        return out

    def first_layer_quant(self) -> list[QuantWeight] | None:
        """The first layer's four matmul weights if all are quantized (what kernel_choice.py times), else None."""
        ws = [lin.quant for lin in self.decoder_layers[0].main_linears()]
        return None if any(w is None for w in ws) else [w for w in ws if w is not None]

    def resident_weight_bytes(self) -> int:
        """Bytes the weights hold in memory in every form they are kept in: parameters, packed, quantized."""
        params = sum(p.numel() * p.element_size() for p in self.parameters())
        packed = sum(lin.method.nbytes for lin in self.linears() if lin.quant is None)
        return params + packed + sum(w.nbytes for w in self.quant_weights())

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(h)).float()
        cfg = self.config
        if cfg.logits_divisor != 1.0:
            logits = logits / cfg.logits_divisor
        if cfg.final_logit_softcapping is not None:
            logits = torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
        return logits

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata | list[AttentionMetadata],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        logits_index: torch.Tensor | None = None,
        recurrent: RecurrentStep | None = None,
    ) -> torch.Tensor:
        """input_ids: [T]; returns float32 logits for rows `logits_index` (all rows if None)."""
        h = self.hidden_states(input_ids, meta, kv_caches, recurrent)
        if logits_index is not None:
            h = h[logits_index]
        return self._logits(h)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata | list[AttentionMetadata],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        recurrent: RecurrentStep | None = None,
    ) -> torch.Tensor:
        """The last layer's output for every row, before the final norm (writes K/V as `forward` does); an
        embedding request pools `self.norm` of it, which is Hugging Face's `last_hidden_state`. `meta`: one for
        every layer, or one per layer (each its KV-cache group's block tables and slots)."""
        metas = meta if isinstance(meta, list) else [meta] * len(self.decoder_layers)
        h = self.embed(input_ids)
        if self.config.embedding_multiplier != 1.0:
            h = h * torch.tensor(self.config.embedding_multiplier, dtype=h.dtype)
        tables = {name: rope.cos_sin(metas[0].positions, h.dtype) for name, rope in self.ropes.items()}
        per_layer = None if self.per_layer is None else self.per_layer(input_ids, h)  # [T, layers, width]
        for i, (layer, (kc, vc), m) in enumerate(zip(self.decoder_layers, kv_caches, metas)):
            ple = None if per_layer is None else per_layer[:, i]
            h = layer(h, tables.get(layer.rope), kc, vc, m, self.backend, recurrent, ple)
        return h
