"""A failure fails only its own request. If a step's forward pass raises, the prefix-cache entries it made are
taken back (their K/V may never have been written) and each request runs alone; if batched sampling raises, each
request's rows are sampled alone. A BaseException that is not an Exception (Ctrl-C) rolls back and propagates."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagedllm.engine.request import Request
from pagedllm.engine.scheduler import Scheduler
from pagedllm.kv.manager import KVCacheManager
from pagedllm.model.sampler import SampleResult, SamplingRow, sample

logger = logging.getLogger("pagedllm")

Scheduled = list[tuple[Request, int]]  # (request, tokens to compute this step)
Computed = list[tuple[Request, int, torch.Tensor]]  # ... and its logits rows
Forward = Callable[[Scheduled], list[torch.Tensor]]  # one model call; per request, its logits rows


@dataclass
class Forwarded:
    """What a step's forward pass gave: the chunks computed, with their logits rows, and the requests whose
    own step failed (with why), for the engine to finish."""

    done: Computed = field(default_factory=list)
    failed: list[tuple[Request, str]] = field(default_factory=list)


def forward_guarded(forward: Forward, scheduled: Scheduled, kv: KVCacheManager, scheduler: Scheduler) -> Forwarded:
    """The step's forward pass; on failure, each request alone (`forward_each`)."""
    try:
        logits = forward(scheduled)
    except BaseException as e:
        undone = kv.rollback_step()
        if not isinstance(e, Exception):  # Ctrl-C: the caller aborts what runs
            raise
        logger.warning("a step of %d requests failed (%r): running each alone", len(scheduled), e)
        return forward_each(forward, scheduled, undone, kv, scheduler)
    kv.commit_step()
    return Forwarded([(req, n, rows) for (req, n), rows in zip(scheduled, logits)])


def forward_each(
    forward: Forward, scheduled: Scheduled, undone: dict[str, list], kv: KVCacheManager, scheduler: Scheduler
) -> Forwarded:
    """After a failed step: each request alone, in schedule order (a request that shares blocks another
    registered this step runs after it). One that fails again fails; one that shares a block whose writer
    failed is recomputed later, since that block's K/V were never written."""
    unwritten: set[int] = set()
    out = Forwarded()
    for req, n in scheduled:
        if unwritten.intersection(kv.held_block_ids(req.request_id)):  # every group's, not the null entries
            scheduler.requeue(req)
            continue
        try:
            (rows,) = forward([(req, n)])
        except Exception as e:  # noqa: BLE001 - any error of this request's step fails this request
            kv.rollback_step()  # what this try registered (a hybrid's state checkpoints at its marks)
            unwritten.update(b.block_id for b in undone.get(req.request_id, ()))
            out.failed.append((req, f"the model step failed: {type(e).__name__}: {e}"))
            continue
        kv.cache_computed(req, req.num_computed_tokens + n)
        kv.commit_step()
        out.done.append((req, n, rows))
    return out


def sample_guarded(logits: torch.Tensor, rows: list[list[SamplingRow]]) -> list[list[SampleResult] | Exception]:
    """One sampling call for the batch (`rows`: a request's rows, in the order of `logits`); if it raises, each
    request's rows alone, so the one whose rows raise gets its exception and the others their tokens."""
    try:
        flat = iter(sample(logits, [r for group in rows for r in group]))
        return [[next(flat) for _ in group] for group in rows]
    except Exception:  # noqa: BLE001 - find the request that raised
        results: list[list[SampleResult] | Exception] = []
        start = 0
        for group in rows:
            results.append(_sample_alone(logits[start : start + len(group)], group))
            start += len(group)
        return results


def _sample_alone(logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampleResult] | Exception:
    try:
        return sample(logits, rows)
    except Exception as e:  # noqa: BLE001 - handed back to fail these rows' request
        return e
