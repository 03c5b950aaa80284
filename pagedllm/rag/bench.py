"""`pagedllm rag bench`: what the prompt layout does to the prefix cache.

One Zipf-skewed question workload; retrieval is done once per question (timed), so every setting gives the model
the same chunks. For each layout and prefix caching on / off, a fresh engine answers the questions one at a time
(greedy), so TTFT is the prefill of that prompt alone. Rows: prefix-cache hit rate, prompt tokens computed vs served
from the cache, TTFT median / p99, output tokens/s, TPOT median, the share of draft tokens accepted (with
--speculative-config), retrieval latency. Then a check that the same question with the
same prompt got the same answer text in every setting.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pagedllm.rag.generate import Answer, stream_engine, stream_openai
from pagedllm.rag.layout import LAYOUTS, Popularity, build_messages
from pagedllm.rag.pipeline import RagPipeline
from pagedllm.rag.workload import zipf_questions


@dataclass
class BenchRow:
    setting: str
    layout: str
    prefix_caching: str  # "on" | "off" | "server"
    requests: int
    hit_rate: float  # cached prompt tokens / prompt tokens
    prompt_tokens: int
    computed_tokens: int
    cached_tokens: int
    ttft_median_ms: float
    ttft_p99_ms: float
    output_tokens: int
    output_tok_s: float  # output tokens / total generation time (requests one at a time)
    retrieval_median_ms: float
    retrieval_p99_ms: float
    wall_s: float
    tpot_median_ms: float = float("nan")  # per answer (E2E - TTFT) / (output tokens - 1), as bench serve's TPOT
    spec_acceptance: float | None = None  # draft tokens accepted / drafted (in-process, speculation on)


def percentile(vals: list[float], q: float) -> float:
    """numpy's (linear interpolation); NaN for no values."""
    return float(np.percentile(vals, q)) if vals else float("nan")


def make_row(
    layout: str,
    caching: str,
    answers: list[Answer],
    wall: float,
    retrieval_s: list[float],
    spec_acceptance: float | None = None,
) -> BenchRow:
    prompt = sum(a.prompt_tokens for a in answers)
    cached = sum(a.cached_tokens or 0 for a in answers)
    out = sum(a.output_tokens for a in answers)
    ttfts = [a.ttft * 1000 for a in answers if a.ttft is not None]
    gen = sum(a.e2e or 0.0 for a in answers)
    tpots = [
        (a.e2e - a.ttft) * 1000 / (a.output_tokens - 1)
        for a in answers
        if a.output_tokens > 1 and a.e2e is not None and a.ttft is not None
    ]
    rms = [r * 1000 for r in retrieval_s]
    return BenchRow(
        setting=f"{layout}/cache-{caching}",
        layout=layout,
        prefix_caching=caching,
        requests=len(answers),
        hit_rate=cached / prompt if prompt else 0.0,
        prompt_tokens=prompt,
        computed_tokens=prompt - cached,
        cached_tokens=cached,
        ttft_median_ms=statistics.median(ttfts) if ttfts else float("nan"),
        ttft_p99_ms=percentile(ttfts, 99),
        output_tokens=out,
        output_tok_s=out / gen if gen else 0.0,
        retrieval_median_ms=statistics.median(rms) if rms else float("nan"),
        retrieval_p99_ms=percentile(rms, 99),
        wall_s=wall,
        tpot_median_ms=statistics.median(tpots) if tpots else float("nan"),
        spec_acceptance=spec_acceptance,
    )


def check_answers(records: list[dict]) -> dict:
    """Answers grouped by (question, prompt token ids): every group should hold one distinct text (greedy)."""
    groups: dict[tuple, set] = {}
    settings: dict[tuple, set] = {}
    for r in records:
        key = (r["question"], tuple(r["prompt_token_ids"]))
        groups.setdefault(key, set()).add(r["answer"])
        settings.setdefault(key, set()).add(r["setting"])
    multi = {k: v for k, v in groups.items() if len(settings[k]) > 1 or len(v) > 1}
    bad = [
        {"question": k[0], "settings": sorted(settings[k]), "answers": sorted(v)}
        for k, v in multi.items()
        if len(v) > 1
    ]
    return {"groups_compared": len(multi), "groups_identical": len(multi) - len(bad), "mismatches": bad}


