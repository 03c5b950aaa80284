"""Engine settings, with the flag names users know from vLLM, shared by every command that builds an engine."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

import torch

from pagedllm.engine.spec_decode import SpeculativeConfig
from pagedllm.errors import UserError
from pagedllm.kv.sizing import parse_memory_size

DEFAULT_CPU_KV_CACHE_MEMORY = 2 * 2**30  # on CPU the cache shares RAM with everything else: a fixed space, as vLLM-CPU


@dataclass
class EngineConfig:
    model: str | None = None  # HF folder or GGUF file; None = the default model
    dtype: str = "auto"
    quantization: str | None = None  # None: auto (a GGUF: the fastest measured path), none (a HF folder)
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; bfloat16 halves the cache of a float32 model
    device: str = "auto"  # auto: cuda if available, else cpu
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    kv_allocation: str = "paged"  # or "contiguous": the chapter's whole-length baseline
    kv_cache_memory: int | None = None  # bytes; wins over gpu_memory_utilization
    gpu_memory_utilization: float | None = None  # share of device memory (on CPU: of RAM) for weights + cache
    seed: int = 0
    log_stats_interval: float = 5.0  # seconds between "busy" log lines; 0 turns them off
    # --speculative-config: JSON text, a dict or a SpeculativeConfig; None / "none": no speculative decoding; "auto"
    # (the CLI's default): prompt lookup on a CPU, where it was measured to pay (spec_decode.CPU_DEFAULT). The Python
    # API is opt-in, as vLLM's LLM(...) is.
    speculative_config: SpeculativeConfig | str | dict | None = None
    enable_kv_cache_events: bool = False  # record blocks entering / leaving the prefix cache (kv/events.py)

    def __post_init__(self) -> None:
        def check(ok: bool, flag: str, message: str) -> None:
            if not ok:
                raise UserError(f"{flag}: {message}")

        check(self.block_size >= 1, "--block-size", f"must be at least 1, got {self.block_size}")
        check(self.max_num_seqs >= 1, "--max-num-seqs", f"must be at least 1, got {self.max_num_seqs}")
        check(self.max_num_batched_tokens >= 1, "--max-num-batched-tokens",
              f"must be at least 1, got {self.max_num_batched_tokens}")
        check(self.max_model_len is None or self.max_model_len >= 1, "--max-model-len",
              f"must be at least 1, got {self.max_model_len}")
        check(self.kv_allocation in ("paged", "contiguous"), "--kv-allocation",
              f"must be paged or contiguous, got {self.kv_allocation!r}")
        check(self.kv_cache_memory is None or self.kv_cache_memory > 0, "--kv-cache-memory",
              f"must be positive, got {self.kv_cache_memory}")
        check(self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization <= 1,
              "--gpu-memory-utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}")
        check(self.dtype in ("auto", "float32", "bfloat16"), "--dtype",
              f"must be auto, float32 or bfloat16, got {self.dtype!r}")
        check(self.quantization in (None, "auto", "none", "gguf", "int8", "int4"), "--quantization",
              f"must be auto, none, gguf, int8 or int4, got {self.quantization!r}")
        check(self.kv_cache_dtype in ("auto", "float32", "bfloat16"), "--kv-cache-dtype",
              f"must be auto, float32 or bfloat16, got {self.kv_cache_dtype!r}")
        on_cpu = self.device == "cpu" or (self.device == "auto" and not torch.cuda.is_available())
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config, on_cpu)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if isinstance(values.get("kv_cache_memory"), str):
            try:
                values["kv_cache_memory"] = parse_memory_size(values["kv_cache_memory"])
            except ValueError as e:
                raise UserError(f"--kv-cache-memory: {e}") from None
        return cls(**values)


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = True) -> None:
    """The engine flags, vLLM's names; `model` is positional (serve MODEL) or --model."""
    if model_positional:
        parser.add_argument("model", nargs="?", default=None,
                            help="HF model folder or GGUF file (default: SmolLM2-135M-Instruct Q4_1 GGUF)")
    else:
        parser.add_argument("--model", default=None, help="HF model folder or GGUF file (default: SmolLM2-135M)")
    g = parser.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 (bfloat16 is the fast path on AMX CPUs)")
    g.add_argument("--quantization", "-q", default=None, choices=["auto", "none", "gguf", "int8", "int4"],
                   help="weights in memory: auto (the default) keeps a GGUF's Q4_0/Q4_1/Q8_0 tensors as stored unless "
                        "this CPU's quantized kernel is measured slower than dense; gguf always keeps them; int8/int4 "
                        "round a checkpoint's weights at load (weight-only, groups of 32); none dequantizes to --dtype "
                        "(what auto means for a Hugging Face folder)")
    g.add_argument("--kv-cache-dtype", default="auto",
                   help="auto (the model's dtype) | float32 | bfloat16: a bfloat16 cache holds twice the tokens of a "
                        "float32 one and halves the memory each decode step reads; attention still computes in "
                        "the model's dtype")
    g.add_argument("--device", default="auto", help="torch device: auto, cpu, cuda, cuda:1, ...")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="token budget of one step; longer prompts are prefilled in chunks")
    g.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (default: the model's)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share the KV blocks of common prompt prefixes")
    g.add_argument("--kv-allocation", choices=["paged", "contiguous"], default="paged",
                   help="paged blocks on demand, or reserve max-model-len per request (the baseline)")
    g.add_argument("--kv-cache-memory", default=None, help="KV cache size in bytes, e.g. 2GiB")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="share of device memory (on CPU: of RAM) for weights, activations and KV cache; "
                        f"default on CPU: a {DEFAULT_CPU_KV_CACHE_MEMORY // 2**30} GiB KV cache, on GPU: 0.9")
    g.add_argument("--seed", type=int, default=0, help="seed for unseeded random sampling")
    g.add_argument("--speculative-config", default="auto", metavar="JSON",
                   help='speculative decoding by prompt lookup, e.g. \'{"method": "ngram", "num_speculative_tokens": '
                        '4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\'; "disable_by_batch_size": N turns it '
                        'off while N or more requests run or wait; none: off; auto (default): that example on a '
                        'CPU, where it was measured to pay, off elsewhere')
