"""The model's shape, read cheaply: the KV-cache calculator and the engine need it before (or without) weights.

`load_model_config` reads only `config.json` / `generation_config.json`, or only the GGUF header; it never
dequantizes anything.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from pagedllm.errors import ModelLoadError, UserError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# GGUF `general.architecture` -> HF architecture. Mistral GGUFs use "llama".
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


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
    name: str = ""
    checkpoint_dtype: str = "float32"  # dtype the weights are stored in ("quantized" for GGUF quants)
    # Tokens a query of a sliding layer sees, itself included (transformers: kv_idx > q_idx - sliding_window);
    # None: full attention.
    sliding_window: int | None = None
    # Per layer "sliding_attention" / "full_attention" (transformers 5's names); None: every layer uses
    # sliding_window when it is set.
    layer_types: list[str] | None = None
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_logit_softcapping: float | None = None  # Gemma 2: cap * tanh(score / cap) before the softmax

    def layer_window(self, layer: int) -> int | None:
        """The window of layer `layer`'s attention (None: it sees its whole context)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None


def _unsupported(arch: str, where: str) -> ModelLoadError:
    return ModelLoadError(
        f"{where}: architecture {arch!r} is not supported; supported architectures: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}"
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


def _hf_sliding(cfg: dict[str, Any], arch: str, num_layers: int) -> tuple[int | None, list[str] | None]:
    """Mistral's `sliding_window` (every layer) and Qwen2's `use_sliding_window` + `max_window_layers` (the layers
    from that index on slide), or an explicit `layer_types`, as transformers' configs read them."""
    window = cfg.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
        window = None
    if window is None:
        return None, None
    window = int(window)
    if window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {window}")
    types = cfg.get("layer_types")
    if types is None and arch == "Qwen2ForCausalLM":
        first = int(cfg.get("max_window_layers", 28))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if types is not None and (len(types) != num_layers or set(types) - {"sliding_attention", "full_attention"}):
        raise ValueError(f"layer_types must name sliding_attention / full_attention for each of {num_layers} layers")
    return window, None if types is None else [str(t) for t in types]


def config_from_hf_dict(cfg: dict[str, Any], where: str, gen_cfg: dict[str, Any] | None = None) -> ModelConfig:
    """Build a ModelConfig from a transformers config.json dict (and optional generation_config.json)."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else ""
    if arch not in SUPPORTED_ARCHITECTURES:
        model_type = cfg.get("model_type")
        guess = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
        if not arch and model_type in guess:
            arch = guess[model_type]
        else:
            raise _unsupported(arch or str(model_type), where)
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or hidden // heads
        eos = _as_list((gen_cfg or {}).get("eos_token_id")) or _as_list(cfg.get("eos_token_id"))
        window, layer_types = _hf_sliding(cfg, arch, int(cfg["num_hidden_layers"]))
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        rp = cfg.get("rope_parameters")  # transformers 5 folds theta + scaling into rope_parameters
        if isinstance(rp, dict):
            rope_theta = rope_theta or rp.get("rope_theta")
            if rope_scaling is None and rp.get("rope_type", "default") != "default":
                rope_scaling = dict(rp)
        if isinstance(rope_scaling, dict):
            rtype = rope_scaling.get("rope_type") or rope_scaling.get("type") or "default"
            rope_scaling = None if rtype == "default" else {**rope_scaling, "rope_type": rtype}
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            bos_token_id=cfg.get("bos_token_id", (gen_cfg or {}).get("bos_token_id")),
            eos_token_ids=eos,
            name=str(cfg.get("_name_or_path") or ""),
            checkpoint_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            sliding_window=window,
            layer_types=layer_types,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{where}: incomplete or invalid model config ({e})") from e


def config_from_gguf_metadata(md: dict[str, Any], where: str) -> ModelConfig:
    """Build a ModelConfig from GGUF metadata (llama.cpp key names)."""
    arch_key = md.get("general.architecture")
    if arch_key not in GGUF_ARCHITECTURES:
        raise _unsupported(str(arch_key), where)
    p = arch_key + "."
    try:
        hidden = int(md[p + "embedding_length"])
        heads = int(md[p + "attention.head_count"])
        kv_heads = md.get(p + "attention.head_count_kv", heads)
        head_dim = int(md.get(p + "attention.key_length") or md.get(p + "rope.dimension_count") or hidden // heads)
        vocab = md.get(p + "vocab_size")
        if vocab is None:
            raise ModelLoadError(f"{where}: GGUF metadata lacks {p}vocab_size")
        rope_scaling = None
        stype = md.get(p + "rope.scaling.type")
        if stype == "linear":
            rope_scaling = {"rope_type": "linear", "factor": float(md[p + "rope.scaling.factor"])}
        eos = md.get("tokenizer.ggml.eos_token_id")
        window = md.get(p + "attention.sliding_window")
        return ModelConfig(
            architecture=GGUF_ARCHITECTURES[arch_key],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(md[p + "feed_forward_length"]),
            num_layers=int(md[p + "block_count"]),
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=head_dim,
            rms_norm_eps=float(md.get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(md.get(p + "rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(md.get(p + "context_length", 2048)),
            tie_word_embeddings=True,  # corrected by the loader when an `output.weight` tensor exists
            attention_bias=arch_key == "qwen2",
            bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_as_list(eos),
            name=str(md.get("general.name", "")),
            checkpoint_dtype="quantized",
            sliding_window=int(window) if window else None,
        )
    except KeyError as e:
        raise ModelLoadError(f"{where}: GGUF metadata lacks {e}") from e


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
        from pagedllm.model.gguf_file import GGUFFile

        with GGUFFile(path) as f:
            cfg = config_from_gguf_metadata(f.metadata, path)
            cfg.tie_word_embeddings = "output.weight" not in f.tensors
            return cfg
    if os.path.basename(path) == "config.json":
        return load_model_config(os.path.dirname(path) or ".")
    raise ModelLoadError(
        f"{path} is not a model: expected a Hugging Face model folder (with config.json) or a GGUF file"
    )
