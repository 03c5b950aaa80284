"""Model loading, the decoder and its families, paged attention. The engine uses `load_model` and `ModelRunner`."""

from pagedllm.model.config import ModelConfig, load_model_config
from pagedllm.model.default_model import default_model_path
from pagedllm.model.kernels.kv_quant import kv_cache_dtype
from pagedllm.model.loader import LoadedModel, load_model, resolve_dtype
from pagedllm.model.runner import ModelRunner, SeqChunk
from pagedllm.model.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "ModelConfig",
    "load_model_config",
    "default_model_path",
    "kv_cache_dtype",
    "LoadedModel",
    "load_model",
    "resolve_dtype",
    "ModelRunner",
    "SeqChunk",
    "Tokenizer",
    "load_tokenizer",
]
