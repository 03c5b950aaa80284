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


def extra_key(cache_salt: str | None, lora_int_id: int = 0) -> object:
    """The extra key of a request's blocks: its cache salt, and its LoRA adapter's id when it has one (an
    adapter changes every layer's K/V; keyed by id, never by name, so two adapters of one name never share). A
    request of the base model keys as before adapters existed (the disk tier's files stay valid)."""
    return cache_salt if not lora_int_id else (cache_salt, "lora", lora_int_id)


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, extra_key: object = None, prefix: Sequence[BlockHash] = ()
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, extending the already known chain `prefix`."""
    hashes = list(prefix)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, token_ids[start : start + block_size], extra_key))
    return hashes


def segment_root(key: object) -> BlockHash:
    """The parent of a reusable segment's first block (kv_blend): a hash of "segment" and `key` alone, never of
    the tokens before the segment, so one stored copy of a passage serves it wherever it lands in a prompt. The
    caller puts into `key` everything the stored K/V depend on besides the segment's own tokens: the model's
    weights, the dtypes, the block size and the cache salt, so a copy made under other settings is never found."""
    return hashlib.sha256(b"pagedllm-kv-segment" + repr(key).encode()).digest()


def hash_segment_blocks(token_ids: Sequence[int], block_size: int, root: BlockHash) -> list[BlockHash]:
    """Chained hashes of the full blocks of a segment's tokens, from `root` (its canonical positions 0..L-1)."""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else root, token_ids[start : start + block_size]))
    return hashes


def group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """The pool's key of a block of KV-cache group `group` (kv_spec.py) holding the prefix `block_hash`: the same
    tokens in two groups are two blocks (other layers' K/V), so each group has its own key. Group 0 keys by the
    prefix hash itself, so a model of one group keys (and publishes, and stores on disk) as it always did."""
    if group == 0:
        return block_hash
    return hashlib.sha256(block_hash + b"pagedllm-kv-group" + group.to_bytes(4, "little")).digest()


def checkpoint_key(block_hash: BlockHash, part: int) -> BlockHash:
    """The pool's key of block `part` of a hybrid model's recurrent-state checkpoint after the prefix `block_hash`
    (kv/state_slots.py): the prefix's own hash names its last KV block of group 0, so each block of the state
    needs a key of its own."""
    return hashlib.sha256(block_hash + b"pagedllm-state" + part.to_bytes(4, "little")).digest()
