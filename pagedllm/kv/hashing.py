"""Chained block hashes: the key under which a full block of KV is shared between requests.

A block's hash covers its parent's hash, so equal hashes mean equal *prefixes*, not just equal blocks: the
same 16 tokens after a different history have different keys and values and must not be shared.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes

# The parent of the first block; a constant so hashes are stable across processes (unlike hash()).
ROOT_HASH: BlockHash = hashlib.sha256(b"pagedllm-kv-root").digest()


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], extra_key: object = None) -> BlockHash:
    """Hash of one full block; `extra_key` (an adapter name, a cache salt) separates otherwise equal prefixes."""
    h = hashlib.sha256(parent if parent is not None else ROOT_HASH)
    h.update(array("q", token_ids).tobytes())
    if extra_key is not None:
        h.update(repr(extra_key).encode())
    return h.digest()


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, extra_key: object = None, prefix: Sequence[BlockHash] = ()
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, extending the already known chain `prefix`."""
    hashes = list(prefix)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, token_ids[start : start + block_size], extra_key))
    return hashes
