"""`pagedllm rag bench --order shuffle|new-front --kv-blend 0,0.05,0.15,0.3,1.0`: passage KV reuse (kv_blend)
against the prefix cache alone, and what it costs in quality.

The retrieved passages of each question come in a new order per request (`shuffle`), or in canonical order with
one passage the question did not retrieve in front (`new-front`): the cases where the prefix cache stops at the
first passage. One fresh engine per setting answers the same prompts (the same token ids) one at a time, greedy:
first with prefix caching alone, which is exact and so the full-prefill reference, then with kv_blend at each
recompute ratio. Per setting: TTFT mean / p90, prompt tokens computed, and against the reference: the KL
divergence of the next-token distributions over the reference answer's positions (teacher-forced: the prompt
plus the reference answer, run the setting's way, every position's log-softmax kept), greedy top-1 agreement
at those positions, the share of greedy answers identical to the reference's, and the share of answers that
name the question's topic (its key term) against the reference's share.

With `--kv-blend-warmup` (the default) each engine first answers the same questions untimed with their passages
in another shuffle (at recompute 1.0: exact, and every passage stored), so the timed pass reuses every passage
and TTFT measures reuse; the prefix-caching engine gets the same warm-up (its prefix cache warmed alike). For
`new-front`, the passage in front is one another question retrieved, so it is stored when that question primes,
unless it is not in the sample. The teacher-forced pass runs after the answer, in the same engine: by then every
passage of the prompt is stored, so it measures the case where all of them are reused.
"""

from __future__ import annotations

import dataclasses
import gc
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedllm.rag.index import Hit
from pagedllm.rag.layout import messages_in_order, order_hits, segmented_prompt
from pagedllm.rag.pipeline import RagPipeline
from pagedllm.rag.workload import TOPIC_PHRASES, zipf_questions
from pagedllm.report import Column, percentile

ORDERS = ("shuffle", "new-front")
_SKIP = {"the", "a", "an", "and", "or", "of", "in", "with", "like", "used", "as"}


@dataclass
class BlendPrompt:
    question: str
    key_term: str  # the topic's first content word: an answer on topic names it
    ids: list[int]
    spans: list[tuple[int, int]]


@dataclass
class BlendRow:
    setting: str
    recompute: float | None  # None: prefix caching alone (the reference)
    requests: int
    prompt_tokens: int
    computed_tokens: int
    copied_tokens: int
    ttft_mean_ms: float
    ttft_p90_ms: float
    ttft_vs_prefix: float
    kl_mean: float
    top1_agreement: float
    identical_answers: float
    key_term_rate: float