@dataclass
class Workload:
    questions: list[str]
    messages: dict[str, list[list[dict]]]  # per layout, the chat messages of each question, in order
    retrieval_s: list[float]
    top3: int  # questions whose topic is among their top 3 hits


def build_workload(
    index_dir: str,
    num_questions: int,
    seed: int,
    top_k: int,
    layouts: list[str],
    zipf_s: float,
    log: Callable[[str], None] = print,
    embedding_url: str | None = None,
) -> Workload:
    """The questions, retrieved once each (timed), laid out by every layout. Each layout starts from no
    popularity history and sees the questions in the same order."""
    pipe = RagPipeline(index_dir, top_k=top_k, embedding_url=embedding_url)
    workload = zipf_questions(num_questions, seed, s=zipf_s)
    questions = [q for q, _ in workload]
    pipe.retrieve(questions[0])  # load the embedder before timing
    hits, retrieval_s = [], []
    for q in questions:
        hits.append(pipe.retrieve(q))
        retrieval_s.append(pipe.last_retrieval_s)
    top3 = sum(t in {h.source for h in hs[:3]} for (_, t), hs in zip(workload, hits))
    log(
        f"{num_questions} questions over {len({t for _, t in workload})} topics; "
        f"{len({q for q in questions})} distinct; retrieval median "
        f"{statistics.median(retrieval_s) * 1000:.1f} ms; topic in top-3 for {top3}/{num_questions}"
    )
    messages: dict[str, list[list[dict]]] = {}
    for layout in layouts:
        pop = Popularity()
        msgs = []
        for q, hs in zip(questions, hits):
            pop.record([h.chunk_id for h in hs])
            msgs.append(build_messages(q, hs, layout, pop)[0])
        messages[layout] = msgs
    return Workload(questions, messages, retrieval_s, top3)


def count_cached_tokens(prompts: list[list[int]], block_size: int = 16) -> list[int]:
    """Prompt tokens each prompt would take from the prefix cache, sent one after another, counted by the engine's
    own KV-cache manager with room for everything (nothing evicted) and no model at all.

    Why: the hit rate of a layout is a property of the token sequences alone, so it can be known in seconds for
    workloads (top-k, Zipf exponent, more questions) that would take an hour to time."""
    from pagedllm.kv import PagedKVCacheManager, TokenRequest, cdiv

    kv = PagedKVCacheManager(sum(cdiv(len(p), block_size) for p in prompts) + 1, block_size, True)
    cached = []
    for i, ids in enumerate(prompts):
        req = TokenRequest(str(i), list(ids))
        blocks, n = kv.get_computed_blocks(req)
        if not kv.allocate_slots(req, len(ids) - n, blocks):
            raise RuntimeError("the counting cache is sized for every prompt; allocation cannot fail")
        kv.free(req)
        cached.append(n)
    return cached


def count_layouts(
    index_dir: str,
    num_questions: int = 40,
    seed: int = 0,
    top_k: int = 4,
    layouts: list[str] | None = None,
    zipf_s: float = 1.1,
    block_size: int = 16,
    model: str | None = None,
    log: Callable[[str], None] = print,
    embedding_url: str | None = None,
) -> list[dict]:
    """`rag bench --count-only`: per layout, the share of prompt tokens the prefix cache would serve and the median
    tokens left to compute per question (what TTFT follows), without running the model."""
    from pagedllm.rag.tokens import get_tokenizer

    layouts = layouts or list(LAYOUTS)
    w = build_workload(index_dir, num_questions, seed, top_k, layouts, zipf_s, log, embedding_url)
    tok = get_tokenizer(model)
    rows = []
    for layout in layouts:
        prompts = [tok.apply_chat_template(m) for m in w.messages[layout]]
        cached = count_cached_tokens(prompts, block_size)
        total = sum(len(p) for p in prompts)
        rows.append(
            {
                "layout": layout,
                "prompt_tokens": total,
                "cached_tokens": sum(cached),
                "hit_rate": sum(cached) / total,
                "computed_median": statistics.median(len(p) - c for p, c in zip(prompts, cached)),
            }
        )
    return rows


