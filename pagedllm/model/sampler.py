"""Turn a batch of next-token logits into tokens, each row with its own sampling parameters.

Order as in vLLM v1: raw logprobs are taken first (what the model said), then min_tokens masking, logit_bias
and penalties, then greedy rows take the argmax and random rows go through temperature, min_p, top_k and top_p.
Every value validation accepts must sample: overflows are clamped to finite numbers (`finite`), and top_p
always keeps the most likely token.

Random rows sample by the exponential race: argmax(p / E) with E ~ Exp(1) per token is a draw from p (torch's
multinomial and vLLM's sampler do the same). A seeded row's noise is a function of its seed and the position of
the token alone, so its token at a position does not depend on the rest of the batch, nor on whether the step
was speculative: verifying a draft is then "accept it if it is the token this noise picks", which accepts a
draft x with probability p(x) and otherwise yields a draw from p with x removed, the rejection-sampling rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.sampling_params import SamplingParams

MASK64 = 2**64 - 1


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]  # the output before the token sampled: its length is that token's position
    banned_until_min_tokens: list[int]  # EOS and stop token ids, masked while output < min_tokens


@dataclass
class SampleResult:
    token_id: int
    logprobs: dict[int, float] | None  # the top-k and the sampled token, when asked for


def apply_penalties(logits: torch.Tensor, row: SamplingRow) -> None:
    """In place on one row: repetition (prompt + output, as vLLM), presence and frequency (output only)."""
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), dtype=torch.long, device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and row.output_ids:
        out = torch.tensor(row.output_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(out, minlength=logits.shape[-1]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def restrict(logits: torch.Tensor, row: SamplingRow) -> None:
    """In place on one row: only `allowed_token_ids`, and never the token that would finish a bad word (its last
    token, when the output ends with the ones before it: vLLM's rule)."""
    p = row.params
    if p.allowed_token_ids:
        keep = torch.tensor(p.allowed_token_ids, dtype=torch.long, device=logits.device)
        kept = logits[keep]
        logits.fill_(float("-inf"))
        logits[keep] = kept
    for seq in p.bad_words_token_ids:
        head = seq[:-1]
        if not head or row.output_ids[len(row.output_ids) - len(head) :] == head:
            logits[seq[-1]] = float("-inf")


def finite(logits: torch.Tensor) -> torch.Tensor:
    """+inf -> the largest float, nan -> -inf: a penalty or temperature that overflows float32 must still leave a
    distribution to sample from, never a nan that kills the step."""
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)


