"""How much KV cache a model needs, and how many requests a memory budget holds under each allocation: what a
token and a block cost per --kv-cache-dtype and layer group, how many blocks a budget holds, and the CPU's default
budget. The one place these are answered: the engine (at start-up) and `pagedllm kv-calc` ask here."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import ByteSize, TypeAdapter, ValidationError

from pagedllm.errors import UserError
from pagedllm.kv.kv_spec import KVCacheGroup, KVCacheLayout, cdiv, kv_cache_layout, window_blocks

logger = logging.getLogger("pagedllm")

# On a CPU the cache shares RAM with everything else: by default CPU_KV_SHARE of what is free after loading the
# weights, at most DEFAULT_CPU_KV_CACHE_MEMORY (the cache is allocated and zeroed at start-up, so a budget the
# machine cannot hold fails or swaps before the first request).
DEFAULT_CPU_KV_CACHE_MEMORY = 2 * 2**30
CPU_KV_SHARE = 0.5

# a quantized cache's one bfloat16 scale per key (or value) vector of a KV head (model/kernels/kv_quant.py)
KV_SCALE_BYTES = 2


@dataclass(frozen=True)
class KVDType:
    """What a --kv-cache-dtype stores: bytes per value, the scale bytes a quantized cache adds per key (or value)
    vector of a KV head, and the torch dtype its tensors hold (a quantized cache's codes)."""

    value_bytes: int
    scale_bytes: int
    torch_name: str


# The --kv-cache-dtype names (vLLM's; fp8 is e4m3), besides "auto" (the model's --dtype): the one table the
# engine's setting, the CLI's choices, kv-calc, the engine's cache and the benchmarks read (KVCacheDType, the
# setting's type, names the same: tests/test_kv_calc.py holds them equal).
KVCacheDType = Literal["auto", "float32", "bfloat16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"]
KV_DTYPES: dict[str, KVDType] = {
    "float32": KVDType(4, 0, "float32"),
    "bfloat16": KVDType(2, 0, "bfloat16"),
    "int8": KVDType(1, KV_SCALE_BYTES, "int8"),
    "fp8": KVDType(1, KV_SCALE_BYTES, "float8_e4m3fn"),
    "fp8_e4m3": KVDType(1, KV_SCALE_BYTES, "float8_e4m3fn"),
    "fp8_e5m2": KVDType(1, KV_SCALE_BYTES, "float8_e5m2"),
}
# One name per size, the rows kv-calc, the engine's start-up log and `bench sweep`'s dtype rows show.
KV_DTYPE_ROWS: tuple[KVCacheDType, ...] = ("float32", "bfloat16", "int8", "fp8")


_BYTE_SIZE = TypeAdapter(ByteSize)


def parse_memory_size(text: str) -> int:
    """'4GiB', '512MB', '1.5g', '1000000' -> bytes (pydantic's ByteSize, as EngineConfig.kv_cache_memory);
    ValueError on anything else."""
    try:
        size = int(_BYTE_SIZE.validate_python(text))
    except ValidationError:
        raise ValueError(f"cannot read {text!r} as a memory size (examples: 4GiB, 512MiB, 2GB, 1000000)") from None
    if size <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return size


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int, scale_bytes: int = 0
) -> int:
    """A key and a value vector per layer and KV head: 2 x layers x KV heads x (head dim x dtype bytes + the
    scale a quantized cache keeps per vector)."""
    return 2 * num_layers * num_kv_heads * (head_dim * dtype_bytes + scale_bytes)


def kv_dtype_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str) -> int:
    """kv_bytes_per_token for a --kv-cache-dtype name (float32, bfloat16, int8, fp8, ...; not "auto")."""
    d = KV_DTYPES[kv_dtype]
    return kv_bytes_per_token(num_layers, num_kv_heads, head_dim, d.value_bytes, d.scale_bytes)


def kv_cache_groups(windows: Sequence[int | None]) -> list[KVCacheGroup]:
    """Layer i's window is windows[i] (None: full); one group per kind, full attention first, then by window
    (the lines kv-calc prints; the pool's groups split a kind into groups of equal size: kv_spec.py)."""
    return kv_cache_layout(windows).kinds()


def freeing_window(groups: Sequence[KVCacheGroup]) -> int | None:
    """The window of a model whose every layer slides by the same one (its one group frees by it), else None."""
    return groups[0].window if len(groups) == 1 else None


