"""`pagedllm rag bench`: what the prompt layout does to the prefix cache.

One Zipf-skewed question workload; retrieval is done once per question (timed), so every setting gives the model
the same chunks. For each layout and prefix caching on / off, a fresh engine answers the questions one at a time
(greedy), so TTFT is the prefill of that prompt alone. Rows: prefix-cache hit rate, prompt tokens computed vs served
from the cache, TTFT median / p99, output tokens/s, TPOT median, the share of draft tokens accepted (with
--speculative-config), retrieval latency. Then a check that the same question with the
same prompt got the same answer text in every setting.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pagedllm.errors import UserError
from pagedllm.rag import DEFAULT_INDEX
from pagedllm.rag.answer import Answer, stream_engine, stream_openai
from pagedllm.rag.layout import LAYOUTS, Popularity, build_messages
from pagedllm.rag.pipeline import RagPipeline
from pagedllm.rag.workload import zipf_questions
from pagedllm.report import Column, Latency, format_table, percentile
from pagedllm.settings import Field, settings

if TYPE_CHECKING:  # the engine (torch) loads only when a setting runs in process
    from pagedllm.engine import EngineConfig


@settings
class RagBenchConfig:
    """`rag bench`'s settings; an in-process run's engine settings are EngineConfig's."""

    index: str = DEFAULT_INDEX
    """the index folder `pagedllm rag ingest` wrote (default: ./rag-index)"""
    embedding_url: str | None = None
    """embed the questions with this server's /v1/embeddings (e.g. http://127.0.0.1:8000/v1 of `pagedllm serve
    --embedding-model default`) instead of loading the model here; key: $PAGEDLLM_API_KEY or $OPENAI_API_KEY
    (default: the model is loaded here)"""
    num_questions: int = Field(default=40, ge=1)
    """questions in the workload, drawn by Zipf-skewed topic popularity (default: 40)"""
    top_k: int = Field(default=4, ge=1)
    """chunks retrieved per question (default: 4)"""
    max_tokens: int = Field(default=32, ge=1)
    """greedy output tokens per answer (default: 32)"""
    zipf: float = Field(default=1.1, gt=0)
    """Zipf exponent of topic popularity: higher, fewer topics asked more often (default: 1.1)"""
    layouts: str = ",".join(LAYOUTS)
    """comma-separated prompt layouts to compare: naive, canonical, popular (default: all three)"""
    caching: Literal["both", "on", "off"] = "both"
    """prefix caching in the in-process runs: both (each layout with it on, then off; the default), on or off
    (wins over --enable-prefix-caching)"""
    base_url: str | None = None
    """measure an OpenAI-compatible server at this URL instead, with its own cache (default: in process)"""
    server_model: str | None = None
    """the model name sent to --base-url (default: the server's first)"""
    out: str = "rag-bench"
    """folder for rag_bench.json, .md and .png (default: ./rag-bench)"""
    count_only: bool = False
    """no model, no timing: count in seconds what the prefix cache would serve per layout (default: off)"""
    kv_blend: str | None = None
    """measure passage KV reuse instead of the layouts: comma-separated recompute ratios, e.g.
    0,0.05,0.15,0.3,1.0, each against prefix caching alone on the same prompts, with the passages in --order
    (docs/benchmarks.md; default: off)"""
    order: Literal["shuffle", "new-front"] = "shuffle"
    """with --kv-blend: the retrieved passages shuffled per request, or in canonical order behind one passage the
    question did not retrieve (default: shuffle)"""
    kv_blend_warmup: bool = True
    """with --kv-blend: before the timed pass, each engine answers the same questions once, untimed, with their
    passages in other orders (kv_blend settings at recompute 1.0, so exact): every passage is stored when the
    measured prompts come, so TTFT measures reuse, and the prefix cache is warmed alike for every setting
    (default: on; --no-kv-blend-warmup: passages seen first in the timed pass are computed and stored there)"""

    def __post_init__(self) -> None:
        unknown = [x for x in self.layout_list if x not in LAYOUTS]
        if unknown or not self.layout_list:
            raise UserError(f"--layouts: unknown layout {(unknown or [''])[0]!r} (choose from {', '.join(LAYOUTS)})")
        if self.kv_blend is not None:
            try:
                ratios = [float(x) for x in self.kv_blend.split(",") if x.strip()]
            except ValueError:
                ratios = []
            if not ratios or not all(0 <= r <= 1 for r in ratios):
                raise UserError(f"--kv-blend: comma-separated ratios from 0 to 1, got {self.kv_blend!r}")

    @property
    def layout_list(self) -> list[str]:
        return [x.strip() for x in self.layouts.split(",") if x.strip()]

    @property
    def caching_list(self) -> list[bool]:
        return {"both": [True, False], "on": [True], "off": [False]}[self.caching]


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
    ttft_median_ms: float | None  # None: nothing measured
    ttft_p99_ms: float | None
    output_tokens: int
    output_tok_s: float  # output tokens / total generation time (requests one at a time)
    retrieval_median_ms: float | None
    retrieval_p99_ms: float | None
    wall_s: float
    tpot_median_ms: float | None = None  # per answer (E2E - TTFT) / (output tokens - 1), as bench serve's TPOT
    spec_acceptance: float | None = None  # draft tokens accepted / drafted (in-process, speculation on)


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
    ttft, retrieval = Latency.of(ttfts), Latency.of([r * 1000 for r in retrieval_s])
    return BenchRow(
        setting=f"{layout}/cache-{caching}",
        layout=layout,
        prefix_caching=caching,
        requests=len(answers),
        hit_rate=cached / prompt if prompt else 0.0,
        prompt_tokens=prompt,
        computed_tokens=prompt - cached,
        cached_tokens=cached,
        ttft_median_ms=ttft.median,
        ttft_p99_ms=ttft.p99,
        output_tokens=out,
        output_tok_s=out / gen if gen else 0.0,
        retrieval_median_ms=retrieval.median,
        retrieval_p99_ms=retrieval.p99,
        wall_s=wall,
        tpot_median_ms=Latency.of(tpots).median,
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
    cfg: RagBenchConfig, seed: int = 0, block_size: int = 16, model: str | None = None, log: Callable = print
) -> list[dict]:
    """`rag bench --count-only`: per layout, the share of prompt tokens the prefix cache would serve and the median
    tokens left to compute per question (what TTFT follows), without running the model."""
    from pagedllm.rag.tokens import get_tokenizer

    w = build_workload(cfg.index, cfg.num_questions, seed, cfg.top_k, cfg.layout_list, cfg.zipf, log, cfg.embedding_url)
    tok = get_tokenizer(model)
    rows = []
    for layout in cfg.layout_list:
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


