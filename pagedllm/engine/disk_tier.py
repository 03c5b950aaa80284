"""Wiring the disk tier (kv/offload.py) to an engine: the fingerprint that guards reuse, and the tier itself (its
blocks, and a hybrid model's recurrent-state checkpoints: the runner's state rows).

K/V are a function of the weights, the dtypes, the block size and the layer shape: blocks written by an engine
that differs in any of them must never be served, so all of them go into the fingerprint the tier checks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re

import torch

from pagedllm.kv.offload import DiskKVTier, open_folder, read_regular_file, write_new_file
from pagedllm.model.formats.cache import cache_dir_for
from pagedllm.model.loader import LoadedModel
from pagedllm.model.runner import ModelRunner

FORMAT = b"pagedllm-kv-block-v2"  # bump when the bytes of a block change meaning (v2: quantized rows rotated)
_WEIGHT_FILES = (".gguf", ".safetensors", ".bin", ".json", ".model", ".pt")
MEMO_NAME = "sha256"  # its JSON replaced the bare 32 bytes, which no check could tell from a wrong digest
MEMO_LIMIT = 4096  # a memo is ~150 bytes; anything longer is not one and is not read further

logger = logging.getLogger("pagedllm")


def _file_digest(path: str) -> bytes:
    """SHA-256 of a file's contents, memoized in the user cache by path, size and mtime (a weights file is
    hashed once, not at every start). The memo is only a shortcut, so a memo that is not exactly what this writes
    (for this file's size and mtime) is re-hashed with one log line, whatever its bytes."""
    st = os.stat(path)
    memo_dir = cache_dir_for(path, "digest")
    digest = _read_memo(memo_dir, st)
    if digest is not None:
        return digest
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    digest = h.digest()
    memo = {"sha256": digest.hex(), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    try:
        os.makedirs(os.path.dirname(memo_dir), exist_ok=True)
        fd = open_folder(memo_dir)
    except OSError as e:
        logger.debug("checkpoint hash of %s not memoized: %s", path, e)
        return digest
    try:
        error = write_new_file(fd, MEMO_NAME, (json.dumps(memo).encode(),))
        if error is not None:
            logger.debug("checkpoint hash of %s not memoized: %s", path, error)
    finally:
        os.close(fd)
    return digest


def _read_memo(memo_dir: str, st: os.stat_result) -> bytes | None:
    """The memoized digest if the memo is a regular file (no link followed) holding a JSON object with exactly
    the fields written, of the right types, for this size and mtime; else None (logged unless simply absent)."""
    try:
        fd = os.open(memo_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        logger.warning("checkpoint hash memo %s unusable (%s): hashing the file again", memo_dir, e)
        return None
    try:
        raw = read_regular_file(fd, MEMO_NAME, MEMO_LIMIT + 1)
        problem = _memo_problem(raw, st)
    except FileNotFoundError:
        return None
    except OSError as e:
        problem = str(e)
    finally:
        os.close(fd)
    if problem is not None:
        logger.warning("checkpoint hash memo %s %s: hashing the file again", os.path.join(memo_dir, MEMO_NAME), problem)
        return None
    return bytes.fromhex(json.loads(raw)["sha256"])


def _memo_problem(raw: bytes, st: os.stat_result) -> str | None:
    """What makes `raw` not a memo of the file `st` describes, or None. Anyone who can write the user cache can
    put any bytes there (an older pagedllm wrote bare bytes), so nothing about them is assumed: length first,
    then JSON that cannot overflow or recurse past its 4 KiB, then each field's type and value."""
    if len(raw) > MEMO_LIMIT:
        return "is too long"
    try:
        memo = json.loads(raw)
    except (ValueError, RecursionError):
        return "is not JSON"
    if not isinstance(memo, dict) or set(memo) != {"sha256", "size", "mtime_ns"}:
        return "has not the fields sha256, size, mtime_ns"
    digest, size, mtime = memo["sha256"], memo["size"], memo["mtime_ns"]
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
        return "holds no SHA-256 in hex"
    if type(size) is not int or type(mtime) is not int or (size, mtime) != (st.st_size, st.st_mtime_ns):
        return "is for another size or mtime of the file"
    return None


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


def kernel_facts(loaded: LoadedModel) -> tuple[bool, int, int]:
    """What of the kernels changes the K/V a step writes: the dot route (inputs rounded to 16 bits) and the row
    counts from which bfloat16 steps run on q-bf16 and steps on the int8 route (the kernel choice), so KV written
    under other kernels is never served (the disk tier's fingerprint, kv_blend's segment root)."""
    weights = loaded.model.quant_weights() if hasattr(loaded.model, "quant_weights") else []
    amx = loaded.kernel_choice.amx_min_rows if loaded.kernel_choice is not None else 0
    return any(w.dot for w in weights), amx, max((w.i8_min_rows for w in weights), default=0)


def engine_fingerprint(loaded: LoadedModel, kv_dtype: torch.dtype, block_size: int) -> bytes:
    cfg = loaded.config
    h = hashlib.sha256(FORMAT)
    h.update(_weights_digest(loaded))
    settings = (
        *kernel_facts(loaded),
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
