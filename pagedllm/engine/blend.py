"""kv_blend: a retrieved passage's KV reused wherever the passage lands in a prompt, with selective recompute.

The prefix cache serves a prompt only up to its first token that differs from an earlier one, so a RAG prompt
whose passages come in another order (or with a new one in front) is prefilled again from the first passage on.
A caller may mark token spans of the prompt as *segments* (`kv_segments`: the retrieved passages). Each segment's
full blocks are stored in the same block pool as prefix blocks, at canonical positions 0..L-1 and keyed by a
chain of block hashes rooted at `segment_root` (the model, dtypes, block size and cache salt; never the tokens
before it), so they are ref-counted, LRU-evicted and offloaded to the disk tier like prefix blocks.

A request with segments, once admitted:
1. takes the longest exact prefix from the prefix cache, as any request (the system prompt);
2. for each segment past that prefix whose stored blocks are found (`plan`), its stored blocks are *copied* into
   the request's own slots with the keys re-rotated by the landing position (`ModelRunner.copy_kv`), except the
   recomputed tokens: ceil(r * L) per segment, all spent on the passage tokens nearest the question (the last
   passage's tail, then the one before it); the tail that does not fill a block and everything after the last
   segment (the question) are always computed;
3. a segment not stored yet is computed normally and then stored (`store_segments`, keys rotated back to 0).
The prompt is thus a sequence of compute and copy spans processed in order: a compute span is an ordinary
(chunked) prefill chunk that attends to every position before it, copied or computed, so chunked prefill, the
fused C step and speculation (which only starts once the prompt is done) run unchanged. Preemption frees the
request's blocks and holds; re-admission plans again.

Why the tokens nearest the question: measured outside the engine (benchmarks/kv/blend_variants.py, the same 8
questions x 16 positions, r = 0.15, passages stored in another order), they give 95.3% top-1 and KL 0.029,
against 92.2% / 0.033 for EPIC's first tokens of each passage, 93.8% / 0.032 for CacheBlend's (layers 0-1 over
every token, then the tokens whose layer-1 keys deviate most) and 91.4% / 0.035 for no recompute; the last tokens
of each passage did no better than none. In the engine (`rag bench`, 24 x 32 positions) it ties the first
tokens on top-1 (95.6% against 95.7%) with a lower KL (0.0145 against 0.0152). The question attends mostly
to what is just before it, and those tokens, recomputed, attend to everything before them; one contiguous span
needs no extra pass (CacheBlend's needs the first layers over every token, then tokens at scattered
positions). The loss being repaired is the passages having attended to other passages when stored: a float32
cache loses as much as bfloat16, and a passage stored behind a one-word-different context costs about a
thirtieth of one stored in another order.

Copied K/V are an approximation (the passage attended to another context when it was stored), so the blocks of
a blend request from its first copied token on are never registered in the prefix cache (`kv_cache_limit`):
a plain request never reads them. With r = 1.0 nothing is looked up or copied: the request is an ordinary one,
bit for bit.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from pagedllm.kv.block_pool import KVBlock
from pagedllm.kv.hashing import BlockHash, hash_segment_blocks
from pagedllm.kv.manager import KVCacheBlocks, KVCacheManager, PagedKVCacheManager
from pagedllm.sampling_params import SamplingParamsError

if TYPE_CHECKING:
    from pagedllm.model.runner import ModelRunner

logger = logging.getLogger("pagedllm")


class Request(Protocol):
    """What blending reads and sets of a request (the engine's Request; not imported: it holds a BlendState)."""

    request_id: str
    cache_salt: str | None
    lora_int_id: int
    prompt_token_ids: list[int]
    all_token_ids: list[int]
    num_computed_tokens: int
    blend: BlendState | None
    kv_cache_limit: int | None

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def reads_prefix_cache(self) -> bool: ...


@dataclass
class CopySpan:
    """Prompt positions [start, end) whose K/V come from a stored segment whose position 0 is at `origin`."""

    start: int
    end: int
    origin: int
    blocks: list[KVBlock]  # the segment's stored blocks from its block `first_block` on, held until copied
    first_block: int


@dataclass
class BlendState:
    """A request's segments, its recompute ratio, and the copies still due."""

    segments: list[tuple[int, int]]  # prompt token spans [start, end), ascending, not overlapping
    recompute: float  # share of the reused segments' tokens computed again, the ones nearest the question
    root: BlockHash  # segment_root of the request's model settings and cache salt
    copies: list[CopySpan] = field(default_factory=list)
    pending_copy: int = 0  # leading tokens of this step's scheduled ones that are copies, not computed
    stored: set[int] = field(default_factory=set)  # segments stored (or found stored) already
    copied_tokens: int = 0  # prompt tokens copied, over the request's life

    def hashes(self, req: Request, i: int, block_size: int) -> list[BlockHash]:
        start, end = self.segments[i]
        return hash_segment_blocks(req.prompt_token_ids[start:end], block_size, self.root)  # the root has the salt


def _blending(req: Request, kv: KVCacheManager) -> BlendState | None:
    blend = req.blend
    usable = isinstance(kv, PagedKVCacheManager) and kv.segments is not None  # one full group, caching on
    return blend if blend is not None and usable and req.reads_prefix_cache else None


def plan(req: Request, kv: KVCacheManager, hits: KVCacheBlocks, num_cached: int) -> None:
    """At admission, after the prefix-cache lookup found `hits` (`num_cached` tokens): which spans to copy, with
    their stored blocks held. The last prompt token is always computed (its logits give the first output token).
    The hits are pinned meanwhile: a segment read from the disk tier takes a free block, and the free hits are
    not the request's until it is admitted."""
    req.kv_cache_limit = None
    blend = _blending(req, kv)
    if blend is None:
        return
    blend.copies, blend.pending_copy = [], 0  # a re-admission plans again: its earlier holds went with its blocks
    if blend.recompute >= 1.0:
        return
    assert isinstance(kv, PagedKVCacheManager)
    kv.pin(list(hits))
    try:
        _plan_copies(req, blend, kv, num_cached)
    finally:
        kv.unpin(list(hits))


def without_copies(req: Request) -> bool:
    """A request that does not fit its pool beside its plan's holds (the stored passages' blocks it holds count
    against the pool until copied) is planned from now on as an ordinary prefill (recompute 1.0: exact, nothing
    held); False where it was one already, so the caller fails it. Called after its blocks and holds were freed."""
    blend = req.blend
    if blend is None or blend.recompute >= 1.0:
        return False
    blend.recompute, blend.copies, blend.pending_copy = 1.0, [], 0
    req.kv_cache_limit = None
    logger.info("kv_blend: request %s fits only without its passages' holds: computing them", req.request_id)
    return True


def _plan_copies(req: Request, blend: BlendState, kv: PagedKVCacheManager, num_cached: int) -> None:
    bs, last = kv.block_size, req.num_prompt_tokens - 1
    for i, ((start, end), tail) in enumerate(zip(blend.segments, _recomputed_tails(blend, num_cached))):
        lo, stop = max(num_cached, start), min(end - tail, last)
        if lo >= stop:
            continue
        found = kv.hold_segment(req, blend.hashes(req, i, bs))
        hi = min(start + len(found) * bs, stop)
        first = (lo - start) // bs
        if lo >= hi:
            kv.release_segment(req, found)
            continue
        if len(found) * bs >= end - start - (end - start) % bs:
            blend.stored.add(i)  # every full block is stored: nothing to store after computing it
        kv.release_segment(req, found[:first])
        blend.copies.append(CopySpan(lo, hi, start, found[first:], first))
    if blend.copies:
        req.kv_cache_limit = blend.copies[0].start


def _recomputed_tails(blend: BlendState, num_cached: int) -> list[int]:
    """Per segment, how many of its last tokens are recomputed: ceil(r * L) for each segment past the cached
    prefix, spent on the passage tokens nearest the question (the last segment's tail first, then the one
    before it), where the question's attention goes."""
    budget = sum(math.ceil(blend.recompute * (e - s)) for s, e in blend.segments if e > num_cached)
    tails = []
    for start, end in reversed(blend.segments):
        tails.append(min(budget, end - start))
        budget -= tails[-1]
    return tails[::-1]


def step_size(req: Request, budget: int, computed: int | None = None) -> tuple[int, int]:
    """(tokens the request advances this step, of which computed) for a token budget: the copies due at its
    position (free of budget), then computed tokens up to the next copy. Sets the request's pending copy."""
    pos = req.num_computed_tokens if computed is None else computed
    remaining = len(req.all_token_ids) - pos
    blend = req.blend
    if blend is None or not blend.copies:
        if blend is not None:
            blend.pending_copy = 0
        n = min(remaining, budget)
        return n, n
    cursor = pos
    for span in blend.copies:
        if span.start > cursor:
            break
        cursor = max(cursor, span.end)
    later = [s.start for s in blend.copies if s.start > cursor]
    compute = min(len(req.all_token_ids) - cursor, budget, (later[0] if later else len(req.all_token_ids)) - cursor)
    blend.pending_copy = cursor - pos
    return blend.pending_copy + compute, compute


def apply_copies(req: Request, runner: ModelRunner, kv: KVCacheManager) -> None:
    """Copy the spans this step covers into the request's slots (keys moved to where they land), then let go of
    their stored blocks. Before the step's forward: the computed tokens after a copy attend to it."""
    blend = req.blend
    if blend is None or not blend.pending_copy:
        return
    until = req.num_computed_tokens + blend.pending_copy
    assert isinstance(kv, PagedKVCacheManager)
    table, bs = kv.get_block_ids(req.request_id), kv.block_size
    while blend.copies and blend.copies[0].end <= until:
        span = blend.copies[0]  # taken off only once copied: a failed copy fails again when run alone
        src, dst = [], []
        for pos in range(span.start, span.end):
            off = pos - span.origin
            src.append(span.blocks[off // bs - span.first_block].block_id * bs + off % bs)
            dst.append(table[pos // bs] * bs + pos % bs)
        runner.copy_kv(src, dst, span.origin)
        blend.copies.pop(0)
        kv.release_segment(req, span.blocks)
        span.blocks = []
        blend.copied_tokens += span.end - span.start


def store_segments(req: Request, runner: ModelRunner, kv: KVCacheManager) -> None:
    """Store the segments whose every token is now in the request's cache and which are not stored yet: their
    full blocks into fresh pool blocks at positions 0..L-1 (keys rotated back by the segment's start). Storing
    is best effort: without free blocks, or if the copy fails, the segment is just not stored."""
    blend = _blending(req, kv)
    if blend is None:
        return
    assert isinstance(kv, PagedKVCacheManager)
    bs = kv.block_size
    for i, (start, end) in enumerate(blend.segments):
        if i in blend.stored or end > req.num_computed_tokens:
            continue
        blend.stored.add(i)
        fresh = kv.new_segment_blocks(blend.hashes(req, i, bs))
        if not fresh:
            continue
        table = kv.get_block_ids(req.request_id)
        src, dst = [], []
        for j, block in fresh:
            for off in range(j * bs, (j + 1) * bs):
                pos = start + off
                src.append(table[pos // bs] * bs + pos % bs)
                dst.append(block.block_id * bs + off % bs)
        written = False
        try:
            runner.copy_kv(src, dst, -start)
            written = True
        except Exception as e:  # noqa: BLE001 - a segment not stored costs a later request its reuse, nothing else
            logger.warning("kv_blend: segment of request %s not stored: %s", req.request_id, e)
        finally:
            kv.end_segment_store([b for _, b in fresh], written)


def check_segments(segments: object, prompt_len: int, recompute: object) -> list[tuple[int, int]]:
    """`kv_segments` as ascending, disjoint [start, end) token spans inside the prompt, and the recompute ratio in
    [0, 1]; SamplingParamsError naming the field otherwise (a server answers 400 before anything is queued)."""
    if recompute is not None and (
        isinstance(recompute, bool) or not isinstance(recompute, (int, float)) or not 0 <= recompute <= 1
    ):
        raise SamplingParamsError("kv_blend_recompute", f"must be a number from 0 to 1, got {recompute!r}")
    if not isinstance(segments, (list, tuple)):
        raise SamplingParamsError("kv_segments", "must be a list of [start, end] token spans")
    spans: list[tuple[int, int]] = []
    for span in segments:
        ok = isinstance(span, (list, tuple)) and len(span) == 2
        if not ok or any(isinstance(x, bool) or not isinstance(x, int) for x in span):
            raise SamplingParamsError("kv_segments", f"each span is [start, end] (two integers), got {span!r}")
        start, end = span
        if not 0 <= start < end <= prompt_len:
            raise SamplingParamsError(
                "kv_segments", f"span [{start}, {end}] is not inside the prompt's {prompt_len} tokens"
            )
        if spans and start < spans[-1][1]:
            raise SamplingParamsError("kv_segments", "spans must be in prompt order and must not overlap")
        spans.append((start, end))
    return spans