COUNT_COLUMNS = [
    Column("layout", "layout", align="<"),
    Column("hit_rate", "hit rate", "{:.1%}"),
    Column("prompt_tokens", "prompt tokens"),
    Column("cached_tokens", "from cache"),
    Column("computed_median", "median computed", "{:.1f}"),
]


@dataclass
class _Run:
    """One `rag bench` run: its settings, the workload every setting answers, and the answers recorded so far."""

    cfg: RagBenchConfig
    engine: EngineConfig | None
    w: Workload
    seed: int
    tok: Any = None  # the server runs' tokenizer, for the answer check's prompt ids
    records: list[dict] = field(default_factory=list)


def _answer_by_server(run: _Run, layout: str, setting: str) -> tuple[list[Answer], float]:
    """Every question through an OpenAI-compatible server, one at a time; the answers and the seconds taken."""
    answers: list[Answer] = []
    t0 = time.perf_counter()
    for q, m in zip(run.w.questions, run.w.messages[layout]):
        a = Answer()
        for _ in stream_openai(str(run.cfg.base_url), m, a, model=run.cfg.server_model, max_tokens=run.cfg.max_tokens):
            pass
        answers.append(a)
        run.records.append(
            {"setting": setting, "question": q, "answer": a.text, "prompt_token_ids": run.tok.apply_chat_template(m)}
        )
    return answers, time.perf_counter() - t0


def _answer_in_process(
    run: _Run, layout: str, cache_on: bool, setting: str
) -> tuple[list[Answer], float, float | None]:
    """Every question through a fresh in-process engine (after a warm-up the clock does not see); the answers,
    the seconds taken, and the share of draft tokens accepted (None: nothing was drafted)."""
    from pagedllm import SamplingParams
    from pagedllm.engine import EngineConfig, LLMEngine

    base = run.engine or EngineConfig()
    engine = LLMEngine(dataclasses.replace(base, enable_prefix_caching=cache_on, log_stats_interval=0))
    params = SamplingParams(temperature=0.0, max_tokens=run.cfg.max_tokens)
    for _ in stream_engine(
        engine, engine.tokenizer.encode("Hello, warm-up."), SamplingParams(temperature=0.0, max_tokens=2), Answer()
    ):
        pass
    answers: list[Answer] = []
    before = engine.stats()
    t0 = time.perf_counter()
    for i, (q, m) in enumerate(zip(run.w.questions, run.w.messages[layout])):
        ids = engine.tokenizer.apply_chat_template(m)
        a = Answer()
        for _ in stream_engine(engine, ids, params, a, request_id=f"{layout}-{i}"):
            pass
        answers.append(a)
        run.records.append({"setting": setting, "question": q, "answer": a.text, "prompt_token_ids": ids})
    elapsed = time.perf_counter() - t0
    after = engine.stats()
    drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    del engine
    gc.collect()
    return answers, elapsed, accepted / drafted if drafted else None


