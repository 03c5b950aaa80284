"""The model's shape, read cheaply: the KV-cache calculator and the engine need it before (or without) weights.

`load_model_config` reads only `config.json` / `generation_config.json`, or only the GGUF header; it never
dequantizes anything.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from pagedllm.errors import ModelLoadError, UserError
from pagedllm.kv.kv_spec import KVCacheLayout, kv_cache_layout, kv_sources
from pagedllm.kv.sizing import recurrent_state_bytes
from pagedllm.model.families import (
    GGUF_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    Family,
    GGUFHeader,
    by_architecture,
    by_gguf_arch,
)

# rope.py computes each
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic", "factors", "proportional")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "relu2")  # layers/common.py (relu2: Nemotron-H's ungated MLP)
ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid")  # moe.py: the sparse block's routing
# moe.py: the experts' (gpt-oss's clamped SwiGLU; relu2: ungated experts, Nemotron-H's, where the MLP is ungated)
MOE_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "swigluoai", "relu2")
LINEAR_ATTENTION_FAMILIES = (
    "qwen3_5",
    "qwen3_next",
    "qwen3_5_moe",
    "granitemoehybrid",
    "lfm2",
    "lfm2_moe",
    "nemotron_h",
)
RECURRENT_MIXERS = ("gated_deltanet", "mamba2", "short_conv")  # decoder.py: the mixer of each linear layer
_ORIGINAL_CONTEXT_TYPES = ("llama3", "yarn", "longrope", "dynamic")  # scalings relative to an original context


@dataclass
class ModelConfig:
    """Everything the layers, the loader and the KV-cache sizing need to know about a checkpoint."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # What the shared decoder does beyond the plain Llama layer (model/families/ reads these per family).
    family: str = "llama"
    o_proj_bias: bool = False  # a bias on the attention output too (Llama-style attention_bias; not Qwen2)
    hidden_act: str = "silu"  # the gate's activation: "silu" (SwiGLU) | "gelu_pytorch_tanh" (GeGLU)
    mlp_gated: bool = True  # False: the MLP is down(act(up(x))), no gate (Nemotron-H's relu2)
    norm_offset: float = 0.0  # RMSNorm weight offset: Gemma's (1 + w) in HF checkpoints
    qk_norm: str | None = None  # RMSNorm of queries / keys: "head" (Qwen3, Gemma 3) | "full" (OLMo2)
    pre_norms: bool = True  # a norm before attention and before the MLP (OLMo2: none)
    post_norms: bool = False  # a norm on the attention and MLP outputs (Gemma 2/3, OLMo2)
    embedding_multiplier: float = 1.0  # Gemma: sqrt(hidden); Granite: embedding_multiplier
    residual_multiplier: float = 1.0  # Granite: each branch scaled before the residual add
    logits_divisor: float = 1.0  # Granite: logits_scaling
    final_logit_softcapping: float | None = None  # Gemma 2: tanh soft-cap of the logits
    partial_rotary_factor: float = 1.0  # the share of each head RoPE rotates (Phi-4-mini: 0.75)
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' own RoPE base (unscaled)
    no_rope_layers: list[int] | None = None  # SmolLM3: per layer 1 = RoPE, 0 = none (NoPE)
    name: str = ""
    checkpoint_dtype: str = "float32"  # dtype the weights are stored in ("quantized" for GGUF quants)
    # Tokens a query of a sliding layer sees, itself included (transformers: kv_idx > q_idx - sliding_window);
    # None: full attention.
    sliding_window: int | None = None
    # Per layer "sliding_attention" / "full_attention" (transformers 5's names); None: every layer uses
    # sliding_window when it is set. "mlp": a layer without a mixer (no attention, no KV, no state), its MLP only.
    layer_types: list[str] | None = None
    # Each layer one block, its mixer (attention or recurrent) or, in an "mlp" layer, its MLP, behind one pre-norm
    # and added to the residual stream (Nemotron-H); False: a mixer layer has its MLP after the mixer.
    single_block_layers: bool = False
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_logit_softcapping: float | None = None  # Gemma 2: cap * tanh(score / cap) before the softmax
    attention_sinks: bool = False  # gpt-oss: a learned logit per query head in each softmax (AttentionSpec.sinks)
    # Gemma 4: the last layers read the KV of the last earlier layer of their kind and store none (kv_spec.py)
    num_kv_shared_layers: int = 0
    # Gemma 4 (families/gemma4.py): the full-attention layers' own head size and KV heads (None: the others'),
    # keys that are the values there (attention_k_eq_v: no v_proj, V is K's projection before its norm), V
    # RMS-normed without a weight, per-layer input embeddings of this width (0: none), a learned scalar on each
    # layer's output, and the MLP of a layer that reads another's KV twice as wide (use_double_wide_mlp).
    global_head_dim: int | None = None
    num_global_kv_heads: int | None = None
    attention_k_eq_v: bool = False
    v_norm: bool = False
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    layer_scalar: bool = False
    double_wide_shared_mlp: bool = False

    # A sparse mixture of experts in place of the MLP (moe.py; families/moe.py reads these); 0 experts: dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # experts each token is routed to
    moe_intermediate_size: int = 0  # each expert's ffn size
    # "softmax_topk": softmax over every expert, then the top k (Qwen-MoE, OLMoE, Mixtral); "topk_softmax": the
    # top k logits, then a softmax over those (Granite-MoE; gpt-oss, with the router's bias)
    moe_router: str = "softmax_topk"
    norm_topk_prob: bool = False  # softmax_topk: the k weights renormalised to sum to 1 (Mixtral, Qwen3-MoE)
    # "sigmoid" (LFM2-MoE; vLLM's scoring_func): sigmoid scores, the top k chosen by score + a learned bias per
    # expert (e_score_correction_bias, vLLM's name; LFM2's expert_bias), weighed by the scores themselves,
    # renormalised with norm_topk_prob, times routed_scaling_factor
    e_score_correction_bias: bool = False
    routed_scaling_factor: float = 1.0
    # "sigmoid" over groups (DeepSeek-V3's noaux_tc, Nemotron-H; vLLM's num_expert_group / topk_group): the experts
    # in num_expert_group equal groups, each group scored by the sum of its two largest score + bias, the top k
    # chosen within the topk_group best groups only; 1 group: no grouping
    num_expert_group: int = 1
    topk_group: int = 1
    router_bias: bool = False  # a bias on the router's logits (gpt-oss)
    expert_bias: bool = False  # biases on each expert's gate / up and down (gpt-oss)
    moe_activation: str | None = None  # the experts' activation (None: hidden_act); "swigluoai": gpt-oss's
    swiglu_alpha: float = 1.702  # swigluoai: up' = clamp(up), gate' = min(gate, limit); (up' + 1) * gate' *
    swiglu_limit: float = 7.0  # sigmoid(alpha * gate')
    shared_expert_intermediate_size: int = 0  # an always-on expert beside the routed ones (Qwen2-MoE, Granite)
    shared_expert_gate: bool = False  # the shared expert's output scaled by sigmoid(x @ w) (Qwen2-MoE)
    # > 0: the routed experts run at this width (Nemotron-H's moe_latent_size): their input projected down from the
    # stream, their weighted sum back up; the router and the shared expert read the stream itself
    moe_latent_size: int = 0
    # Gemma 4 (26B-A4B): the sparse block runs beside the dense MLP (each output normed, the two summed), its
    # experts reading their own norm of the residual stream and its router the stream RMS-normed times a learned
    # scale and hidden ** -0.5, each routing weight then times a learned number of its expert
    moe_beside_mlp: bool = False
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 and i not in mlp_only_layers
    mlp_only_layers: list[int] = field(default_factory=list)

    # Hybrid models (Qwen3.5, Qwen3-Next): layer_types "linear_attention" are Gated DeltaNet layers
    # (layers/deltanet.py) that keep a recurrent state per request instead of KV; the others full attention.
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    attn_output_gate: bool = False  # Qwen3.5 / Next: attention output * sigmoid(gate), gate rows beside each query
    # The DeltaNet's projections as stored: "split" (Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a),
    # "fused" (Qwen3-Next's HF in_proj_qkvz and in_proj_ba, interleaved per key head), "qkv_z_ba" (Qwen3-Next as
    # llama.cpp's converter writes it: q, k, v and z apart, b and a still interleaved in ssm_ba)
    linear_proj: str = "split"
    # Value heads in llama.cpp's tiled order (its qwen35 / qwen35moe files): value head j reads key head
    # j % key heads, where transformers' grouped order reads key head j // (value heads / key heads)
    linear_value_heads_tiled: bool = False
    # The mixer of the "linear_attention" layers, each with its own state in the request's slot: "gated_deltanet"
    # (deltanet.py), "mamba2" (mamba2.py: Granite 4.0-H), "short_conv" (shortconv.py: LFM2); linear_conv_kernel_dim
    # is the width of each one's causal conv.
    recurrent_mixer: str = "gated_deltanet"
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state_size: int = 0
    mamba_num_groups: int = 1
    mamba_dt_limit: tuple[float, float] = (0.0, float("inf"))  # dt clamped to this after the softplus
    mixer_conv_bias: bool = False  # a bias on the mixer's conv (Mamba2's conv_bias, LFM2's conv_bias)
    mixer_proj_bias: bool = False  # biases on the mixer's in / out projections (Mamba2's proj_bias, LFM2's)

    def kv_layout(self, hybrid: bool = False) -> KVCacheLayout:
        """The KV-cache groups of this model's layers (kv_spec.py); `hybrid=False`: one group of every layer that
        stores KV (one block table, nothing freed early: the layout every layer had before groups)."""
        windows = [self.layer_window(i) for i in range(self.num_layers)]
        sources = kv_sources(windows, self.num_kv_shared_layers)
        mlp_only = [i for i in range(self.num_layers) if not self.layer_has_mixer(i)]
        return kv_cache_layout(windows, sources, hybrid, self.linear_layers, mlp_only)

    def is_linear_layer(self, layer: int) -> bool:
        """Whether layer `layer` is a Gated DeltaNet (linear-attention) layer: a recurrent state, no KV."""
        return self.layer_types is not None and self.layer_types[layer] == "linear_attention"

    @property
    def linear_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_linear_layer(i)]

    def layer_has_mixer(self, layer: int) -> bool:
        """Whether layer `layer` has a mixer (attention or recurrent); an "mlp" layer has its MLP only."""
        return self.layer_types is None or self.layer_types[layer] != "mlp"

    def layer_has_mlp(self, layer: int) -> bool:
        """Whether layer `layer` has an MLP (or sparse block): every layer but a mixer's in single-block models."""
        return not self.single_block_layers or not self.layer_has_mixer(layer)

    @property
    def linear_conv_dim(self) -> int:
        """Channels of a linear layer's causal conv: its q, k and v."""
        return (
            2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
        )

    def recurrent_state_dims(self) -> tuple[int, int, int, int]:
        """A linear layer's state by its mixer: conv channels, and the float32 state's [heads, dim, dim] (Gated
        DeltaNet: value heads x key dim x value dim; Mamba2: heads x head dim x state size; short conv: none)."""
        if self.recurrent_mixer == "mamba2":
            inner = self.mamba_num_heads * self.mamba_head_dim
            conv = inner + 2 * self.mamba_num_groups * self.mamba_state_size
            return conv, self.mamba_num_heads, self.mamba_head_dim, self.mamba_state_size
        if self.recurrent_mixer == "short_conv":
            return self.hidden_size, 0, 0, 0
        return self.linear_conv_dim, self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim

    def state_bytes_per_request(self, conv_dtype_bytes: int) -> int:
        """One state slot: every linear layer's conv state (the model's dtype) and recurrent state (float32)."""
        conv, heads, key_dim, value_dim = self.recurrent_state_dims()
        return len(self.linear_layers) * recurrent_state_bytes(
            conv, self.linear_conv_kernel_dim, heads, key_dim, value_dim, conv_dtype_bytes
        )

    def kv_source(self, layer: int) -> int:
        """The layer whose KV layer `layer` reads: itself, or for Gemma 4's shared layers an earlier one."""
        windows = [self.layer_window(i) for i in range(self.num_layers)]
        return kv_sources(windows, self.num_kv_shared_layers)[layer]

    def layer_head_dim(self, layer: int) -> int:
        """Layer `layer`'s head size: Gemma 4's full-attention layers have their own."""
        full = self.global_head_dim is not None and self.layer_window(layer) is None
        return self.global_head_dim if full and self.global_head_dim is not None else self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        """Layer `layer`'s KV heads: Gemma 4's full-attention layers may have their own."""
        full = self.num_global_kv_heads is not None and self.layer_window(layer) is None
        return self.num_global_kv_heads if full and self.num_global_kv_heads is not None else self.num_kv_heads

    def layer_intermediate_size(self, layer: int) -> int:
        """Layer `layer`'s MLP width: twice the others' for Gemma 4's shared-KV layers with use_double_wide_mlp."""
        double = self.double_wide_shared_mlp and self.kv_source(layer) != layer
        return self.intermediate_size * (2 if double else 1)

    @property
    def kv_slot_shape(self) -> tuple[int, int]:
        """(KV heads, head size) of one cache slot per token: the largest of the layers that store KV (all layers
        alike but for Gemma 4, whose smaller layers use the front of each row); what kv/sizing counts."""
        shapes = {(self.layer_kv_heads(i), self.layer_head_dim(i)) for i in range(self.num_layers)}
        return max(shapes, key=lambda s: (s[0] * s[1], s[0]))

    @property
    def global_rotary_dim(self) -> int:
        """The rotary width of the "global" rotation: of the full-attention layers' heads (Gemma 4's own)."""
        return int((self.global_head_dim or self.head_dim) * self.partial_rotary_factor)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` has a sparse block (else the dense gated MLP of intermediate_size)."""
        return (
            self.num_experts > 0
            and self.layer_has_mlp(layer)
            and layer not in self.mlp_only_layers
            and (layer + 1) % max(1, self.decoder_sparse_step) == 0
        )

    @property
    def expert_activation(self) -> str:
        return self.moe_activation or self.hidden_act

    def layer_window(self, layer: int) -> int | None:
        """The window of layer `layer`'s attention (None: it sees its whole context)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @property
    def rotary_dim(self) -> int:
        """How many of each head's dims RoPE rotates (all unless partial rotary)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_rope(self, layer: int) -> str:
        """Which rotation layer `layer` uses: "global", "local" (Gemma 3's sliding layers) or "none" (NoPE)."""
        if self.no_rope_layers is not None and not self.no_rope_layers[layer]:
            return "none"
        if self.rope_local_theta is not None and self.layer_window(layer) is not None:
            return "local"
        return "global"


def _unsupported(arch: str, where: str) -> ModelLoadError:
    return ModelLoadError(
        f"{where}: architecture {arch!r} is not supported; supported architectures: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)} (GGUF: {', '.join(GGUF_ARCHITECTURES)})"
    )


def _as_list(x: Any) -> list[int]:
    if x is None:
        return []
    if isinstance(x, (list, tuple)):
        return [int(v) for v in x]
    return [int(x)]


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} is not a model config (expected a JSON object)")
    return data


def rope_type(scaling: dict[str, Any] | None, where: str = "") -> str:
    """The scaling's type ("default" for none); ModelLoadError naming a type pagedllm does not compute."""
    if not scaling:
        return "default"
    name = str(scaling.get("rope_type") or scaling.get("type") or "default")
    name = {"su": "longrope"}.get(name, name)  # Phi-3's first configs
    if name not in ROPE_TYPES:
        raise ModelLoadError(
            f"{where}: RoPE scaling type {name!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    return name


def _scaled_context(scaling: dict[str, Any] | None, max_pos: int, where: str) -> tuple[dict[str, Any] | None, int]:
    """The scaling with its type named, and the model's context: dynamic and yarn stretch the original context
    by their factor (as vLLM derives it); the others keep max_position_embeddings."""
    kind = rope_type(scaling, where)
    if scaling is None or kind == "default":
        return None, max_pos
    scaling = {**scaling, "rope_type": kind}
    if kind == "dynamic" or (kind in _ORIGINAL_CONTEXT_TYPES and "original_max_position_embeddings" not in scaling):
        scaling["original_max_position_embeddings"] = max_pos  # dynamic: always the config's own (transformers)
    if kind in ("yarn", "dynamic") and scaling.get("factor"):
        max_pos = max(max_pos, int(scaling["original_max_position_embeddings"] * float(scaling["factor"])))
    return scaling, max_pos


def _hf_rope(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """RoPE fields from config.json in transformers 4's form (rope_theta, rope_scaling, rope_local_base_freq) or
    5's (rope_parameters, nested per layer type for Gemma 3); a top-level original_max_position_embeddings wins
    over the scaling's own, as transformers reads it."""
    rp = cfg.get("rope_parameters")
    out: dict[str, Any] = {}
    if isinstance(rp, dict) and isinstance(rp.get("full_attention"), dict):
        local = rp.get("sliding_attention") or {}
        if rope_type(local, where) != "default":
            raise ModelLoadError(f"{where}: RoPE scaling on sliding-window layers is not supported")
        if local.get("rope_theta") is not None:
            out["rope_local_theta"] = float(local["rope_theta"])
        rp = rp["full_attention"]
    rp = rp if isinstance(rp, dict) else {}
    scaling = cfg.get("rope_scaling") or (rp if rope_type(rp, where) != "default" else None)
    if scaling is not None and rope_type(scaling, where) in _ORIGINAL_CONTEXT_TYPES[:3]:
        top = cfg.get("original_max_position_embeddings")
        scaling = {**scaling, **({"original_max_position_embeddings": int(top)} if top else {})}
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    out["rope_scaling"], out["max_position_embeddings"] = _scaled_context(scaling, max_pos, where)
    out["rope_theta"] = float(cfg.get("rope_theta") or rp.get("rope_theta") or 10000.0)
    out["partial_rotary_factor"] = float(cfg.get("partial_rotary_factor") or rp.get("partial_rotary_factor") or 1.0)
    return out


def _hf_window(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """sliding_window and layer_types as transformers' configs read them: Mistral's window on every layer; Qwen's
    only with use_sliding_window (off by default there), from max_window_layers on when an older config.json has
    no layer_types."""
    window = cfg.get("sliding_window")
    qwen = arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
    if not window or cfg.get("use_sliding_window") is False or (qwen and not cfg.get("use_sliding_window")):
        return {"sliding_window": None, "layer_types": None}
    if int(window) < 1:
        raise ValueError(f"sliding_window must be at least 1, got {window}")
    types = cfg.get("layer_types")
    if types is None and qwen:
        first = int(cfg.get("max_window_layers", 28))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(int(cfg["num_hidden_layers"]))]
    return {"sliding_window": int(window), "layer_types": None if types is None else [str(t) for t in types]}


def _text_only(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal wrapper's config (a `text_config` inside: Qwen3.5's released checkpoints) as its language
    model's, under the wrapper's architecture and tying; any other config as it is."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        return cfg
    tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings"))
    return {**text, "architectures": cfg.get("architectures") or []} | (
        {} if tie is None else {"tie_word_embeddings": tie}
    )


def _family_of(cfg: dict[str, Any], where: str) -> tuple[str, Family]:
    archs = cfg.get("architectures") or []
    arch = str(archs[0]) if archs else ""
    fam = by_architecture(arch) if arch else by_architecture(str(cfg.get("model_type")))
    if fam is None:
        raise _unsupported(arch or str(cfg.get("model_type")), where)
    return arch or fam.architectures[0], fam


def model_name(path: str) -> str:
    """The one name a model goes by (served as, logged, on /v1/kv and in kv-calc): its file or folder's base name,
    without a .gguf extension and llama.cpp's quantization tag: SmolLM2-135M-Instruct.Q4_1.gguf ->
    SmolLM2-135M-Instruct. The checkpoint's own name (GGUF general.name, config.json's _name_or_path) is often a
    training run's, so it is not used."""
    path = os.path.normpath(os.path.expanduser(str(path)))
    if os.path.basename(path) == "config.json":
        path = os.path.dirname(path) or os.getcwd()
    stem = re.sub(r"\.gguf$", "", os.path.basename(path) or path, flags=re.IGNORECASE)
    return re.sub(r"[.-](I?Q\d\w*|F16|F32|BF16)$", "", stem, flags=re.IGNORECASE) or stem


def config_from_hf_dict(cfg: dict[str, Any], where: str, gen_cfg: dict[str, Any] | None = None) -> ModelConfig:
    """Build a ModelConfig from a transformers config.json dict (and optional generation_config.json)."""
    cfg = _text_only(cfg)
    arch, fam = _family_of(cfg, where)
    if arch in fam.multimodal_architectures and isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"] | {"architectures": [arch]}  # the text model of a multimodal checkpoint
    try:
        cfg = fam.hf_config(cfg)
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        bias = bool(cfg.get("attention_bias", fam.bias_default))
        if cfg.get("mlp_bias"):
            raise ModelLoadError(f"{where}: mlp_bias is not supported")
        c = ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size", 0) if fam.moe else cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", fam.tie_default)),
            attention_bias=bias,
            o_proj_bias=bias and not fam.bias_default,
            bos_token_id=cfg.get("bos_token_id", (gen_cfg or {}).get("bos_token_id")),
            eos_token_ids=_as_list((gen_cfg or {}).get("eos_token_id")) or _as_list(cfg.get("eos_token_id")),
            family=fam.name,
            hidden_act=str(cfg.get("hidden_act") or "silu"),
            name=model_name(where),
            checkpoint_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        )
        for key, value in (_hf_rope(cfg, where) | _hf_window(cfg, arch) | fam.hf_fields(cfg)).items():
            setattr(c, key, value)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{where}: incomplete or invalid model config ({e})") from e
    return _checked(c, where)


def _checked(c: ModelConfig, where: str) -> ModelConfig:
    """A config the decoder computes as its checkpoint means, or a ModelLoadError naming what it cannot."""
    if c.hidden_act not in ACTIVATIONS:
        raise ModelLoadError(f"{where}: activation {c.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})")
    rope_type(c.rope_scaling, where)
    if c.rotary_dim % 2 or c.rotary_dim > c.head_dim:
        raise ModelLoadError(f"{where}: a rotary width of {c.rotary_dim} does not fit heads of {c.head_dim}")
    for name, per_layer in (("layer_types", c.layer_types), ("no_rope_layers", c.no_rope_layers)):
        if per_layer is not None and len(per_layer) != c.num_layers:
            raise ModelLoadError(f"{where}: {name} has {len(per_layer)} entries for {c.num_layers} layers")
    kinds = ("sliding_attention", "full_attention", "linear_attention", "mlp")
    bad = sorted({t for t in c.layer_types or [] if t not in kinds})
    if bad:
        raise ModelLoadError(f"{where}: layer type {bad[0]!r} is not supported ({', '.join(kinds)})")
    if not c.mlp_gated and c.hidden_act != "relu2":
        raise ModelLoadError(f"{where}: an ungated MLP with {c.hidden_act!r} is not supported (relu2)")
    if c.mlp_gated and c.hidden_act == "relu2":
        raise ModelLoadError(f"{where}: a gated MLP with relu2 is not supported")
    if c.linear_layers and c.family not in LINEAR_ATTENTION_FAMILIES:
        raise ModelLoadError(f"{where}: linear_attention layers are not supported in {c.family}")
    if c.recurrent_mixer not in RECURRENT_MIXERS:
        raise ModelLoadError(f"{where}: recurrent mixer {c.recurrent_mixer!r} is not supported")
    if c.recurrent_mixer == "mamba2" and c.linear_layers and (c.mamba_num_heads % max(1, c.mamba_num_groups)):
        raise ModelLoadError(f"{where}: {c.mamba_num_groups} Mamba2 groups do not divide {c.mamba_num_heads} heads")
    return _checked_moe(c, where) if c.num_experts else c


def _checked_moe(c: ModelConfig, where: str) -> ModelConfig:
    """A sparse config the MoE block computes exactly, or a ModelLoadError naming what it does not."""
    if c.moe_router not in ROUTERS:
        raise ModelLoadError(f"{where}: MoE router {c.moe_router!r} is not supported ({', '.join(ROUTERS)})")
    if c.expert_activation not in MOE_ACTIVATIONS:
        raise ModelLoadError(
            f"{where}: expert activation {c.expert_activation!r} is not supported ({', '.join(MOE_ACTIVATIONS)})"
        )
    if not 0 < c.num_experts_per_tok <= c.num_experts:
        raise ModelLoadError(f"{where}: {c.num_experts_per_tok} experts per token of {c.num_experts}")
    if (c.expert_activation == "relu2") == c.mlp_gated:  # the experts take the MLP's form: gated, or relu2 ungated
        form = "a gated" if c.mlp_gated else "an ungated"
        raise ModelLoadError(f"{where}: experts with {c.expert_activation!r} beside {form} MLP are not supported")
    groups, per_group = c.num_expert_group, c.num_experts // max(1, c.num_expert_group)
    if groups != 1 and (
        c.moe_router != "sigmoid"
        or groups < 1
        or c.num_experts % groups
        or per_group < 2
        or not 0 < c.topk_group <= groups
        or c.num_experts_per_tok > c.topk_group * per_group
    ):
        raise ModelLoadError(
            f"{where}: {c.num_experts} experts in {groups} groups, top {c.num_experts_per_tok} of the best "
            f"{c.topk_group} groups' ({c.moe_router} router) is not supported"
        )
    if c.moe_intermediate_size <= 0:
        raise ModelLoadError(f"{where}: an expert ffn size of {c.moe_intermediate_size}")
    dense = [i for i in range(c.num_layers) if c.layer_has_mlp(i) and not c.is_moe_layer(i)]
    if dense and c.intermediate_size <= 0:  # Qwen3.5-MoE's config has no dense size: every layer is sparse
        raise ModelLoadError(f"{where}: dense layer {dense[0]} but no intermediate_size in the config")
    return c


def _gguf_rope(h: GGUFHeader, where: str) -> dict[str, Any]:
    stype = h.get("rope.scaling.type")
    ctx = int(h.get("context_length", 2048))
    if stype in (None, "none"):
        return {"rope_scaling": None, "max_position_embeddings": ctx}
    if stype not in ("linear", "yarn"):
        raise ModelLoadError(f"{where}: GGUF RoPE scaling type {stype!r} is not supported (linear, yarn)")
    scaling: dict[str, Any] = {"rope_type": stype, "factor": float(h.get("rope.scaling.factor"))}
    if stype == "yarn":
        scaling["original_max_position_embeddings"] = int(h.get("rope.scaling.original_context_length", ctx))
    out, ctx = _scaled_context(scaling, ctx, where)
    return {"rope_scaling": out, "max_position_embeddings": ctx}


def _gguf_stops(md: dict[str, Any]) -> list[int]:
    """The end-of-turn / end-of-message ids a GGUF names besides its EOS."""
    return [int(md[k]) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in md]


def _first(value: Any) -> int:
    """A GGUF size that may be one per layer (Gemma 4's feed_forward_length, head_count_kv): the first layer's (its
    family reads the rest); 0 where the file has none (qwen35moe: every layer sparse)."""
    return int(value[0] if isinstance(value, list) else value or 0)


def config_from_gguf(h: GGUFHeader, where: str) -> ModelConfig:
    """Build a ModelConfig from a GGUF header (llama.cpp key names, and its RoPE factor tensors)."""
    arch_key = str(h.metadata.get("general.architecture"))
    fam = by_gguf_arch(arch_key, moe=bool(h.get("expert_count")))
    if fam is None:
        raise _unsupported(arch_key, where)
    try:
        hidden = int(h.get("embedding_length"))
        heads = int(h.get("attention.head_count"))
        head_dim = int(h.get("attention.key_length") or hidden // heads)
        vocab = h.get("vocab_size") or h.tensors.get("token_embd.weight", (None,))[0]
        if vocab is None:
            raise ModelLoadError(f"{where}: GGUF metadata lacks {h.prefix}vocab_size")
        md, t = h.metadata, h.tensors
        window = h.get("attention.sliding_window")
        c = ModelConfig(
            architecture=fam.architectures[0],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=_first(h.get("feed_forward_length")),
            num_layers=int(h.get("block_count")),
            num_heads=heads,
            # per layer in hybrids (0: a layer with no KV) and Gemma 4: the first layer that has KV
            num_kv_heads=next((n for n in _as_list(h.get("attention.head_count_kv", heads)) if n), heads),
            head_dim=head_dim,
            rms_norm_eps=float(h.get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(h.get("rope.freq_base", 10000.0)),
            tie_word_embeddings="output.weight" not in t,
            attention_bias="blk.0.attn_q.bias" in t or "blk.0.attn_qkv.bias" in t,
            o_proj_bias="blk.0.attn_output.bias" in t,
            bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=list(dict.fromkeys(_as_list(md.get("tokenizer.ggml.eos_token_id")) + _gguf_stops(md))),
            family=fam.name,
            partial_rotary_factor=int(h.get("rope.dimension_count") or head_dim) / head_dim,
            name=model_name(where),
            checkpoint_dtype="quantized",
            sliding_window=None if not window else int(window),
        )
        for key, value in (_gguf_rope(h, where) | fam.gguf_fields(h)).items():
            setattr(c, key, value)
    except (KeyError, TypeError) as e:
        raise ModelLoadError(f"{where}: GGUF metadata lacks or mistypes {e}") from e
    return _checked(c, where)


def with_overrides(cfg: ModelConfig, overrides: dict[str, Any]) -> ModelConfig:
    """`cfg` with some fields replaced, as vLLM's --hf-overrides replaces config.json keys (e.g. {"sliding_window":
    256} to measure what a window saves on a model that has none); an unknown or ill-typed key is a UserError."""
    from dataclasses import fields, replace

    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise UserError(f"hf_overrides: unknown model config keys {unknown}; known: {', '.join(sorted(known))}")
    out = replace(cfg, **overrides)
    window, types = out.sliding_window, out.layer_types
    if window is not None and (not isinstance(window, int) or window < 1):
        raise UserError(f"hf_overrides: sliding_window must be a whole number of tokens >= 1, got {window!r}")
    if types is not None and len(types) != out.num_layers:
        raise UserError(f"hf_overrides: layer_types must name each of the {out.num_layers} layers")
    return out


def resolve_model_path(model: str | None) -> str:
    """None -> the default GGUF; otherwise the path, which must exist."""
    if model is None or model == "":
        from pagedllm.model.default_model import default_model_path

        return default_model_path()
    path = os.path.expanduser(str(model))
    if not os.path.exists(path):
        raise ModelLoadError(f"model path not found: {path}")
    return path


def is_gguf(path: str) -> bool:
    """A file that starts with the GGUF magic (whatever its extension)."""
    if not os.path.isfile(path):
        return False
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e


def load_model_config(model: str | None = None) -> ModelConfig:
    """Read a model's config cheaply: config.json (+ generation_config.json) or the GGUF header only."""
    path = resolve_model_path(model)
    if os.path.isdir(path):
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ModelLoadError(f"{path} is not a model folder: no config.json in it")
        gen_path = os.path.join(path, "generation_config.json")
        gen = _read_json(gen_path) if os.path.isfile(gen_path) else None
        return config_from_hf_dict(_read_json(cfg_path), cfg_path, gen)
    if is_gguf(path):
        from pagedllm.model.formats.gguf_file import GGUFFile

        with GGUFFile(path) as f:
            return config_from_gguf(f.header(), path)
    if os.path.basename(path) == "config.json":
        return load_model_config(os.path.dirname(path) or ".")
    raise ModelLoadError(
        f"{path} is not a model: expected a Hugging Face model folder (with config.json) or a GGUF file"
    )
