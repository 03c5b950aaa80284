"""A user cache folder for things that are slow to rebuild from a checkpoint (the GGUF tokenizer takes ~10 s).

Entries are keyed by the source file's absolute path, size and mtime, so a replaced file is never served stale.
"""

from __future__ import annotations

import hashlib
import os


def cache_root() -> str:
    """$PAGEDLLM_CACHE, else ~/.cache/pagedllm."""
    return os.environ.get("PAGEDLLM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pagedllm")


def cache_dir_for(path: str, kind: str) -> str:
    """The cache folder of `kind` for the file at `path` (not created)."""
    ap = os.path.abspath(path)
    st = os.stat(ap)
    key = hashlib.sha1(f"{ap}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(ap))[0]
    return os.path.join(cache_root(), kind, f"{stem}-{key}")