def layout_blocks(layout: KVCacheLayout, num_tokens: int, block_size: int) -> list[int]:
    """Per group of `layout`, the blocks a request of `num_tokens` tokens holds once each sliding group gave back
    what fell out of its window (the sliding manager's rule)."""
    return [window_blocks(num_tokens, g.window, block_size) for g in layout.groups]


def recurrent_state_bytes(conv_dim: int, kernel: int, heads: int, key_dim: int, value_dim: int, conv_bytes: int) -> int:
    """One linear-attention layer's state for one request: the causal conv's last kernel-1 inputs of each
    channel, and the float32 recurrent matrix [heads, key_dim, value_dim] (layers/deltanet.py)."""
    return conv_dim * (kernel - 1) * conv_bytes + heads * key_dim * value_dim * 4


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str, block_size: int) -> int:
    """What one block of `block_size` tokens costs in a cache of that --kv-cache-dtype name."""
    return kv_dtype_bytes_per_token(num_layers, num_kv_heads, head_dim, kv_dtype) * block_size


def num_blocks_in_budget(budget_bytes: int, bytes_per_block: int) -> int:
    return budget_bytes // bytes_per_block


def cpu_kv_budget(available: int, states: int = 0) -> tuple[int, str]:
    """The default KV budget on a CPU for `available` free bytes after the weights, and the reason in words.
    `states`: the recurrent-state slots of a hybrid model's --max-num-seqs requests, which come on top of the cap
    (still within the share): the cap sizes the blocks, and a state of MiBs per request, whatever its length,
    would otherwise take the blocks' room (2 GiB held 63 of Nemotron-H-8B@8's 64 at W1, and the 64th ran alone
    after the rest)."""
    share = int(CPU_KV_SHARE * available)
    budget = min(DEFAULT_CPU_KV_CACHE_MEMORY + states, share)
    capped = f"{DEFAULT_CPU_KV_CACHE_MEMORY / 2**30:g} GiB" + (
        f" + {states / 2**30:.2f} GiB for the recurrent states of --max-num-seqs requests" if states else ""
    )
    why = (
        f"{CPU_KV_SHARE:g} x {available / 2**30:.2f} GiB free after loading the weights"
        + (f", capped at {capped}" if share > budget else "")
        + "; --kv-cache-memory sets it"
    )
    return budget, why


def blocks_for_budget(budget: int, per_block: int, block_size: int, max_model_len: int, allocation: str) -> int:
    """Blocks a budget of `budget` bytes holds; a budget that cannot serve is a UserError naming the flag to
    change (a contiguous cache must hold one whole max_model_len request), one too small for a max_model_len
    request a warning."""
    num_blocks = num_blocks_in_budget(budget, per_block)
    if allocation == "contiguous" and num_blocks < cdiv(max_model_len, block_size):
        raise UserError(
            f"--kv-cache-memory: contiguous allocation reserves {max_model_len} tokens per "
            f"request ({cdiv(max_model_len, block_size) * per_block:,} bytes) but the "
            f"budget holds only {num_blocks} blocks; lower --max-model-len or raise the budget"
        )
    if num_blocks < 1:
        raise UserError(f"--kv-cache-memory: {budget:,} bytes hold no KV block of {per_block:,} bytes")
    if num_blocks * block_size < max_model_len:
        logger.warning(
            "the KV cache holds %d tokens, less than --max-model-len %d: longer requests will fail",
            num_blocks * block_size,
            max_model_len,
        )
    return num_blocks


def slots_needed(num_tokens: int, block_size: int, allocation: str, max_model_len: int) -> int:
    """Token slots one request takes: its tokens rounded up to blocks, or max_model_len rounded up."""
    held = max_model_len if allocation == "contiguous" else num_tokens
    return cdiv(held, block_size) * block_size


def requests_that_fit(
    lengths: Sequence[int], num_blocks: int, block_size: int, allocation: str, max_model_len: int
) -> int:
    """How many of the requests, admitted in order, are in the cache at once before it is full."""
    free = num_blocks
    for n, length in enumerate(lengths):
        need = slots_needed(length, block_size, allocation, max_model_len) // block_size
        if need > free:
            return n
        free -= need
    return len(lengths)


@dataclass
class RequestSlots:
    tokens: int
    blocks: int
    slots: int

    @property
    def empty(self) -> int:
        return self.slots - self.tokens


def paged_slots(lengths: Sequence[int], block_size: int) -> list[RequestSlots]:
    """Per request, blocks taken and slots left empty in the last block."""
    return [RequestSlots(n, cdiv(n, block_size), cdiv(n, block_size) * block_size) for n in lengths]
