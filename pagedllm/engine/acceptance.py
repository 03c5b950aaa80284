"""Sampling rows and draft acceptance: what to sample for a request (a row after its last token and after each
draft, each seeing the output as if the drafts before it were accepted), the rows' logits held to the request's
grammar (structured outputs), and which of its drafts to keep."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from pagedllm.engine.request import Request
from pagedllm.engine.spec_decode import SpecDecodeStats, num_accepted
from pagedllm.engine.structured_output import GrammarCompiler, apply_bitmask, new_bitmask
from pagedllm.kv.manager import KVCacheManager
from pagedllm.model.sampler import SampleResult, SamplingRow

AppendToken = Callable[[Request, int, "dict[int, float] | None"], None]  # append one token, check the stop rules


def sampling_rows(req: Request, eos_token_ids: list[int]) -> list[SamplingRow]:
    """A row per position to sample: the one after the last token, and after each draft, each seeing the
    output as it would be had the drafts before it been accepted (penalties, min_tokens, seeded noise)."""
    out, drafts = req.output_token_ids, req.spec_token_ids
    banned = eos_token_ids + req.params.stop_token_ids
    return [
        SamplingRow(req.params, req.prompt_token_ids, out + drafts[:j] if j else out, banned)
        for j in range(len(drafts) + 1)
    ]  # the first row reads the output as it is: no copy per step


def accept(
    req: Request, results: list[SampleResult], append: AppendToken, kv: KVCacheManager, spec_stats: SpecDecodeStats
) -> None:
    """Keep the drafts the model confirmed and the model's own token after them, so a step appends exactly
    what steps without drafts would have, until a stop; then give back the rejected drafts' KV slots and
    register the blocks the accepted ones filled."""
    drafts, req.spec_token_ids = req.spec_token_ids, []
    accepted = num_accepted(drafts, [r.token_id for r in results])
    if drafts:
        spec_stats.record(len(drafts), accepted)
    for res in results[: accepted + 1]:
        append(req, res.token_id, res.logprobs)
        grammar = req.grammar
        if grammar is not None and not req.finished:
            if not grammar.active:  # the reasoning before the constraint: free, until its end is written
                grammar.watch(req.text)
            elif grammar.accept(res.token_id):
                req.finish("stop")  # structured outputs: the grammar is complete, only EOS could follow
        if req.finished:
            return
    if drafts:
        req.num_computed_tokens += accepted
        kv.trim(req, req.num_computed_tokens)
        kv.cache_computed(req, req.num_computed_tokens)


def constrain(
    to_sample: list[tuple[Request, torch.Tensor]], logits: torch.Tensor, compiler: GrammarCompiler
) -> tuple[torch.Tensor, dict[str, Exception]]:
    """Structured outputs: every constrained row's logits masked to what its grammar allows (the sampled
    token, and the logprobs reported, come from that distribution), in float32 as the sampler takes them.
    Per request, the error of a grammar that failed (its request fails; the others sample)."""
    spans, start = [], 0
    for req, lg in to_sample:
        if req.grammar is not None and req.grammar.active:
            spans.append((req, start, len(lg), req.grammar))
        start += len(lg)
    if not spans:
        return logits, {}
    began = time.perf_counter()
    logits = logits.float()
    bitmask = new_bitmask(sum(span[2] for span in spans), logits.shape[-1])
    rows: list[int] = []
    mask_rows: list[int] = []
    failed: dict[str, Exception] = {}
    at = 0
    for req, first, n, grammar in spans:
        try:
            grammar.fill_masks(bitmask, at, req.spec_token_ids)
            rows.extend(range(first, first + n))
            mask_rows.extend(range(at, at + n))
        except Exception as e:  # noqa: BLE001 - a grammar that failed to compile or refused a token
            failed[req.request_id] = e
        at += n
    if rows:
        apply_bitmask(logits, rows, bitmask[mask_rows])
    compiler.mask_seconds += time.perf_counter() - began
    compiler.mask_rows += len(rows)
    return logits, failed
