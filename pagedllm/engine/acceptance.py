"""Sampling rows and draft acceptance: what to sample for a request (a row after its last token and after each
draft, each seeing the output as if the drafts before it were accepted), and which of its drafts to keep."""

from __future__ import annotations

from pagedllm.engine.request import Request
from pagedllm.engine.spec_decode import SpecDecodeStats, num_accepted
from pagedllm.model.sampler import SampleResult, SamplingRow


def sampling_rows(req: Request, eos_token_ids: list[int]) -> list[SamplingRow]:
    """A row per position to sample: the one after the last token, and after each draft, each seeing the
    output as it would be had the drafts before it been accepted (penalties, min_tokens, seeded noise)."""
    out, drafts = req.output_token_ids, req.spec_token_ids
    banned = eos_token_ids + req.params.stop_token_ids
    return [
        SamplingRow(req.params, req.prompt_token_ids, out + drafts[:j] if j else out, banned)
        for j in range(len(drafts) + 1)
    ]  # the first row reads the output as it is: no copy per step


def accept(req: Request, results: list[SampleResult], spec_stats: SpecDecodeStats) -> tuple[list[SampleResult], int]:
    """Of a request's sampled rows, the ones to append: its drafts the model confirmed and the model's own token
    after them, so a step appends exactly what steps without drafts would have. Also how many drafts were
    accepted (the request's drafts are cleared: the rejected ones' KV slots are the caller's to give back)."""
    drafts, req.spec_token_ids = req.spec_token_ids, []
    accepted = num_accepted(drafts, [r.token_id for r in results])
    if drafts:
        spec_stats.record(len(drafts), accepted)
    return results[: accepted + 1], accepted