def _answer_setting(run: _Run, layout: str, cache_on: bool | None) -> BenchRow:
    """Every question in one layout, by the server at --base-url (cache_on None) or in process with caching
    `cache_on`, as a row."""
    label = "server" if cache_on is None else ("on" if cache_on else "off")
    setting = f"{layout}/cache-{label}"
    acceptance = None
    if cache_on is None:
        answers, elapsed = _answer_by_server(run, layout, setting)
    else:
        answers, elapsed, acceptance = _answer_in_process(run, layout, cache_on, setting)
    return make_row(layout, label, answers, elapsed, run.w.retrieval_s, acceptance)


def _json_ready(config: Any) -> dict[str, Any]:
    """Settings as the result records them: a speculative config as its dict."""
    return json.loads(json.dumps(asdict(config), default=str)) if config is not None else {}


def _result(run: _Run, rows: list[BenchRow]) -> dict:
    """What run_bench returns (and rag bench saves): settings, retrieval, rows, the answer check, the records."""
    cfg, retrieval_s = run.cfg, run.w.retrieval_s
    config = {
        "index": str(cfg.index),
        "num_questions": cfg.num_questions,
        "seed": run.seed,
        "top_k": cfg.top_k,
        "max_tokens": cfg.max_tokens,
        "zipf_s": cfg.zipf,
        "layouts": cfg.layout_list,
        "base_url": cfg.base_url,
        "engine": _json_ready(run.engine),
    }
    return {
        "config": config,
        "retrieval": {
            "median_ms": statistics.median(retrieval_s) * 1000,
            "p99_ms": percentile([r * 1000 for r in retrieval_s], 99),
            "topic_in_top3": run.w.top3,
        },
        "rows": [asdict(r) for r in rows],
        "answer_check": check_answers(run.records),
        "records": [
            {k: v for k, v in r.items() if k != "prompt_token_ids"} | {"prompt_tokens": len(r["prompt_token_ids"])}
            for r in run.records
        ],
    }


def _row_line(row: BenchRow) -> str:
    def ms(v: float | None, width: int) -> str:
        return f"{'-':>{width}}" if v is None else f"{v:{width}.1f}"

    return (
        f"{row.setting:22s} hit rate {row.hit_rate:6.1%}  computed {row.computed_tokens:7d}  cached "
        f"{row.cached_tokens:7d}  TTFT median {ms(row.ttft_median_ms, 8)} ms  p99 {ms(row.ttft_p99_ms, 8)} ms  "
        f"{row.output_tok_s:6.1f} out tok/s  TPOT median {ms(row.tpot_median_ms, 6)} ms"
        + (f"  drafts accepted {row.spec_acceptance:.0%}" if row.spec_acceptance is not None else "")
    )


def run_bench(
    cfg: RagBenchConfig,
    engine: EngineConfig | None = None,
    log: Callable[[str], None] = print,
    partial_path: str | Path | None = None,
) -> dict:
    """Every layout (in process: with each caching setting of cfg.caching) over one workload; `engine` is the
    in-process engine's settings (None: the defaults), and its seed also seeds the questions."""
    seed = engine.seed if engine is not None else 0
    w = build_workload(cfg.index, cfg.num_questions, seed, cfg.top_k, cfg.layout_list, cfg.zipf, log, cfg.embedding_url)
    run = _Run(cfg, engine, w, seed)
    if cfg.base_url:
        from pagedllm.rag.tokens import get_tokenizer

        run.tok = get_tokenizer(None)
        settings: list[tuple[str, bool | None]] = [(layout, None) for layout in cfg.layout_list]
    else:
        settings = [(layout, c) for c in cfg.caching_list for layout in cfg.layout_list]
    rows: list[BenchRow] = []
    for layout, cache_on in settings:
        rows.append(_answer_setting(run, layout, cache_on))
        if partial_path:  # a long run on a busy machine keeps what it measured so far
            Path(partial_path).write_text(json.dumps([asdict(r) for r in rows], indent=1))
        log(_row_line(rows[-1]))
    return _result(run, rows)


TABLE_COLUMNS = [
    Column("layout", "layout"),
    Column("prefix_caching", "prefix caching"),
    Column("hit_rate", "hit rate", "{:.1%}"),
    Column("computed_tokens", "prompt tokens computed"),
    Column("cached_tokens", "served from cache"),
    Column("ttft_median_ms", "TTFT median (ms)", "{:.1f}"),
    Column("ttft_p99_ms", "TTFT p99 (ms)", "{:.1f}"),
    Column("output_tok_s", "output tok/s", "{:.1f}"),
    Column("tpot_median_ms", "TPOT median (ms)", "{:.1f}"),
    Column("spec_acceptance", "drafts accepted", "{:.0%}"),
    Column("retrieval_median_ms", "retrieval median (ms)", "{:.1f}"),
]


def markdown_table(rows: list[dict]) -> str:
    return format_table(rows, TABLE_COLUMNS, markdown=True)


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
        ax.bar(range(len(rows)), [float("nan") if r[key] is None else r[key] for r in rows], color=colors)
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