def filter_logits(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Temperature, then min_p, top_k, top_p on a batch of rows; masked entries become -inf."""
    logits = finite(logits / temperature.unsqueeze(1))
    if bool((min_p > 0).any()):
        probs = logits.softmax(-1)
        threshold = probs.max(-1, keepdim=True).values * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    need_k, need_p = bool((top_k > 0).any()), bool((top_p < 1).any())
    if need_k or need_p:
        sorted_logits, order = logits.sort(-1, descending=True)
        vocab = logits.shape[-1]
        if need_k:
            k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
            ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
            sorted_logits = sorted_logits.masked_fill(ranks >= k.unsqueeze(1), float("-inf"))
        if need_p:
            probs = sorted_logits.softmax(-1)
            mass_before = probs.cumsum(-1) - probs  # keep a token while the mass before it is below top_p
            drop = mass_before >= top_p.unsqueeze(1)
            drop[:, 0] = False  # the most likely token always stays (a top_p that rounds to 0 in float32)
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def _processed(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """min_tokens masking, logit_bias and penalties, on a copy and only when some row asks for them."""
    if not any(
        r.params.repetition_penalty != 1
        or r.params.presence_penalty
        or r.params.frequency_penalty
        or r.params.logit_bias
        or len(r.output_ids) < r.params.min_tokens
        or r.params.allowed_token_ids
        or r.params.bad_words_token_ids
        for r in rows
    ):
        return logits
    logits = logits.clone()
    for i, row in enumerate(rows):
        if len(row.output_ids) < row.params.min_tokens and row.banned_until_min_tokens:
            logits[i, row.banned_until_min_tokens] = float("-inf")
        restrict(logits[i], row)
        if row.params.logit_bias:
            ids = torch.tensor(list(row.params.logit_bias), dtype=torch.long, device=logits.device)
            bias = torch.tensor(list(row.params.logit_bias.values()), dtype=logits.dtype, device=logits.device)
            logits[i].index_add_(0, ids, bias)
        apply_penalties(logits[i], row)
    return logits


def position_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): nearby seeds and positions get unrelated generator streams."""
    x = (seed + (position + 1) * 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def race_noise(rows: list[SamplingRow], random_rows: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """Exp(1) noise, a row per random row: seeded rows from (seed, position) on CPU, so the stream is the same on
    every device; the rest from torch's global generator. Clamped above 0: an exact 0 would make p / E = 0 / 0."""
    noise = torch.empty(len(random_rows), vocab, device=device).exponential_()
    for j, i in enumerate(random_rows):
        seed = rows[i].params.seed
        if seed is not None:
            gen = torch.Generator().manual_seed(position_seed(seed, len(rows[i].output_ids)))
            noise[j] = torch.empty(vocab).exponential_(generator=gen).to(device)
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Per row, the argmax of `finite(logits)`, without writing that finite copy of the batch (at 64 rows of a
    250K vocabulary, ~60 MB of fresh pages a step: more time than the argmax). argmax returns a nan where a row
    has one, else a +inf where it has one, so a row whose chosen value is finite has neither, and `finite` would
    change nothing it compares; only rows whose chosen value is not finite are taken again through it."""
    tokens = logits.argmax(-1)
    odd = (~logits.gather(1, tokens[:, None])[:, 0].isfinite()).nonzero()[:, 0]
    if len(odd):
        tokens[odd] = finite(logits[odd]).argmax(-1)
    return tokens


def _draw(logits: torch.Tensor, rows: list[SamplingRow], random_rows: list[int], tokens: torch.Tensor) -> None:
    """Sample the random rows into `tokens` by the exponential race."""
    dev = logits.device
    ps = [rows[i].params for i in random_rows]
    vocab = logits.shape[-1]
    probs = filter_logits(
        finite(logits[random_rows]),
        torch.tensor([p.temperature for p in ps], device=dev),
        torch.tensor([min(p.top_k, vocab) for p in ps], device=dev),
        torch.tensor([p.top_p for p in ps], device=dev),
        torch.tensor([p.min_p for p in ps], device=dev),
    ).softmax(-1)
    tokens[random_rows] = (probs / race_noise(rows, random_rows, vocab, dev)).argmax(-1)


def token_logprobs(logprobs: torch.Tensor, tokens: list[int], k: int) -> list[dict[int, float]]:
    """Per row: the given token's logprob and the top-k (k may be 0), as {token id: logprob}."""
    out = []
    top = logprobs.topk(k) if k else None
    chosen = logprobs.gather(1, torch.tensor(tokens, dtype=torch.long, device=logprobs.device)[:, None])
    for r, (tok, lp) in enumerate(zip(tokens, chosen[:, 0].tolist())):
        entry = {tok: lp}
        if top is not None:
            entry.update(zip(top.indices[r].tolist(), top.values[r].tolist()))
        out.append(entry)
    return out


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampleResult]:
    """logits: float32 [len(rows), vocab]."""
    logits = logits.float()
    want_logprobs = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    raw_logprobs = logits[want_logprobs].log_softmax(-1) if want_logprobs else None
    logits = _processed(logits, rows)
    tokens = greedy_tokens(logits)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        _draw(logits, rows, random_rows, tokens)
    token_list = tokens.tolist()
    results = [SampleResult(t, None) for t in token_list]
    if raw_logprobs is None:
        return results
    for j, i in enumerate(want_logprobs):
        k = rows[i].params.logprobs or 0
        results[i].logprobs = token_logprobs(raw_logprobs[j : j + 1], [token_list[i]], k)[0]
    return results
