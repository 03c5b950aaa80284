"""What a model family is to pagedllm: its names, the config keys it reads beyond the common ones, and where its
tensors sit in a Hugging Face checkpoint (GGUF names follow from llama.cpp's own table, `gguf.TENSOR_NAMES`).

Every family runs on the one shared decoder (decoder.py); what differs between them is data: which norms a
layer has, q/k norms, the activation, multipliers, RoPE per layer. A family module fills a `Family` with that,
reading config.json or GGUF metadata into `ModelConfig` fields. Nothing here imports torch: the KV-cache
calculator reads configs without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Our per-layer tensor slots -> the HF names of their pieces (in row order), under "model.layers.N.".
# qkv / gate_up pieces are merged into one matmul at load; a family with fused checkpoints names one piece.
LLAMA_LAYER: dict[str, tuple[str, ...]] = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
    "attn_norm": ("input_layernorm",),
    "mlp_norm": ("post_attention_layernorm",),
    "q_norm": ("self_attn.q_norm",),
    "k_norm": ("self_attn.k_norm",),
}


@dataclass
class GGUFHeader:
    """What a family reads from a GGUF file: its metadata (llama.cpp key names, `prefix` = "<arch>."), tensor
    names and shapes, and `read` for a small float tensor (RoPE factors) without loading the weights."""

    metadata: dict[str, Any]
    prefix: str
    tensors: dict[str, tuple[int, ...]]
    read: Callable[[str], list[float]]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(self.prefix + key, default)

    def require(self, key: str) -> Any:
        """A key the family cannot do without: a KeyError naming it (config.py makes it a ModelLoadError)."""
        value = self.get(key)
        if value is None:
            raise KeyError(self.prefix + key)
        return value


@dataclass(frozen=True)
class Unfuse:
    """A checkpoint tensor (its name under "model.layers.N.") that holds several of the table's tensors: every
    expert's along its first dim (`experts`), and / or gate and up stacked along the rows (two `targets`: halves,
    or alternating rows when `interleaved`, as gpt-oss stores them); `transposed`: stored [.., in, out] (gpt-oss).
    One target and no experts: another name for one tensor (transformers 5's against the original's)."""

    source: str
    targets: tuple[str, ...]  # names under "model.layers.N.", `{e}` for the expert's number
    experts: bool = True
    transposed: bool = False
    interleaved: bool = False


def no_fields(_source: Any) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Family:
    """One architecture family: HF `architectures` / `model_type` names, its GGUF `general.architecture`,
    functions from config.json (dict) and from a GGUF header to extra ModelConfig fields, its tensor table."""

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    gguf_archs: tuple[str, ...]
    hf_fields: Callable[[dict[str, Any]], dict[str, Any]] = no_fields
    gguf_fields: Callable[[GGUFHeader], dict[str, Any]] = no_fields
    layer_tensors: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(LLAMA_LAYER))
    tie_default: bool = False  # tie_word_embeddings when config.json omits it (the config class's default)
    bias_default: bool = False  # attention_bias when config.json omits it (Qwen2 always has q/k/v biases)
    gguf_permute_qk: bool = False  # llama.cpp's converter permuted Q/K rows for its interleaved RoPE
    moe: bool = False  # sparse layers (families/moe.py); picks Mixtral over Llama for a GGUF "llama" with experts
    unfuse: tuple[Unfuse, ...] = ()  # checkpoint tensors that hold several of the table's (3-D experts, renames)
    # HF checkpoint name prefixes read as another (a multimodal wrapper's language model: "model.language_model."
    # as "model."), and those of tensors the text model does not use (its vision tower, multi-token prediction)
    renamed: tuple[tuple[str, str], ...] = ()
    skipped: tuple[str, ...] = ()
    final_norm: str = "norm"  # the final norm's name under "model." (LFM2: embedding_norm)
    # multimodal checkpoints of which pagedllm runs the text model: its config under config.json's text_config,
    # its tensors under "model.language_model." (the vision and audio towers' are left unread)
    multimodal_architectures: tuple[str, ...] = ()
    # GGUF names (under "blk.N.") of tensors llama.cpp's name map does not give, by their HF names (under
    # "model.layers.N."), as a function of whether the model has experts (Granite 4.0-H's shared MLP is
    # ffn_*_shexp beside experts, the plain ffn_* without)
    gguf_layer_names: Callable[[bool], dict[str, str]] | None = None
    # config.json as the family's config class reads it, before the common keys are read (Nemotron-H's layer count,
    # which transformers 5 derives from its layer kinds and does not save)
    hf_config: Callable[[dict[str, Any]], dict[str, Any]] = lambda cfg: cfg


def every_nth(num_layers: int, n: int, hit: str, other: str) -> list[str]:
    """Layer i gets `hit` when (i + 1) % n == 0, else `other` (Gemma's global layers, SmolLM3's NoPE layers)."""
    return [hit if (i + 1) % n == 0 else other for i in range(num_layers)]
