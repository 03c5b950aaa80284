"""Continuous batching: each step spends a token budget on running requests first, then admits waiting ones.

Running requests get their next token (decode) or the next chunk of their prompt (chunked prefill). When the
KV cache cannot grow a request, the most recently admitted request is preempted: its blocks go back and it
returns to the front of the waiting queue, to be recomputed later (its prefix may still be cached). A request
that cannot fit even with every other request gone finishes with an error, so the engine never deadlocks.

With speculative decoding, a decoding request also gets drafts (`request.spec_token_ids`) from the drafter: they
take budget and lookahead KV slots, and are the first thing dropped when the cache is short (before anyone is
preempted), since they only ever save time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from pagedllm.engine.blend import plan, step_size, without_copies
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.spec_decode import NgramDrafter
from pagedllm.kv.manager import KVCacheBlocks, KVCacheManager


@dataclass
class SchedulerOutput:
    # (request, new tokens to compute); the request's spec_token_ids are computed after those n
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)  # finished with an error this step

    @property
    def num_tokens(self) -> int:
        return sum(n + len(r.spec_token_ids) for r, n in self.scheduled)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        drafter: NgramDrafter | None = None,
        policy: Literal["fcfs", "priority"] = "fcfs",
        max_loras: int = 1,
    ) -> None:
        """`max_loras`: most LoRA adapters among the running requests (so in one step): a waiting request of
        another adapter is passed over, not blocking the queue, until one of them finishes (vLLM's)."""
        self.kv = kv
        self.max_loras = max_loras
        self.policy = policy
        self.drafter = drafter
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the tail is preempted first
        self.num_preemptions = 0
        self.peak_running = 0
        self._arrivals = 0

    def add(self, request: Request) -> None:
        self._arrivals += 1
        request.arrival = self._arrivals
        self.waiting.append(request)

    def _next_ready(self) -> Request | None:
        """The waiting request to admit next, skipping those whose grammar still compiles: the first in the queue
        (fcfs: arrival order, preempted ones in front), or the lowest (priority, arrival) under priority; one of
        a LoRA adapter only while the running requests use fewer than max_loras adapters or use its."""
        loras = {r.lora_int_id for r in self.running if r.lora_int_id}
        ready = (
            r
            for r in self.waiting
            if r.grammar_ready and (not r.lora_int_id or r.lora_int_id in loras or len(loras) < self.max_loras)
        )
        if self.policy == "priority":
            return min(ready, key=lambda r: (r.priority, r.arrival), default=None)
        return next(ready, None)

    def _preempt_one(self, out: SchedulerOutput, i: int) -> tuple[Request, int, int]:
        """Preempt a running request for room: the last admitted (fcfs), or the lowest priority, latest arrival
        one (priority: vLLM's choice), which may be one scheduled earlier this step; that one is taken out of
        this step again. The victim, the token budget it gives back, and where the loop over running goes on."""
        if self.policy == "priority":
            victim = max(self.running, key=lambda r: (r.priority, r.arrival))
        else:
            victim = self.running[-1]
        at = self.running.index(victim)
        self.running.pop(at)
        freed = 0
        if at < i:  # scheduled already this step
            copied = victim.blend.pending_copy if victim.blend is not None else 0  # kv_blend copies took no budget
            freed = sum(n + len(r.spec_token_ids) for r, n in out.scheduled if r is victim) - copied
            out.scheduled = [(r, n) for r, n in out.scheduled if r is not victim]
            i -= 1
        self._preempt(victim)
        return victim, freed, i

    def remove(self, request: Request) -> None:
        """Take a finished or aborted request out of the queues and give its blocks back."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)

    def requeue(self, request: Request) -> None:
        """Send a running request back to wait, its KV dropped, to be recomputed (as a preemption)."""
        self.running.remove(request)
        self._preempt(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        preempted = False
        drafting = self.drafter is not None and self.drafter.active(len(self.running) + len(self.waiting))
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new, cost = self._aligned(req, req.num_computed_tokens, *step_size(req, budget))
            decoding = drafting and req.num_tokens_to_compute == 1 and req.pooling is None
            req.spec_token_ids = self.drafter.propose(req, budget - 1) if decoding and self.drafter else []
            while not self.kv.allocate_slots(req, num_new, num_lookahead_tokens=len(req.spec_token_ids)):
                if req.spec_token_ids:
                    req.spec_token_ids = []
                    continue
                victim, freed, i = self._preempt_one(out, i)
                budget += freed
                preempted = True
                if victim is req:
                    break
            else:
                out.scheduled.append((req, num_new))
                budget -= cost + len(req.spec_token_ids)
                i += 1
                continue
            if not self.running and not without_copies(req):  # alone and still too big (a blend plan goes first)
                self.waiting.remove(req)
                self._fail(req, out)
            break

        # Admitting new work right after preempting would only thrash the cache.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            ready = self._next_ready()
            taken = None if ready is None else self._admit(ready, budget, out)
            if taken is None:
                break
            budget -= taken
        self.peak_running = max(self.peak_running, len(self.running))
        return out

    def _admit(self, req: Request, budget: int, out: SchedulerOutput) -> int | None:
        """Admit waiting `req` into this step if it fits: the budget it takes (0: it was not admitted, failed or
        planned again; go on with the next); None: admit no more this step (the pool is too full, or its prefix
        hit would end at a hybrid's state checkpoint that a chunk scheduled this step leaves: it waits a step
        for it, as an attention group's hit shares the blocks this step computes: kv/recurrent_state_manager.py)."""
        # Prompt logprobs and pooling need every prompt position computed: such a request reads no cache.
        blocks, num_cached = self._lookup(req)
        rs = self.kv.recurrent
        if out.scheduled and rs is not None and rs.waits(req.request_id):
            self.kv.free(req)  # what the lookup noted (nothing was taken)
            return None
        num_new, cost = self._aligned(req, num_cached, *step_size(req, budget, num_cached))
        req.num_computed_tokens = 0
        if not self.kv.allocate_slots(req, num_new, blocks):
            self.kv.free(req)  # the plan's holds (nothing else was taken)
            if self.running:
                return None
            if not without_copies(req):  # nothing will ever free blocks for it (but a blend plan's holds: again)
                self.waiting.remove(req)
                self._fail(req, out)
            return 0
        self.waiting.remove(req)
        req.num_computed_tokens = num_cached
        if req.num_preemptions == 0:  # a re-admission finding its own blocks is not a cache query (vLLM)
            req.num_cached_tokens = num_cached
            if req.reads_prefix_cache:
                self.kv.record_prefix_lookup(len(req.all_token_ids), num_cached)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.scheduled.append((req, num_new))
        return cost

    def _aligned(self, req: Request, start: int, num_new: int, cost: int) -> tuple[int, int]:
        """A hybrid model's prompt chunk cut to end at a block boundary (its state there is kept as a prefix-cache
        checkpoint: kv/state_slots.py): where its run of cached KV blocks ends without a checkpoint (a prefix it
        shares with an earlier prompt), at the prompt's last boundary (where a prompt that continues this one
        hits), else at the last boundary it reaches; unchanged where it passes none, or without checkpoints, or
        where the mixers emit the states inside a chunk (--mamba-cache-mode all)."""
        cut_at = None if self.kv.recurrent is None else self.kv.recurrent.align_cut(req.request_id)
        if cut_at is None:
            return num_new, cost
        bs, end, prompt = self.kv.block_size, start + num_new, req.num_prompt_tokens
        wanted = [b for b in (cut_at, (prompt - 1) // bs * bs) if start < b < end]
        cut = min(wanted) if wanted else end // bs * bs if end < prompt else end
        if cut <= start:
            return num_new, cost
        return cut - start, cost - (end - cut)

    def _lookup(self, req: Request) -> tuple[KVCacheBlocks, int]:
        """A waiting request's prefix-cache hit (none where every prompt position must be computed, nor past a
        position whose logits it keeps), and its kv_blend plan: the passages' stored KV to copy, held."""
        if req.reads_prefix_cache:
            blocks, num_cached = self.kv.get_computed_blocks(req)
        else:
            blocks, num_cached = KVCacheBlocks.empty(self.kv.num_groups), 0
        if req.logits_from is not None and num_cached > req.logits_from:
            blocks, num_cached = self.kv.shorten_hit(req, req.logits_from)  # every group's hit, shorter
        plan(req, self.kv, blocks, num_cached)
        return blocks, num_cached

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _fail(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req)
        need = len(req.all_token_ids)
        req.finish(
            "error",
            error=(
                f"request needs KV room for {need} tokens but the whole cache holds "
                f"{self.kv.num_blocks * self.kv.block_size} (raise --kv-cache-memory or lower --max-model-len)"
            ),
        )
        out.failed.append(req)
