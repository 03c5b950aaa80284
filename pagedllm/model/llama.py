"""The Llama-family decoder (Llama, Mistral, Qwen2) over a flat batch of tokens with a paged KV cache.

One module covers the three architectures: they differ only in q/k/v biases (Qwen2) and config values
(GQA, tied embeddings, RoPE scaling). Q, K and V are one merged projection and gate/up another, so each layer
is four matmuls; logits are computed only for the rows the caller asks for (usually one per sequence), which
skips the big vocabulary matmul for every prompt token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model.attention import AttentionMetadata, PagedAttentionBackend, make_attention_backend
from pagedllm.model.config import ModelConfig
from pagedllm.model.cpu_linear import linear, pack, pack_module
from pagedllm.model.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary, empty_param
from pagedllm.model.quant import QuantWeight, qrows

MERGED = {"qkv_weight": 3, "gate_up_weight": 2}  # pieces of the merged weights (q/k/v, gate/up)


def install_quant(module: nn.Module, attr: str, weight: QuantWeight) -> None:
    """Serve `module.<attr>` from its quantized form and free the dense parameter."""
    module.quant[attr] = weight
    param = getattr(module, attr)
    param.data = torch.empty(0, dtype=param.dtype, device=param.device)


class DecoderLayer(nn.Module):
    """Pre-norm attention + pre-norm gated MLP, each added to the residual stream."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.qkv_weight = empty_param(self.q_size + 2 * self.kv_size, cfg.hidden_size, dtype=dtype, device=device)
        self.qkv_bias = (
            empty_param(self.q_size + 2 * self.kv_size, dtype=dtype, device=device) if cfg.attention_bias else None
        )
        self.o_weight = empty_param(cfg.hidden_size, self.q_size, dtype=dtype, device=device)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, device)
        self.packed: dict[str, torch.Tensor] = {}
        self.quant: dict[str, QuantWeight] = {}

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: PagedAttentionBackend,
    ) -> torch.Tensor:
        T = h.shape[0]
        x = self.input_layernorm(h)
        qkv = linear(x, self.qkv_weight, self.qkv_bias, self.packed.get("qkv_weight"), self.quant.get("qkv_weight"))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(T, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(T, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        attn = backend.forward(q, k, v, k_cache, v_cache, meta)
        h = h + linear(
            attn.reshape(T, self.q_size),
            self.o_weight,
            packed=self.packed.get("o_weight"),
            quant=self.quant.get("o_weight"),
        )
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module):
    """Embeddings, N decoder layers, final norm, LM head (tied to the embeddings or not)."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        backend: PagedAttentionBackend | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = empty_param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else empty_param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        )
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, device
        )
        self.backend: PagedAttentionBackend = backend or make_attention_backend(device)
        self.packed_lm_head: torch.Tensor | None = None
        self.quant: dict[str, QuantWeight] = {}  # "embed_tokens" / "lm_head" when kept quantized

    def linear_weights(self) -> list[tuple[nn.Module, str]]:
        """(module, attribute) of every matmul weight, the embedding table and the LM head (if not tied)."""
        out: list[tuple[nn.Module, str]] = [(self, "embed_tokens")]
        for layer in self.layers:
            out += [
                (layer, "qkv_weight"),
                (layer, "o_weight"),
                (layer.mlp, "gate_up_weight"),
                (layer.mlp, "down_weight"),
            ]
        return out + ([] if self.lm_head is None else [(self, "lm_head")])

    def pack_cpu_weights(self) -> None:
        """Pack every dense matmul weight for oneDNN (see cpu_linear.py). The embedding table stays as it is for
        lookups; a tied LM head gets its own packed copy."""
        for layer in self.layers:
            pack_module(layer, ["qkv_weight", "o_weight"])
            pack_module(layer.mlp, ["gate_up_weight", "down_weight"])
        if self.lm_head_quant is not None:
            return
        self.packed_lm_head = pack(self.lm_head_weight)
        if self.packed_lm_head is not None and self.lm_head is not None:
            self.lm_head.data = torch.empty(0, dtype=self.lm_head.dtype)

    def quant_weights(self) -> list[QuantWeight]:
        """Every weight kept quantized: the embedding table and LM head, then each layer's."""
        out = list(self.quant.values())
        for layer in self.layers:
            out += list(layer.quant.values()) + list(layer.mlp.quant.values())
        return out

    def first_layer_quant(self) -> list[QuantWeight] | None:
        """The first layer's four matmul weights if all are quantized (what kernel_choice.py times), else None."""
        layer = self.layers[0]
        ws = [
            layer.quant.get("qkv_weight"),
            layer.quant.get("o_weight"),
            layer.mlp.quant.get("gate_up_weight"),
            layer.mlp.quant.get("down_weight"),
        ]
        return None if any(w is None for w in ws) else ws

    def resident_weight_bytes(self) -> int:
        """Bytes the weights hold in memory in every form they are kept in: parameters, packed, quantized."""
        tensors = list(self.parameters()) + [self.packed_lm_head] + list(self.quant.values())
        for layer in self.layers:
            for mod in (layer, layer.mlp):
                tensors += list(mod.packed.values()) + list(mod.quant.values())
        return sum(
            t.nbytes if isinstance(t, QuantWeight) else t.numel() * t.element_size() for t in tensors if t is not None
        )

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    @property
    def lm_head_quant(self) -> QuantWeight | None:
        return self.quant.get("embed_tokens" if self.lm_head is None else "lm_head")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        table = self.quant.get("embed_tokens")
        if table is None:
            return F.embedding(input_ids, self.embed_tokens)
        return qrows(table, input_ids).to(self.embed_tokens.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        logits_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids: [T]; returns float32 logits for rows `logits_index` (all rows if None)."""
        h = self.hidden_states(input_ids, meta, kv_caches)
        if logits_index is not None:
            h = h[logits_index]
        return linear(self.norm(h), self.lm_head_weight, packed=self.packed_lm_head, quant=self.lm_head_quant).float()

    def hidden_states(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """The last layer's output for every row, before the final norm (writes K/V as `forward` does); an
        embedding request pools `self.norm` of it, which is Hugging Face's `last_hidden_state`."""
        h = self.embed(input_ids)
        cos, sin = self.rotary.cos_sin(meta.positions, h.dtype)
        for layer, (kc, vc) in zip(self.layers, kv_caches):
            h = layer(h, cos, sin, kc, vc, meta, self.backend)
        return h
