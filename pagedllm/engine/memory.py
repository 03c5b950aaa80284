"""Measuring what the KV cache can have at start-up, and asking kv/sizing how many blocks that is: which budget
applies (`--kv-cache-memory`, the CPU default from the memory free after the weights, or a share of the device's
memory after a warm-up step of the largest batch). What a block costs, the CPU default's rule and the blocks a
budget holds are kv/sizing's; this module only measures the device. Before loading, a CPU checkpoint larger than
the free memory is refused with both sizes (`check_weights_fit`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from pagedllm.engine.config import EngineConfig
from pagedllm.errors import UserError
from pagedllm.kv.kv_spec import KVCacheLayout
from pagedllm.kv.manager import cdiv
from pagedllm.kv.sizing import KV_DTYPE_ROWS, KV_DTYPES, blocks_for_budget, cpu_kv_budget, kv_dtype_bytes_per_token
from pagedllm.model.config import ModelConfig, resolve_model_path
from pagedllm.model.kernels.kv_quant import kv_cache_dtype
from pagedllm.model.loader import LoadedModel
from pagedllm.model.runner import ModelRunner, SeqChunk, bytes_per_block

logger = logging.getLogger("pagedllm")

CGROUP = "/sys/fs/cgroup"


def available_memory(cgroup: str = CGROUP) -> int:
    """Bytes the process can still take: MemAvailable, or less where its cgroup (v2, e.g. a container's
    `--memory`) sets a lower limit than the machine has."""
    import psutil

    free = int(psutil.virtual_memory().available)
    try:
        with open(os.path.join(cgroup, "memory.max"), encoding="ascii") as f:
            limit = f.read().strip()
        with open(os.path.join(cgroup, "memory.current"), encoding="ascii") as f:
            used = int(f.read().strip())
        if limit != "max":
            free = min(free, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(0, free)


def weights_file_bytes(path: str) -> int:
    """The bytes of a checkpoint's weight files: the GGUF file, or a folder's *.safetensors. The least its weights
    hold in memory once loaded (each kept as stored: a GGUF's experts are never expanded)."""
    if os.path.isdir(path):
        return sum(e.stat().st_size for e in os.scandir(path) if e.name.endswith(".safetensors") and e.is_file())
    return os.path.getsize(path)


def check_weights_fit(model: str | None, available: Callable[[], int] | None = None) -> None:
    """Before anything is loaded or allocated: a checkpoint whose weight files alone are larger than the memory
    the process can take is a UserError naming both sizes. Why: the loader would copy the weights in for
    minutes and then end in the OOM killer or in swap, with no word on why. `available`: the free memory now
    (`available_memory` unless given)."""
    path = resolve_model_path(model)
    need, free = weights_file_bytes(path), (available or available_memory)()
    if need > free:
        raise UserError(
            f"--model {path}: its weights take {need / 2**30:.2f} GiB as stored, more than the "
            f"{free / 2**30:.2f} GiB of memory this process can take now (MemAvailable, or its cgroup's limit), "
            "and the KV cache needs more beyond them; free memory or pick a smaller file (fewer bits per weight)"
        )


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise UserError(f"--device: {e}") from None


def kv_layout(cfg: ModelConfig, config: EngineConfig) -> KVCacheLayout:
    """The engine's KV-cache groups: a table per group under paged allocation, unless
    --disable-hybrid-kv-cache-manager (or contiguous allocation, which reserves everything anyway) asks for one."""
    return cfg.kv_layout(hybrid=config.kv_allocation == "paged" and not config.disable_hybrid_kv_cache_manager)


def num_kv_blocks(
    config: EngineConfig,
    loaded: LoadedModel,
    max_model_len: int,
    kv_dtype: str,
    available: Callable[[], int] | None = None,
    layout: KVCacheLayout | None = None,
) -> int:
    """Blocks of `config.block_size` tokens the budget holds (a block spans the layout's layers per block); a
    budget that cannot serve is a UserError naming the flag to change."""
    return kv_blocks_and_state_slots(config, loaded, max_model_len, kv_dtype, available, layout)[0]


def kv_blocks_and_state_slots(
    config: EngineConfig,
    loaded: LoadedModel,
    max_model_len: int,
    kv_dtype: str,
    available: Callable[[], int] | None = None,
    layout: KVCacheLayout | None = None,
) -> tuple[int, int, int]:
    """The blocks the budget holds and, for a hybrid model, its recurrent-state slots and staging rows (0, 0
    otherwise; kv/state_slots.py): a slot per request of --max-num-seqs, at most half the budget's worth (a real
    model's state is MiBs per request: the rest of the budget must still hold blocks); with prefix caching under
    --mamba-cache-mode all, a staging row per block boundary a step's prompt tokens can cross, at most a quarter of
    what the slots leave (the states at a step's marks wait there until it commits). The checkpoints themselves
    take blocks of the pool, evicted with the KV blocks. The rows' bytes come off the budget before the blocks are
    counted."""
    per_block = bytes_per_block(loaded.config, config.block_size, kv_dtype, layout)
    budget = kv_budget(config, loaded, max_model_len, kv_dtype, available)
    state = state_bytes(loaded.config, loaded.dtype)
    mode = config.mamba_cache_mode if config.enable_prefix_caching else "none"
    slots = min(config.max_num_seqs, budget // 2 // state) if state else 0
    if state and slots < 1:
        raise UserError(
            f"--kv-cache-memory: {budget:,} bytes do not hold the recurrent state of one request ({state:,} "
            "bytes, with as much again for KV blocks); raise the budget"
        )
    rows = 0
    if state and mode == "all":
        marks = config.max_num_batched_tokens // config.block_size + config.max_num_seqs
        rows = min(marks, (budget - slots * state) // 4 // state)
        if rows < 1:
            raise UserError(
                f"--mamba-cache-mode all: {budget - slots * state:,} bytes of KV budget leave no room for a state "
                f"staging row ({state:,} bytes) beside the blocks; raise --kv-cache-memory or use align"
            )
    if slots:
        logger.info(
            "KV budget: %.2f MiB for %d recurrent-state slots (linear-attention layers; at most that many requests "
            "run at once) and %d staging rows (--mamba-cache-mode %s), the rest for blocks (checkpoints too)",
            (slots + rows) * state / 2**20,
            slots,
            rows,
            mode,
        )
    blocks = blocks_for_budget(
        budget - (slots + rows) * state, per_block, config.block_size, max_model_len, config.kv_allocation
    )
    return blocks, slots, rows


def state_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """One request's recurrent-state slot of a hybrid model (0 without linear-attention layers): the conv states
    in the model's dtype, the recurrent ones in float32 (layers/deltanet.py)."""
    return cfg.state_bytes_per_request(torch.empty((), dtype=dtype).element_size())


def kv_budget(
    config: EngineConfig,
    loaded: LoadedModel,
    max_model_len: int,
    kv_dtype: str,
    available: Callable[[], int] | None = None,
) -> int:
    """Bytes for the KV cache; the start-up log says how many and why. `available`: the free memory now (after
    the weights), for the CPU default (`available_memory` unless given)."""
    if config.kv_cache_memory is not None:
        logger.info("KV budget %.2f GiB: --kv-cache-memory", config.kv_cache_memory / 2**30)
        return config.kv_cache_memory
    device = loaded.device
    if config.gpu_memory_utilization is None and device.type == "cpu":
        states = config.max_num_seqs * state_bytes(loaded.config, loaded.dtype)
        budget, why = cpu_kv_budget((available or available_memory)(), states)
        logger.info("KV budget %.2f GiB: %s", budget / 2**30, why)
        return budget
    share = config.gpu_memory_utilization or 0.9
    total, used = profile_memory(loaded, min(config.max_num_batched_tokens, max_model_len), config.block_size, kv_dtype)
    budget = int(share * total) - used
    logger.info(
        "memory: %.2f GiB x %.2f, minus %.2f GiB for weights and activations -> KV budget %.2f GiB",
        total / 2**30,
        share,
        used / 2**30,
        budget / 2**30,
    )
    if budget <= 0:
        raise UserError(
            f"--gpu-memory-utilization: {share} of {total / 2**30:.1f} GiB leaves nothing for the KV "
            f"cache after {used / 2**30:.2f} GiB of weights and activations"
        )
    return budget


def profile_memory(loaded: LoadedModel, num_tokens: int, block_size: int, kv_dtype: str) -> tuple[int, int]:
    """(device memory, bytes in use after a warm-up step of `num_tokens` tokens with a scratch cache)."""
    device = loaded.device
    scratch = ModelRunner(loaded, cdiv(num_tokens, block_size), block_size, kv_cache_dtype(kv_dtype, loaded.dtype)[1])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    scratch.execute([SeqChunk([0] * num_tokens, 0, list(range(cdiv(num_tokens, block_size))))])
    del scratch
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1], torch.cuda.max_memory_allocated(device)
    import psutil

    return psutil.virtual_memory().total, psutil.Process().memory_info().rss


def log_kv_cache(cfg: ModelConfig, config: EngineConfig, num_blocks: int, kv_dtype: str, layout: KVCacheLayout) -> None:
    """The start-up lines on the cache: its size, and what a token costs in each --kv-cache-dtype."""
    per_block = bytes_per_block(cfg, config.block_size, kv_dtype, layout)
    logger.info(
        "KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB %s, %d bytes/token, %s allocation, prefix caching %s)",
        num_blocks,
        config.block_size,
        num_blocks * config.block_size,
        num_blocks * per_block / 2**30,
        KV_DTYPES[kv_dtype].torch_name,
        per_block // config.block_size,
        config.kv_allocation,
        "on" if config.enable_prefix_caching else "off",
    )
    layers = layout.num_kv_layers
    logger.info(
        "KV bytes/token by --kv-cache-dtype: %s",
        ", ".join(f"{name} {kv_dtype_bytes_per_token(layers, *cfg.kv_slot_shape, name):,}" for name in KV_DTYPE_ROWS),
    )
    if len(layout.groups) > 1 or layout.groups[0].window is not None:
        logger.info(
            "KV-cache groups: %d of %d layers per block, each its own block table: %s",
            len(layout.groups),
            layout.layers_per_block,
            ", ".join(f"{g.name} ({len(g.layers)} layers)" for g in layout.kinds()),
        )
