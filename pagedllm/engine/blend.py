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
The prompt is thus a sequence of compute and copy spans: a step takes the copies and every compute span up to
its token budget (`step_size`), each span an ordinary prefill chunk of the same forward that attends to every
position before it, copied or computed (every path writes the step's K/V before attending), so a prompt of many
passages is one step as under the prefix cache alone, and chunked prefill, the fused C step and speculation
(which only starts once the prompt is done) run unchanged.

The bound mode (`max_deviation`) chooses the recomputed tokens per prompt instead: every stored block is copied,
then `_probe` runs layer 0 over the rest of the prompt and computes layer 1's K/V (CacheBlend's check layer: layer
0's depend on the token alone) for every copied token; the ones whose deviation from their copy weighs most are
computed again, in that same step, until the deviation left is under the bound. ESTIMATE "kv" (the default) is
CacheBlend's relative K/V error of the copied tokens; "attention" weighs a deviation by what the question reads
(the first-order change of its attention output at layer 1, relative). benchmarks/serving/blend_quality.py
measures both (docs/benchmarks.md): at 0.01, "kv" computed 20% of the prompt for the KL of a fixed 0.3 on 32
positions a corpus; on 128 it kept KL under 0.02 on two corpora of three and top-1 at 97% on none, half its
misses near ties. TAIL (default 0) recomputes a share of the copied tokens nearest the question before the
bound is spent: at 0.05 it gained a position on two corpora for 10% more tokens, too little evidence to make it
the default.
Preemption frees the request's blocks and holds; re-admission plans again.

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
a blend request from its first copied token on are never registered in the prefix cache (`SegmentStore.limit`):
a plain request never reads them. With r = 1.0 nothing is looked up or copied: the request is an ordinary one,
bit for bit.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

import pagedllm.model.kernels.kv_quant as kv_quant
from pagedllm.kv.block_pool import KVBlock
from pagedllm.kv.hashing import BlockHash, hash_segment_blocks
from pagedllm.kv.manager import KVCacheBlocks, KVCacheManager, PagedKVCacheManager
from pagedllm.kv.segments import SegmentStore
from pagedllm.model.layers.attention import build_metadata
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
    max_deviation: float | None = None  # the bound mode: tokens recomputed until the measured deviation is under
    copies: list[CopySpan] = field(default_factory=list)
    pending_copy: int = 0  # tokens of this step's scheduled ones that are not charged to the budget (copies)
    step_spans: list[tuple[int, int]] | None = None  # this step's computed spans; None: the scheduled n in one
    step_end: int = 0  # the position this step ends at
    probe_due: bool = False  # the bound mode: the deviation is still to be measured (once every copy is made)
    copied_spans: list[tuple[int, int]] = field(default_factory=list)  # the spans copied since admitted
    stored: set[int] = field(default_factory=set)  # segments stored (or found stored) already
    copied_tokens: int = 0  # prompt tokens copied, over the request's life

    def hashes(self, req: Request, i: int, block_size: int) -> list[BlockHash]:
        start, end = self.segments[i]
        return hash_segment_blocks(req.prompt_token_ids[start:end], block_size, self.root)  # the root has the salt


def segment_store(kv: KVCacheManager) -> SegmentStore | None:
    """The segment store plugged into the KV manager's connector seam (the engine plugs one in where the model is
    one full-attention group and the prefix cache is on), where a request's copies come from and its segments go:
    kv_blend talks to it directly, the manager knows it only as a connector."""
    connectors = kv.connectors if isinstance(kv, PagedKVCacheManager) else []
    return next((c for c in connectors if isinstance(c, SegmentStore)), None)


def _blending(req: Request, kv: KVCacheManager) -> BlendState | None:
    blend = req.blend
    return blend if blend is not None and segment_store(kv) is not None and req.reads_prefix_cache else None


def _store(kv: KVCacheManager) -> SegmentStore:
    """The segment store of a request with a plan (_blending checked there is one)."""
    store = segment_store(kv)
    assert store is not None
    return store


def plan(req: Request, kv: KVCacheManager, hits: KVCacheBlocks, num_cached: int) -> None:
    """At admission, after the prefix-cache lookup found `hits` (`num_cached` tokens): which spans to copy, with
    their stored blocks held. The last prompt token is always computed (its logits give the first output token).
    The hits are pinned meanwhile: a segment read from the disk tier takes a free block, and the free hits are
    not the request's until it is admitted."""
    blend = _blending(req, kv)
    if blend is None:
        return
    blend.copies, blend.pending_copy = [], 0  # a re-admission plans again: its earlier holds went with its blocks
    blend.step_spans, blend.probe_due, blend.copied_spans = None, False, []
    if _exact(blend):
        return
    store = _store(kv)
    store.pin(list(hits))
    try:
        _plan_copies(req, blend, kv, num_cached)
    finally:
        store.unpin(list(hits))


def without_copies(req: Request) -> bool:
    """A request that does not fit its pool beside its plan's holds (the stored passages' blocks it holds count
    against the pool until copied) is planned from now on as an ordinary prefill (recompute 1.0: exact, nothing
    held); False where it was one already, so the caller fails it. Called after its blocks and holds were freed."""
    blend = req.blend
    if blend is None or _exact(blend):
        return False
    blend.recompute, blend.max_deviation, blend.copies, blend.pending_copy = 1.0, None, [], 0
    blend.step_spans, blend.probe_due = None, False  # (its copies' limit went with its free: SegmentStore.limit)
    logger.info("kv_blend: request %s fits only without its passages' holds: computing them", req.request_id)
    return True


def _exact(blend: BlendState) -> bool:
    """Nothing is copied: recompute 1.0, or a bound of 0 (no deviation allowed is full prefill)."""
    return blend.max_deviation == 0 if blend.max_deviation is not None else blend.recompute >= 1.0


def _plan_copies(req: Request, blend: BlendState, kv: KVCacheManager, num_cached: int) -> None:
    """The fixed share: the tails `_recomputed_tails` gives are computed. The bound mode: every stored block is
    copied, and the tokens to compute again are chosen once the copies are made (`_probe`)."""
    bs, last, store = kv.block_size, req.num_prompt_tokens - 1, _store(kv)
    bound = blend.max_deviation is not None
    tails = [0] * len(blend.segments) if bound else _recomputed_tails(blend, num_cached)
    for i, ((start, end), tail) in enumerate(zip(blend.segments, tails)):
        lo, stop = max(num_cached, start), min(end - tail, last)
        if lo >= stop:
            continue
        found = store.hold(req.request_id, blend.hashes(req, i, bs))
        hi = min(start + len(found) * bs, stop)
        first = (lo - start) // bs
        if lo >= hi:
            store.release(req.request_id, found)
            continue
        if len(found) * bs >= end - start - (end - start) % bs:
            blend.stored.add(i)  # every full block is stored: nothing to store after computing it
        store.release(req.request_id, found[:first])
        blend.copies.append(CopySpan(lo, hi, start, found[first:], first))
    if blend.copies:
        store.limit(req.request_id, blend.copies[0].start)
        blend.probe_due = bound


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
    """(tokens the request advances this step, of which charged to the budget) for a token budget: the compute
    spans up to the budget with the copies between them (free of budget), so a prompt of many passages is one
    forward (its spans are chunks of one step). Sets the request's step spans."""
    pos = req.num_computed_tokens if computed is None else computed
    total = len(req.all_token_ids)
    blend = req.blend
    if blend is None or not blend.copies:
        if blend is not None:
            blend.pending_copy, blend.step_spans, blend.step_end = 0, None, pos + min(total - pos, budget)
        n = min(total - pos, budget)
        return n, n
    if blend.probe_due and total - pos - sum(s.end - s.start for s in blend.copies) <= budget:
        return _probe_step(blend, pos, total, budget)
    spans: list[tuple[int, int]] = []
    cursor, left = pos, budget
    for span in blend.copies:
        if span.start > cursor:
            take = min(span.start - cursor, left)
            spans.append((cursor, cursor + take))
            cursor, left = cursor + take, left - take
        if left == 0 or blend.probe_due:  # the bound mode's copies come with its probe, once the rest fits
            break
        cursor = max(cursor, span.end)
    else:
        take = min(total - cursor, left)
        if take:
            spans.append((cursor, cursor + take))
            cursor, left = cursor + take, left - take
    blend.step_spans, blend.step_end = spans, cursor
    blend.pending_copy = cursor - pos - (budget - left)
    return cursor - pos, budget - left


def _probe_step(blend: BlendState, pos: int, total: int, budget: int) -> tuple[int, int]:
    """The bound mode's step: every copy, the measure, then every token left to compute (chosen by the measure)
    in one forward. Charged as the tokens not copied and a 15% share of the copied ones, at most the budget (the
    share is known only once measured)."""
    copied = sum(s.end - s.start for s in blend.copies)
    cost = min(budget, total - pos - copied + math.ceil(0.15 * copied))
    blend.step_spans, blend.step_end, blend.pending_copy = None, total, total - pos - cost
    return total - pos, cost


def computed_spans(req: Request, n: int) -> list[tuple[int, int]]:
    """The [start, end) spans the request computes this step, of the n tokens it advances (ascending)."""
    blend = req.blend
    if blend is None or blend.step_spans is None:
        return [(req.num_computed_tokens, req.num_computed_tokens + n)]
    return blend.step_spans


def apply_copies(req: Request, runner: ModelRunner, kv: KVCacheManager) -> None:
    """Copy the spans this step covers into the request's slots (keys moved to where they land), then let go of
    their stored blocks. Before the step's forward: the computed tokens after a copy attend to it."""
    blend = req.blend
    if blend is None:
        return
    assert isinstance(kv, PagedKVCacheManager)
    table, bs = kv.get_block_ids(req.request_id), kv.block_size
    while blend.copies and blend.copies[0].end <= blend.step_end:
        span = blend.copies[0]  # taken off only once copied: a failed copy fails again when run alone
        src, dst = [], []
        for pos in range(span.start, span.end):
            off = pos - span.origin
            src.append(span.blocks[off // bs - span.first_block].block_id * bs + off % bs)
            dst.append(table[pos // bs] * bs + pos % bs)
        runner.copy_kv(src, dst, span.origin)
        blend.copies.pop(0)
        _store(kv).release(req.request_id, span.blocks)
        span.blocks = []
        blend.copied_tokens += span.end - span.start
        blend.copied_spans.append((span.start, span.end))
    if blend.probe_due and not blend.copies:
        blend.step_spans = _probe(req, runner, kv, blend)
        blend.probe_due = False


PROBE_LAYER = 1  # CacheBlend's: layer 0's K/V depend on the token alone; a copy's deviation shows from layer 1
QUERY_TOKENS = 16  # the prompt's last tokens (the question): the deviation is weighed by their attention
ESTIMATE = "kv"  # how a deviation is weighed: "kv" (CacheBlend's; kept: lower KL per token measured) or "attention"
TAIL = 0.0  # share of the copied tokens nearest the question recomputed whatever their deviation, before the bound


@torch.inference_mode()
def _probe(req: Request, runner: ModelRunner, kv: KVCacheManager, blend: BlendState) -> list[tuple[int, int]]:
    """The bound mode's measure, once every copy is made: the first PROBE_LAYER layers over every token from the
    request's position on (their K/V written: copied tokens get their own, as CacheBlend), then layer
    PROBE_LAYER's K/V of each copied token computed and set against its copy. The copied tokens of largest
    deviation are computed again until what is left is under the bound; the spans to compute this step."""
    assert isinstance(kv, PagedKVCacheManager) and blend.max_deviation is not None
    start, total = req.num_computed_tokens, len(req.all_token_ids)
    table, bs = kv.get_block_ids(req.request_id), kv.block_size
    meta = build_metadata([total - start], [start], [table], bs, runner.device)
    model = runner.model
    ids = torch.tensor(req.all_token_ids[start:total], dtype=torch.long, device=runner.device)
    h = model.hidden_states(ids, meta, runner.kv_caches[:PROBE_LAYER])  # zip stops at the first layers
    layer = model.decoder_layers[PROBE_LAYER]
    rope = model.ropes.get(layer.rope)
    x = h if layer.attn_norm is None else layer.attn_norm(h)
    cos_sin = rope.cos_sin(meta.positions, h.dtype) if rope is not None else None
    q, k, v, _ = layer._qkv(x, cos_sin)
    # What a zero input projects to: the biases, rotated (Qwen2's K bias has an L2 norm of ~227 on a head of the
    # 0.5B: against it every token's K/V error looked small and the bound computed 4% of a prompt at KL 0.2-0.3)
    _, k0, v0, _ = layer._qkv(torch.zeros_like(x), cos_sin)
    assert k is not None and v is not None and k0 is not None and v0 is not None, (
        "the probe layer stores its own K/V (kv_blend's models share none)"
    )
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(total)], device=runner.device)
    kc, vc = runner.kv_caches[PROBE_LAYER]
    old_k, old_v = (_rows(c, slots, runner.kv_dtype) for c in (kc, vc))  # every position up to the end
    copied = torch.zeros(total - start, dtype=torch.bool)
    for s, e in blend.copied_spans:
        copied[max(s, start) - start : max(e, start) - start] = True
    scores, norms = _deviations(q.float(), k.float(), v.float(), old_k, old_v, start, layer, (k - k0, v - v0))
    allowed = blend.max_deviation if norms is None else blend.max_deviation**2 * float(norms[copied].sum())
    tail = torch.zeros_like(copied)
    last = copied.nonzero().flatten()
    tail[last[len(last) - math.ceil(TAIL * len(last)) :]] = True
    keep = _select(scores, copied & ~tail, allowed)
    blend.copied_tokens -= int(copied.sum()) - int(keep.sum())
    return _runs(~keep, start)


def _rows(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cache rows at `slots` as float32 [n, kv_heads, head_dim]."""
    flat = cache.view(-1, *cache.shape[2:])
    if kv_quant.is_quantized(dtype):
        return kv_quant.dequantize(flat.view(torch.uint8)[slots], dtype)
    return flat[slots].float()


def _deviations(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    old_k: torch.Tensor,
    old_v: torch.Tensor,
    start: int,
    layer: Any,
    content: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per token from `start` on, its deviation as ESTIMATE weighs it (the deviation left is the sum of the
    scores not recomputed), and for "kv" each token's squared K/V norm, which the bound is relative to.
    "kv": CacheBlend's, ||dK||^2 + ||dV||^2 of the token at the probe layer (the left, over the copied tokens'
    squared norms, square-rooted: a relative KV error); the norms are of `content`, K and V less what the
    projections' biases alone give (a bias is the same for every token and no copy deviates in it, so it must
    not make every error look small).
    "attention": the change of the question's attention output at the probe layer a token makes, to first order:
    a * (|dV| + |q.dK| scale |V - o|) per query token and head, over |o|, averaged (the left is a relative error
    of what the question reads)."""
    n = k.shape[0]
    dk, dv = k - old_k[start:], v - old_v[start:]
    if ESTIMATE == "kv":
        ck, cv = (c.float() for c in content)
        return dk.square().sum((1, 2)) + dv.square().sum((1, 2)), ck.square().sum((1, 2)) + cv.square().sum((1, 2))
    keys = torch.cat([old_k[:start], k])  # [P, kvh, d]: the prefix from the cache (exact), the rest as computed
    vals = torch.cat([old_v[:start], v])
    qn = min(QUERY_TOKENS, n)
    kvh, d = keys.shape[1], keys.shape[2]
    g = q.shape[1] // kvh
    qq = q[-qn:].view(qn, kvh, g, d).permute(1, 0, 2, 3).reshape(kvh, qn * g, d)  # [kvh, qn*g, d]
    scale = layer.attn_spec.scale or d**-0.5
    logits = torch.einsum("hqd,phd->hqp", qq, keys) * scale
    pos = torch.arange(keys.shape[0])
    qpos = (keys.shape[0] - qn + torch.arange(qn)).repeat_interleave(g)
    logits = logits.masked_fill(pos[None, None, :] > qpos[None, :, None], float("-inf"))
    a = logits.softmax(-1)  # [kvh, qn*g, P]
    o = torch.einsum("hqp,phd->hqd", a, vals)
    vo = torch.einsum("phd,hqd->hqp", vals, o)  # |V - o|^2 = |V|^2 - 2 V.o + |o|^2
    dist = (vals.square().sum(-1).T[:, None, :] - 2 * vo + o.square().sum(-1)[..., None]).clamp_min(0).sqrt()
    ds = torch.einsum("hqd,phd->hqp", qq, dk) * scale  # [kvh, qn*g, n]
    onorm = o.norm(dim=-1).clamp_min(1e-6)[..., None]
    tail = slice(keys.shape[0] - n, None)
    contrib = a[..., tail] * (dv.norm(dim=-1).T[:, None, :] + ds.abs() * dist[..., tail]) / onorm
    return contrib.mean((0, 1)), None


def _select(scores: torch.Tensor, copied: torch.Tensor, allowed: float) -> torch.Tensor:
    """Which copied tokens stay copied: the copied ones of largest score are recomputed until the sum of the
    scores left is at most `allowed`."""
    scores = torch.where(copied, scores, torch.zeros_like(scores))
    order = torch.argsort(scores, descending=True)
    left = scores.sum() - torch.cumsum(scores[order], 0)  # the deviation left after recomputing the first j + 1
    left = torch.cat([scores.sum()[None], left])
    j = int((left > allowed).sum())  # left is falling: the first j tokens are recomputed
    keep = copied.clone()
    keep[order[:j]] = False
    return keep


def _runs(mask: torch.Tensor, offset: int) -> list[tuple[int, int]]:
    """The [start, end) runs of True in `mask`, shifted by `offset`."""
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(mask.tolist()):
        if not m:
            continue
        if spans and spans[-1][1] == offset + i:
            spans[-1] = (spans[-1][0], offset + i + 1)
        else:
            spans.append((offset + i, offset + i + 1))
    return spans


def store_segments(req: Request, runner: ModelRunner, kv: KVCacheManager) -> None:
    """Store the segments whose every token is now in the request's cache and which are not stored yet: their
    full blocks into fresh pool blocks at positions 0..L-1 (keys rotated back by the segment's start). Storing
    is best effort: without free blocks, or if the copy fails, the segment is just not stored."""
    blend = _blending(req, kv)
    if blend is None:
        return
    bs, store = kv.block_size, _store(kv)
    for i, (start, end) in enumerate(blend.segments):
        if i in blend.stored or end > req.num_computed_tokens:
            continue
        blend.stored.add(i)
        fresh = store.new_blocks(blend.hashes(req, i, bs))
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
            store.end_store([b for _, b in fresh], written)


def check_segments(
    segments: object, prompt_len: int, recompute: object, max_deviation: object = None
) -> list[tuple[int, int]]:
    """`kv_segments` as ascending, disjoint [start, end) token spans inside the prompt, the recompute ratio in
    [0, 1] or the bound (the deviation left, from 0 to 1), not both; SamplingParamsError naming the field
    otherwise (a server answers 400 before anything is queued)."""
    for name, x in (("kv_blend_recompute", recompute), ("kv_blend_max_deviation", max_deviation)):
        if x is not None and (isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= 1):
            raise SamplingParamsError(name, f"must be a number from 0 to 1, got {x!r}")
    if recompute is not None and max_deviation is not None:
        raise SamplingParamsError(
            "kv_blend_max_deviation", "set either the fixed share (recompute) or the bound (max_deviation), not both"
        )
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
