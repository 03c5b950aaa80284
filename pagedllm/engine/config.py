"""Engine settings, declared once: each field's type, default, constraint and help (its docstring) make the flag
that every command building an engine has (vLLM's names), its help and its check."""

from __future__ import annotations

import argparse
from typing import Annotated, Any, Literal

import torch
from pydantic import Field, SkipValidation

from pagedllm.engine.spec_decode import SpeculativeConfig
from pagedllm.errors import UserError
from pagedllm.kv.sizing import KVCacheDType
from pagedllm.settings import Bytes, Flag, add_flags, from_args, settings

DEFAULT_KV_OFFLOAD_SIZE = 16 * 2**30


@settings
class EngineConfig:
    model: str | None = None
    """a Hugging Face model folder or GGUF file, served and logged under its base name (default:
    SmolLM2-135M-Instruct, a 4-bit GGUF that comes with pagedllm)"""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """the model's dtype in memory: auto (the default: bfloat16 where this CPU or GPU computes it natively, as
    AMX and AVX-512 BF16 CPUs do, else float32), float32 or bfloat16"""
    quantization: Annotated[Literal["auto", "none", "gguf", "int8", "int4"] | None, Flag(short="-q")] = None
    """weights in memory: auto (the default) keeps a GGUF's quantized tensors (Q4_0 .. Q8_0, Q2_K .. Q6_K, MXFP4,
    IQ4_NL / IQ4_XS), and a Hugging Face folder's bfloat16 / float16 matrices, as stored for the C kernels and the
    fused step unless this CPU's quantized kernel is measured slower than dense (measured once per CPU and
    remembered); gguf always keeps a GGUF's; int8/int4 round a checkpoint's weights at load (weight-only, groups of
    32); none dequantizes to --dtype (dense torch matmuls; what auto means for a float32 folder)"""
    quantized_activations: Literal["auto", "int16", "int8", "none"] = "auto"
    """how quantized weights meet the activations: int16 rounds each group of 32 inputs of a matmul to 16-bit
    integers and multiplies the weights' codes by them directly (VNNI where the CPU has it; one-row decode ~2x
    faster at 1B, each input within 1/65534 of its group's largest); none keeps float32 activations (the exact
    path, equal to transformers' float32 within summation order); auto (the default): int16 where the CPU has
    vector kernels for it; int8: int16, and from the row count at which the kernel choice measures it faster
    (prefill chunks) int8 (llama.cpp's Q8_0 activations, each input within 1/254 of its group's largest: byte dot
    products, 1.1-1.4x q-bf16 and ~2x int16 for prefill; greedy tokens no longer transformers' token for token,
    its accuracy in docs/benchmarks.md). A sequence's result does not depend on the batch, except across that
    row count under int8"""
    kv_cache_dtype: KVCacheDType = "auto"
    """the KV cache's dtype: auto (the default: the model's --dtype), float32, bfloat16, int8, fp8 (= fp8_e4m3)
    or fp8_e5m2. A bfloat16 cache holds twice the tokens of a float32 one; int8 and fp8 keep one byte per value
    and a bfloat16 scale per (token, KV head), 3.9x the tokens of float32 (1.9x bfloat16); attention computes in
    the model's dtype"""
    device: str = "auto"
    """where the model runs: auto (the default: a CUDA GPU if there is one, else the CPU), cpu, cuda, cuda:1, ..."""
    block_size: int = Field(default=16, ge=1)
    """tokens per KV block: the unit the cache hands out and shares (default: 16)"""
    max_num_seqs: int = Field(default=64, ge=1)
    """most requests running at once (default: 64)"""
    max_num_batched_tokens: int = Field(default=512, ge=1)
    """most tokens one step computes; longer prompts are prefilled in chunks of it (default: 512)"""
    max_model_len: Annotated[int, Field(ge=1)] | None = None
    """longest prompt + output of one request (default: the model's context length)"""
    enable_prefix_caching: bool = True
    """share the KV blocks of common prompt prefixes between requests (default: on)"""
    mamba_cache_mode: Literal["none", "align", "all"] = "align"
    """a hybrid model's prefix caching (its linear-attention / Mamba / short conv layers' recurrent state, vLLM's
    flag): align (the default) keeps the state where a prompt chunk ends, chunks cut at block boundaries (a row
    per running request); all also keeps it at every block boundary inside a chunk, so the first prompt of a
    shared prefix already leaves one where the prefix ends (rows take up to half the KV budget; a row is one
    request's state: at Qwen3.5-2B 18.6 MiB, 99x the KV of a block of 16 tokens, at LFM2-1.2B 0.4x: kv-calc
    --model); none: a hybrid model caches no prefix"""
    kv_allocation: Literal["paged", "contiguous"] = "paged"
    """paged (the default): blocks handed out as a request grows; contiguous: each request reserves
    max-model-len tokens at admission, the baseline paging is measured against"""
    disable_hybrid_kv_cache_manager: bool = False
    """one block table for every layer of a model that mixes sliding and full attention (vLLM's): no block goes
    back before its request ends (default: a table per KV-cache group, the sliding groups' old blocks freed)"""
    kv_cache_memory: Annotated[Bytes, Field(gt=0)] | None = None
    """KV cache size in bytes, e.g. 2GiB (wins over --gpu-memory-utilization); default on CPU: half the memory
    free after loading the weights, at most 2 GiB; on GPU: see --gpu-memory-utilization"""
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] | None = None
    """share of device memory (on CPU: of RAM) for weights, activations and KV cache (default: on GPU 0.9; on CPU
    unset, the KV cache sized as --kv-cache-memory says instead)"""
    kv_offload_dir: Annotated[str | None, Flag(metavar="DIR")] = None
    """a disk tier for the prefix cache: full blocks evicted from RAM are written to DIR and read back on a later
    hit, also after a restart (only by an engine with the same weights, dtypes, block size and layer shape;
    default: no disk tier)"""
    kv_offload_size: Annotated[Bytes, Field(gt=0)] = DEFAULT_KV_OFFLOAD_SIZE
    """most bytes the disk tier holds, e.g. 16GiB (default 16 GiB); least recently used blocks go first"""
    seed: int = 0
    """seed of random sampling for requests that bring no seed of their own (default: 0)"""
    log_stats_interval: float = 5.0
    """seconds between "busy" log lines; 0 turns them off (default: 5)"""
    # JSON text, a dict or a SpeculativeConfig, parsed by SpeculativeConfig.parse after the other checks. The
    # Python API is opt-in, as vLLM's LLM(...) is; the commands default to auto.
    speculative_config: Annotated[
        SkipValidation[SpeculativeConfig | str | dict[str, Any] | None], Flag(metavar="JSON", cli_default="auto")
    ] = None
    """speculative decoding by prompt lookup, e.g. '{"method": "ngram", "num_speculative_tokens": 4,
    "prompt_lookup_max": 4, "prompt_lookup_min": 2}'; "disable_by_batch_size": N turns it off while N or more
    requests run or wait; none: off; auto (default): that example on a CPU, where it was measured to pay, off
    elsewhere"""
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """fcfs: requests are admitted in arrival order; priority: by each request's `priority` (lower first, then
    arrival), and when the cache is short the lowest priority running request is preempted first (default: fcfs;
    vLLM's flag)"""
    enable_kv_cache_events: bool = False
    """record blocks entering and leaving the prefix cache, for a router that follows them (default: off)"""
    kv_blend_recompute: Annotated[float, Field(ge=0, le=1)] = 0.15
    """kv_blend: for requests that mark reusable segments of their prompt (kv_segments: RAG passages), the share
    of the reused passages' tokens computed again (ceil(r L) a passage, spent on the passage tokens nearest the
    question); the rest of their stored KV is copied, keys re-rotated to where it lands. 1.0 = full prefill,
    exact; a request may set its own (default: 0.15; requests without segments are never blended)"""
    kv_blend_max_deviation: Annotated[float, Field(ge=0, le=1)] | None = None
    """kv_blend's bound mode, in place of the fixed share: per prompt, the copied KV is measured against KV computed
    on the first layers, and the tokens that deviate most are computed again until the deviation left (the copied
    tokens' relative K/V error at layer 1; 0.01 measured) is at most this; 0 = full prefill, exact; a request may
    set its own (kv_blend.max_deviation) or a fixed share (default: off, the fixed share)"""

    enable_lora: bool = False
    """serve LoRA adapters on the base model: requests name one (offline: lora_request=LoRARequest(...); the
    server: --lora-modules, a request's `model`), and requests of different adapters and the base share a step
    (default: off)"""
    max_loras: int = Field(default=1, ge=1)
    """most LoRA adapters in one step: a request of another adapter waits until one finishes (default: 1)"""
    max_lora_rank: int = Field(default=16, ge=1)
    """the highest rank of an adapter; a higher one is refused at load (default: 16)"""
    max_cpu_loras: Annotated[int, Field(ge=1)] | None = None
    """most LoRA adapters kept loaded; the least recently used one no request holds is dropped first (default:
    --max-loras)"""

    def __post_init__(self) -> None:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise UserError(f"--max-cpu-loras: {self.max_cpu_loras} is less than --max-loras {self.max_loras}")
        if self.kv_offload_dir is not None and not (self.kv_allocation == "paged" and self.enable_prefix_caching):
            raise UserError("--kv-offload-dir: needs paged allocation with prefix caching on")
        on_cpu = self.device == "cpu" or (self.device == "auto" and not torch.cuda.is_available())
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config, on_cpu)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        return from_args(cls, args)


CLI_ONLY_IN_PYTHON = ("log_stats_interval", "enable_kv_cache_events")  # settings the commands do not expose


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = True) -> None:
    """The engine flags, vLLM's names, from EngineConfig; `model` is positional (serve MODEL) or --model."""
    if model_positional:
        help = EngineConfig.__pydantic_fields__["model"].description  # type: ignore[attr-defined]
        parser.add_argument("model", nargs="?", default=None, help=help)
    else:
        add_flags(parser, EngineConfig, only=("model",))
    add_flags(parser.add_argument_group("engine"), EngineConfig, skip=("model",) + CLI_ONLY_IN_PYTHON)