def _answer_by_server(
    base_url: str,
    model: str | None,
    questions: list[str],
    messages: list,
    max_tokens: int,
    setting: str,
    tok,
    records: list[dict],
) -> tuple[list[Answer], float]:
    """Every question through an OpenAI-compatible server, one at a time; the answers and the seconds taken."""
    answers: list[Answer] = []
    t0 = time.perf_counter()
    for q, m in zip(questions, messages):
        a = Answer()
        for _ in stream_openai(base_url, m, a, model=model, max_tokens=max_tokens):
            pass
        answers.append(a)
        records.append(
            {"setting": setting, "question": q, "answer": a.text, "prompt_token_ids": tok.apply_chat_template(m)}
        )
    return answers, time.perf_counter() - t0


def _answer_in_process(
    engine_kwargs: dict | None,
    cache_on: bool,
    layout: str,
    questions: list[str],
    messages: list,
    max_tokens: int,
    setting: str,
    records: list[dict],
) -> tuple[list[Answer], float, float | None]:
    """Every question through a fresh in-process engine (after a warm-up the clock does not see); the answers,
    the seconds taken, and the share of draft tokens accepted (None: nothing was drafted)."""
    from pagedllm import SamplingParams
    from pagedllm.engine import EngineConfig, LLMEngine

    engine = LLMEngine(
        EngineConfig(**{**(engine_kwargs or {}), "enable_prefix_caching": cache_on, "log_stats_interval": 0})
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for _ in stream_engine(
        engine, engine.tokenizer.encode("Hello, warm-up."), SamplingParams(temperature=0.0, max_tokens=2), Answer()
    ):
        pass
    answers: list[Answer] = []
    before = engine.stats()
    t0 = time.perf_counter()
    for i, (q, m) in enumerate(zip(questions, messages)):
        ids = engine.tokenizer.apply_chat_template(m)
        a = Answer()
        for _ in stream_engine(engine, ids, params, a, request_id=f"{layout}-{i}"):
            pass
        answers.append(a)
        records.append({"setting": setting, "question": q, "answer": a.text, "prompt_token_ids": ids})
    elapsed = time.perf_counter() - t0
    after = engine.stats()
    drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    del engine
    gc.collect()
    return answers, elapsed, accepted / drafted if drafted else None


def _answer_setting(
    w: Any,
    layout: str,
    cache_on: bool | None,
    label: str,
    base_url: str | None,
    server_model: str | None,
    engine_kwargs: dict | None,
    max_tokens: int,
    tok: Any,
    records: list[dict],
) -> tuple[list[Answer], float, float | None]:
    """Every question in one layout, by the server at `base_url` or in process with caching `cache_on`."""
    setting = f"{layout}/cache-{label}"
    if base_url:
        answers, elapsed = _answer_by_server(
            base_url, server_model, w.questions, w.messages[layout], max_tokens, setting, tok, records
        )
        return answers, elapsed, None
    return _answer_in_process(
        engine_kwargs, bool(cache_on), layout, w.questions, w.messages[layout], max_tokens, setting, records
    )


def _result(config: dict, retrieval_s: list[float], top3: Any, rows: list[BenchRow], records: list[dict]) -> dict:
    """What run_bench returns (and rag bench saves): settings, retrieval, rows, the answer check, the records."""
    return {
        "config": config,
        "retrieval": {
            "median_ms": statistics.median(retrieval_s) * 1000,
            "p99_ms": percentile([r * 1000 for r in retrieval_s], 99),
            "topic_in_top3": top3,
        },
        "rows": [asdict(r) for r in rows],
        "answer_check": check_answers(records),
        "records": [
            {k: v for k, v in r.items() if k != "prompt_token_ids"} | {"prompt_tokens": len(r["prompt_token_ids"])}
            for r in records
        ],
    }


def _row_line(row: BenchRow) -> str:
    return (
        f"{row.setting:22s} hit rate {row.hit_rate:6.1%}  computed {row.computed_tokens:7d}  cached "
        f"{row.cached_tokens:7d}  TTFT median {row.ttft_median_ms:8.1f} ms  p99 {row.ttft_p99_ms:8.1f} ms  "
        f"{row.output_tok_s:6.1f} out tok/s  TPOT median {row.tpot_median_ms:6.1f} ms"
        + (f"  drafts accepted {row.spec_acceptance:.0%}" if row.spec_acceptance is not None else "")
    )


def run_bench(
    index_dir: str,
    num_questions: int = 40,
    seed: int = 0,
    top_k: int = 4,
    layouts: list[str] | None = None,
    caching: list[bool] | None = None,
    max_tokens: int = 32,
    engine_kwargs: dict | None = None,
    base_url: str | None = None,
    server_model: str | None = None,
    log: Callable[[str], None] = print,
    zipf_s: float = 1.1,
    partial_path: str | Path | None = None,
    embedding_url: str | None = None,
) -> dict:
    layouts = layouts or list(LAYOUTS)
    caching = [True, False] if caching is None else caching
    w = build_workload(index_dir, num_questions, seed, top_k, layouts, zipf_s, log, embedding_url)
    retrieval_s, top3 = w.retrieval_s, w.top3

    rows: list[BenchRow] = []
    records: list[dict] = []
    tok = None
    if base_url:
        from pagedllm.rag.tokens import get_tokenizer

        tok = get_tokenizer(None)
        settings: list[tuple[str, bool | None]] = [(layout, None) for layout in layouts]
    else:
        settings = [(layout, c) for c in caching for layout in layouts]
    for layout, cache_on in settings:
        label = "server" if cache_on is None else ("on" if cache_on else "off")
        answers, elapsed, acceptance = _answer_setting(
            w, layout, cache_on, label, base_url, server_model, engine_kwargs, max_tokens, tok, records
        )
        rows.append(make_row(layout, label, answers, elapsed, retrieval_s, acceptance))
        if partial_path:  # a long run on a busy machine keeps what it measured so far
            Path(partial_path).write_text(json.dumps([asdict(r) for r in rows], indent=1))
        log(_row_line(rows[-1]))
    config = {
        "index": str(index_dir),
        "num_questions": num_questions,
        "seed": seed,
        "top_k": top_k,
        "max_tokens": max_tokens,
        "zipf_s": zipf_s,
        "layouts": layouts,
        "base_url": base_url,
        "engine": engine_kwargs or {},
    }
    return _result(config, retrieval_s, top3, rows, records)


def markdown_table(rows: list[dict]) -> str:
    head = (
        "| layout | prefix caching | hit rate | prompt tokens computed | served from cache | TTFT median (ms) "
        "| TTFT p99 (ms) | output tok/s | TPOT median (ms) | drafts accepted | retrieval median (ms) |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        accepted = "-" if r.get("spec_acceptance") is None else f"{r['spec_acceptance']:.0%}"
        lines.append(
            f"| {r['layout']} | {r['prefix_caching']} | {r['hit_rate']:.1%} | {r['computed_tokens']} | "
            f"{r['cached_tokens']} | {r['ttft_median_ms']:.1f} | {r['ttft_p99_ms']:.1f} | "
            f"{r['output_tok_s']:.1f} | {r.get('tpot_median_ms', float('nan')):.1f} | {accepted} | "
            f"{r['retrieval_median_ms']:.1f} |"
        )
    return "\n".join(lines)


def plot(result: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [r["setting"] for r in rows]
    colors = ["tab:green" if r["prefix_caching"] != "off" else "tab:gray" for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, label in (
        (axes[0], "hit_rate", "prefix-cache hit rate"),
        (axes[1], "ttft_median_ms", "TTFT median (ms)"),
        (axes[2], "ttft_p99_ms", "TTFT p99 (ms)"),
    ):
        ax.bar(range(len(rows)), [r[key] for r in rows], color=colors)
        ax.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(label)
    c = result["config"]
    fig.suptitle(f"pagedllm rag bench: {c['num_questions']} Zipf questions, top-k {c['top_k']}, seed {c['seed']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def save(result: dict, out_dir: str | Path) -> dict[str, Path]:
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    paths = {"json": d / "rag_bench.json", "table": d / "rag_bench.md", "plot": d / "rag_bench.png"}
    paths["json"].write_text(json.dumps(result, indent=1))
    paths["table"].write_text(markdown_table(result["rows"]) + "\n")
    plot(result, paths["plot"])
    return paths
