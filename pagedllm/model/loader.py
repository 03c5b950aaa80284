"""`load_model`: a HF folder or GGUF file (None = the default model) -> model + tokenizer + config, ready to run.

dtype "auto" picks bfloat16 for 16-bit and quantized checkpoints (bf16 matmuls are the fast path on CPUs with
AMX and on GPUs) and float32 for float32 checkpoints (exactness). Weights are created uninitialised and filled
straight from the checkpoint, so loading costs one read (and, for GGUF, one dequantization) per tensor.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from pagedllm.errors import ModelLoadError, UserError
from pagedllm.model.config import ModelConfig, is_gguf, load_model_config, resolve_model_path
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger("pagedllm.model")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    """What the engine gets: the module, its tokenizer and config, and facts for sizing the KV cache."""

    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    dtype: torch.dtype
    device: torch.device
    load_seconds: float
    weight_bytes: int
    path: str = ""


def fast_bf16(device: torch.device) -> bool:
    """Whether bfloat16 matmuls run natively: a GPU that has it, or a CPU with AMX / AVX-512 BF16.

    On a CPU without them (AVX2 only) torch emulates bf16 and a step is 2-3x slower than float32.
    """
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return True
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = f.read()
    except OSError:
        return False
    return " amx_bf16" in flags or " avx512_bf16" in flags


def resolve_dtype(dtype: str | torch.dtype, cfg: ModelConfig, device: torch.device | None = None) -> torch.dtype:
    """'auto' | 'float32' | 'bfloat16' (or the torch dtype) -> torch dtype; UserError naming --dtype otherwise."""
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
        raise UserError(f"--dtype {dtype} is not supported; use auto, float32 or bfloat16")
    d = str(dtype).lower()
    if d in ("bf16",):
        d = "bfloat16"
    if d in ("fp32", "float"):
        d = "float32"
    if d == "auto":
        ck = cfg.checkpoint_dtype.lower()
        if ck in ("float32", "fp32") or not fast_bf16(device or torch.device("cpu")):
            return torch.float32
        return torch.bfloat16
    if d in DTYPES:
        return DTYPES[d]
    raise UserError(f"--dtype {dtype!r} is not supported; use auto, float32 or bfloat16")


def load_model(model: str | None = None, dtype: str | torch.dtype = "auto",
               device: str | torch.device = "cpu", verbose: bool = True) -> LoadedModel:
    """Load weights + tokenizer; raises ModelLoadError for bad paths/files/architectures, UserError for --dtype."""
    t0 = time.perf_counter()
    path = resolve_model_path(model)
    cfg = load_model_config(path)
    dev = torch.device(device)
    torch_dtype = resolve_dtype(dtype, cfg, dev)
    net = LlamaForCausalLM(cfg, torch_dtype, dev)
    if os.path.isdir(path):
        from pagedllm.model.weights import assign_weights, iter_safetensors

        assign_weights(net, iter_safetensors(path), path)
    elif is_gguf(path):
        from pagedllm.model.gguf_file import GGUFFile
        from pagedllm.model.weights import assign_weights, iter_gguf

        with GGUFFile(path) as gf:
            assign_weights(net, iter_gguf(gf, cfg), path)
    else:  # load_model_config already rejects this; kept for clarity
        raise ModelLoadError(f"{path} is not a model")
    net.eval()
    tokenizer = load_tokenizer(path)
    weight_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    if dev.type == "cpu":
        net.pack_cpu_weights()
    secs = time.perf_counter() - t0
    msg = (f"loaded {cfg.name or os.path.basename(path)} ({cfg.architecture}, {weight_bytes / 2**20:.0f} MiB "
           f"{str(torch_dtype).removeprefix('torch.')}) in {secs:.1f} s")
    log.info(msg)
    if verbose and not log.isEnabledFor(logging.INFO):
        import sys

        print(msg, file=sys.stderr)
    return LoadedModel(cfg, net, tokenizer, torch_dtype, dev, secs, weight_bytes, path)
