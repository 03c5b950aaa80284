"""Wiring the disk tier (kv/offload.py) to an engine: the fingerprint that guards reuse, and the tier itself.

K/V are a function of the weights, the dtypes, the block size and the layer shape: blocks written by an engine
that differs in any of them must never be served, so all of them go into the fingerprint the tier checks.
"""

from __future__ import annotations

import hashlib
import os

import torch

from pagedllm.kv.offload import DiskKVTier
from pagedllm.model.cache import cache_dir_for
from pagedllm.model.loader import LoadedModel
from pagedllm.model.runner import ModelRunner

FORMAT = b"pagedllm-kv-block-v2"  # bump when the bytes of a block change meaning (v2: quantized rows rotated)
_WEIGHT_FILES = (".gguf", ".safetensors", ".bin", ".json", ".model", ".pt")


def _file_digest(path: str) -> bytes:
    """SHA-256 of a file's contents, memoized in the user cache by path, size and mtime (a weights file is
    hashed once, not at every start)."""
    memo = os.path.join(cache_dir_for(path, "digest"), "sha256")
    try:
        with open(memo, "rb") as f:
            digest = f.read()
        if len(digest) == 32:
            return digest
    except OSError:
        pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    digest = h.digest()
    try:
        os.makedirs(os.path.dirname(memo), exist_ok=True)
        with open(memo, "wb") as f:
            f.write(digest)
    except OSError:
        pass
    return digest


def _weights_digest(loaded: LoadedModel) -> bytes:
    """The checkpoint's files (a GGUF file, or a folder's weights, config and tokenizer); a model built in memory
    is read from its parameters."""
    h = hashlib.sha256()
    path = loaded.path
    files = (
        [os.path.join(path, n) for n in sorted(os.listdir(path)) if n.endswith(_WEIGHT_FILES)]
        if path and os.path.isdir(path)
        else [path]
        if path and os.path.isfile(path)
        else []
    )
    for file in files:
        h.update(os.path.basename(file).encode() + _file_digest(file))
    if not files:
        for name, p in loaded.model.named_parameters():
            h.update(name.encode() + p.detach().float().cpu().numpy().tobytes())
    return h.digest()


def engine_fingerprint(loaded: LoadedModel, kv_dtype: torch.dtype, block_size: int) -> bytes:
    cfg = loaded.config
    h = hashlib.sha256(FORMAT)
    h.update(_weights_digest(loaded))
    settings = (
        loaded.quantization,
        str(loaded.dtype),
        str(kv_dtype),
        block_size,
        cfg.num_layers,
        cfg.num_kv_heads,
        cfg.head_dim,
    )
    h.update(repr(settings).encode())
    return h.digest()


def open_disk_tier(directory: str, size: int, runner: ModelRunner, block_size: int) -> DiskKVTier:
    fingerprint = engine_fingerprint(runner.loaded, runner.kv_dtype, block_size)
    return DiskKVTier(directory, size, fingerprint, runner.bytes_per_block)