@dataclass
class _Measured:
    answers: list[list[int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    logits: list[Any] = field(default_factory=list)  # teacher-forced log-softmax rows per prompt
    computed: int = 0
    copied: int = 0


def key_term(topic: str) -> str:
    words = TOPIC_PHRASES.get(topic, topic.replace("-", " ")).replace(",", " ").split()
    return next((w for w in words if w.lower() not in _SKIP), words[0]).strip("_").lower()


def ordered_hits(hits: list[list[Hit]], order: str, seed: int) -> list[list[Hit]]:
    """Per question its passages in the order `order` gives: shuffled per request, or canonical order with a
    passage from the next question's retrieval (one this one lacks) in front."""
    rng = random.Random(seed)
    out = []
    for i, hs in enumerate(hits):
        canon = order_hits(hs, "canonical")
        if order == "shuffle":
            rng.shuffle(canon)
        else:
            have = {h.chunk_id for h in hs}
            pool = [h for j in range(1, len(hits)) for h in hits[(i + j) % len(hits)] if h.chunk_id not in have]
            canon = pool[:1] + canon
        out.append(canon)
    return out


def build_prompts(
    cfg: Any, order: str, seed: int, tokenizer: Any, log: Callable[[str], None], order_seed: int | None = None
) -> list[BlendPrompt]:
    """The questions of `seed`'s workload with their passages in `order`, shuffled by `order_seed` (default:
    `seed`): another order seed gives the same questions and passages in other orders (the warm-up's)."""
    pipe = RagPipeline(cfg.index, top_k=cfg.top_k, embedding_url=cfg.embedding_url)
    workload = zipf_questions(cfg.num_questions, seed, s=cfg.zipf)
    hits = [pipe.retrieve(q) for q, _ in workload]
    prompts = []
    shuffle_seed = seed if order_seed is None else order_seed
    for (q, topic), hs in zip(workload, ordered_hits(hits, order, shuffle_seed)):
        ids, spans = segmented_prompt(tokenizer, messages_in_order(q, hs), hs)
        prompts.append(BlendPrompt(q, key_term(topic), ids, spans))
    sizes = [e - s for p in prompts for s, e in p.spans]
    log(
        f"{len(prompts)} prompts, {order}: {statistics.mean(len(p.ids) for p in prompts):.0f} tokens each, "
        f"{len(sizes) / len(prompts):.1f} passages of {statistics.mean(sizes):.0f} tokens"
    )
    return prompts


def _run(engine: Any, rid: str, ids: list[int], params: Any, **kw: Any) -> Any:
    engine.add_request(rid, ids, params, **kw)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                if out.outputs[0].finish_reason == "error":
                    raise RuntimeError(f"request {rid} failed: {out.outputs[0].error}")
                return out
    raise RuntimeError(f"request {rid} never finished")


def measure(
    engine: Any,
    prompts: list[BlendPrompt],
    setting: float | dict | None,
    ref: _Measured | None,
    max_tokens: int,
    forced: bool = True,
):
    """Each prompt answered greedily, then teacher-forced on the reference answer (its own, for the reference).
    `setting`: None for prefix caching alone, a recompute share, or add_request's kv_blend keywords (the bound
    mode: {"kv_blend_max_deviation": x}). Without `forced`, only the answer (TTFT and tokens computed, as for a
    random-weight model whose logits mean nothing)."""
    from pagedllm import SamplingParams

    greedy, one = SamplingParams(temperature=0, max_tokens=max_tokens), SamplingParams(temperature=0, max_tokens=1)
    blend = {"kv_blend_recompute": setting} if isinstance(setting, (int, float)) else setting
    m = _Measured()
    for i, p in enumerate(prompts):
        kw = {} if blend is None else {"kv_segments": p.spans, **blend}
        before = engine.prompt_tokens
        out = _run(engine, f"q{i}", p.ids, greedy, **kw)
        m.computed += engine.prompt_tokens - before
        m.copied += out.num_blend_tokens
        m.ttfts.append(out.metrics.ttft * 1000)
        m.answers.append(list(out.outputs[0].token_ids))
        m.texts.append(out.outputs[0].text)
        if not forced:
            continue
        answer = (ref or m).answers[i]
        forced_out = _run(engine, f"t{i}", p.ids + answer, one, logits_from=len(p.ids) - 1, **kw)
        m.logits.append(forced_out.prompt_logits[: len(answer)].float())
    return m


def make_blend_row(name: str, r: float | None, prompts: list[BlendPrompt], m: _Measured, ref: _Measured) -> BlendRow:
    kls, agree, positions = 0.0, 0, 0
    for a, b in zip(ref.logits, m.logits):
        kls += float((a.exp() * (a - b)).sum())
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        positions += a.shape[0]
    terms = sum(p.key_term in t.lower() for p, t in zip(prompts, m.texts))
    mean = statistics.mean(m.ttfts)
    return BlendRow(
        setting=name,
        recompute=r,
        requests=len(prompts),
        prompt_tokens=sum(len(p.ids) for p in prompts),
        computed_tokens=m.computed,
        copied_tokens=m.copied,
        ttft_mean_ms=mean,
        ttft_p90_ms=percentile(m.ttfts, 90) or 0.0,
        ttft_vs_prefix=mean / statistics.mean(ref.ttfts),
        kl_mean=kls / positions if positions else 0.0,
        top1_agreement=agree / positions if positions else 1.0,
        identical_answers=sum(a == b for a, b in zip(m.answers, ref.answers)) / len(prompts),
        key_term_rate=terms / len(prompts),
    )


def _warm(engine: Any, priming: list[BlendPrompt], recompute: float | None) -> None:
    """The one-off costs out of the timed pass: a first forward, and with priming prompts every passage stored
    (kv_blend at recompute 1.0: exact) and the prefix cache warmed alike for every setting."""
    from pagedllm import SamplingParams

    _run(engine, "warm-up", engine.tokenizer.encode("Hello, warm-up."), SamplingParams(max_tokens=2))
    for i, p in enumerate(priming):
        kw = {} if recompute is None else {"kv_segments": p.spans, "kv_blend_recompute": 1.0}
        _run(engine, f"prime{i}", p.ids, SamplingParams(temperature=0, max_tokens=1), **kw)


def run_blend_bench(cfg: Any, engine_cfg: Any, log: Callable[[str], None] = print) -> dict:
    """Prefix caching alone, then kv_blend at each ratio of cfg.kv_blend, over one set of prompts."""
    from pagedllm.engine import EngineConfig, LLMEngine

    base = dataclasses.replace(engine_cfg or EngineConfig(), enable_prefix_caching=True, log_stats_interval=0)
    seed = base.seed
    ratios = [float(x) for x in str(cfg.kv_blend).split(",") if x.strip()]
    rows: list[BlendRow] = []
    ref: _Measured | None = None
    prompts: list[BlendPrompt] = []
    priming: list[BlendPrompt] = []
    for r in [None, *ratios]:
        engine = LLMEngine(base)
        if not prompts:
            prompts = build_prompts(cfg, cfg.order, seed, engine.tokenizer, log)
            if cfg.kv_blend_warmup:  # the same questions, their passages in another shuffle
                priming = build_prompts(cfg, "shuffle", seed, engine.tokenizer, log, order_seed=seed + 1)
        _warm(engine, priming, r)
        m = measure(engine, prompts, r, ref, cfg.max_tokens)
        ref = ref or m
        rows.append(make_blend_row("prefix caching" if r is None else f"kv_blend {r:g}", r, prompts, m, ref))
        log(_line(rows[-1]))
        del engine
        gc.collect()
    return {
        "config": {
            "index": str(cfg.index),
            "num_questions": cfg.num_questions,
            "top_k": cfg.top_k,
            "order": cfg.order,
            "kv_blend_warmup": cfg.kv_blend_warmup,
            "max_tokens": cfg.max_tokens,
            "seed": seed,
            "engine": {k: str(v) for k, v in dataclasses.asdict(base).items()},
        },
        "rows": [dataclasses.asdict(r) for r in rows],
    }


def _line(r: BlendRow) -> str:
    return (
        f"{r.setting:16s} TTFT mean {r.ttft_mean_ms:8.1f} ms p90 {r.ttft_p90_ms:8.1f} ({r.ttft_vs_prefix:.2f}x) "
        f"computed {r.computed_tokens:6d} copied {r.copied_tokens:6d}  KL {r.kl_mean:.4f}  top-1 "
        f"{r.top1_agreement:.1%}  identical {r.identical_answers:.0%}  key term {r.key_term_rate:.0%}"
    )


BLEND_COLUMNS = [
    Column("setting", "setting", align="<"),
    Column("ttft_mean_ms", "TTFT mean (ms)", "{:.1f}"),
    Column("ttft_p90_ms", "TTFT p90 (ms)", "{:.1f}"),
    Column("ttft_vs_prefix", "TTFT vs prefix caching", "{:.2f}x"),
    Column("computed_tokens", "prompt tokens computed"),
    Column("copied_tokens", "copied"),
    Column("kl_mean", "mean KL (nats)", "{:.4f}"),
    Column("top1_agreement", "top-1 agreement", "{:.1%}"),
    Column("identical_answers", "identical answers", "{:.0%}"),
    Column("key_term_rate", "answers naming the topic", "{:.0%}"),
]
