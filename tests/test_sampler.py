"""The sampler against hand-computed values, and seeded sampling independent of the batch around it."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.model.sampler import SamplingRow, filter_logits, sample


def row(prompt=(), output=(), banned=(), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), list(banned))


def test_greedy_takes_the_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [3.0, 0.0, 0.0, 0.0]])
    assert [r.token_id for r in sample(logits, [row(temperature=0), row(temperature=0)])] == [1, 0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    # Token 1 (logit 2.0, seen) becomes 1.0; token 3 (1.9, unseen) now wins. Token 2 (-1.0, seen) -> -2.0.
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9]])
    res = sample(logits, [row(prompt=[1, 2], temperature=0, repetition_penalty=2.0)])
    assert res[0].token_id == 3
    res = sample(torch.tensor([[0.1, 2.0, -1.0, 1.9]]), [row(prompt=[1], temperature=0, repetition_penalty=1.01)])
    assert res[0].token_id == 1  # 2.0 / 1.01 = 1.98 > 1.9


def test_presence_and_frequency_penalties_use_output_counts():
    # Output has token 0 three times: 5.0 - 3 * 0.5 (frequency) - 1.0 (presence) = 2.5 < 3.0 of token 1.
    logits = torch.tensor([[5.0, 3.0, 0.0]])
    assert (
        sample(logits, [row(output=[0, 0, 0], temperature=0, frequency_penalty=0.5, presence_penalty=1.0)])[0].token_id
        == 1
    )
    # 5.0 - 3 * 0.5 = 3.5 > 3.0: without the presence penalty token 0 still wins.
    assert sample(logits, [row(output=[0, 0, 0], temperature=0, frequency_penalty=0.5)])[0].token_id == 0
    # The prompt does not count for these two.
    assert sample(logits, [row(prompt=[0] * 9, temperature=0, frequency_penalty=2.0)])[0].token_id == 0


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0]])  # 1 is EOS, 2 a stop token id
    r = row(output=[3], banned=[1, 2], temperature=0, min_tokens=3)
    assert sample(logits, [r])[0].token_id == 3
    r = row(output=[3, 3, 3], banned=[1, 2], temperature=0, min_tokens=3)
    assert sample(logits, [r])[0].token_id == 1


def test_logprobs_are_the_model_distribution_with_top_k():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    res = sample(logits, [row(temperature=0, logprobs=2)])[0]
    z = math.log(sum(math.exp(x) for x in (1.0, 2.0, 3.0, 0.0)))
    assert set(res.logprobs) == {2, 1}
    assert res.logprobs[2] == pytest.approx(3.0 - z) and res.logprobs[1] == pytest.approx(2.0 - z)
    res = sample(logits, [row(temperature=0, logprobs=0, repetition_penalty=1.5, prompt=[2])])[0]
    assert list(res.logprobs) == [res.token_id]  # the sampled token only, with its raw logprob
    assert res.logprobs[res.token_id] == pytest.approx([1.0, 2.0, 3.0, 0.0][res.token_id] - z)


def test_filters_top_k_top_p_min_p():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    one = torch.ones(1)

    def kept(top_k=0, top_p=1.0, min_p=0.0):
        out = filter_logits(logits, one, torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))
        return torch.isfinite(out[0]).nonzero().flatten().tolist()

    assert kept(top_k=2) == [0, 1]
    assert kept(top_p=0.6) == [0, 1]  # 0.5 < 0.6, so the second token is needed; 0.7 >= 0.6 stops there
    assert kept(top_p=0.5) == [0]
    assert kept(min_p=0.25) == [0, 1, 2]  # threshold 0.125
    assert kept() == [0, 1, 2, 3, 4]


def test_sampling_follows_the_filtered_distribution():
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).repeat(3000, 1)
    rows = [row(temperature=1.0, top_k=2) for _ in range(3000)]
    counts = torch.bincount(torch.tensor([r.token_id for r in sample(logits, rows)]), minlength=3)
    assert counts[2] == 0
    assert abs(counts[0].item() / 3000 - 0.625) < 0.04  # 0.5 / 0.8


def test_seeded_rows_do_not_depend_on_the_batch():
    torch.manual_seed(1)
    vocab = 50
    target = torch.randn(vocab)

    def draws(batch_rows: int, position: int) -> list[int]:
        out = []
        for step in range(10):
            logits = torch.randn(batch_rows, vocab)
            logits[position] = target
            rows = [row(temperature=1.0) for _ in range(batch_rows)]
            rows[position] = row(output=[7] * step, temperature=0.8, top_p=0.9, seed=42)
            out.append(sample(logits, rows)[position].token_id)
        return out

    assert draws(1, 0) == draws(5, 3) == draws(8, 7)
    assert len(set(draws(1, 0))) > 1  # each position its own noise


def test_seeded_noise_depends_on_seed_and_position_only():
    """The same (seed, position) picks the same token whatever came before it: what makes a verified draft
    the token the step without drafts would have sampled."""
    logits = torch.zeros(1, 1000)

    def pick(seed, output):
        return sample(logits, [row(output=output, temperature=1.0, seed=seed)])[0].token_id

    assert pick(3, [1, 2, 3]) == pick(3, [9, 9, 9])
    assert len({pick(3, [0] * n) for n in range(8)}) > 4
    assert len({pick(s, [0, 0]) for s in range(8)}) > 4


@pytest.mark.parametrize("seed", range(4))
def test_greedy_rows_pick_what_the_finite_logits_pick(seed):
    """The greedy fast path (argmax without a finite copy) against argmax(finite(logits)) on rows holding nan,
    +inf, -inf, the largest float and all of -inf: rows where the raw argmax would land on a nan or an inf are the
    ones it must take again."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(12, 50, generator=gen)
    big = torch.finfo(torch.float32).max
    logits[0, 7] = float("nan")  # raw argmax: the nan; finite: the real maximum
    logits[1, [3, 9]] = torch.tensor([big, float("inf")])  # +inf -> the largest float: a tie, the first wins
    logits[2, :] = float("-inf")
    logits[3, 5], logits[3, 6] = float("nan"), float("inf")
    logits[4, ::2] = float("-inf")
    logits[5, 11] = float("inf")
    expected = torch.nan_to_num(logits, nan=float("-inf"), posinf=big).argmax(-1).tolist()
    got = [r.token_id for r in sample(logits, [row(temperature=0) for _ in range(12)])]
    assert got == expected
    assert got[0] != 7 and got[1] == 3 and got[3] == 6
