"""`pagedllm rag ingest|search|ask|bench`: retrieval-augmented generation with a prefix-cache-aware prompt layout."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Iterator

from pagedllm.errors import UserError
from pagedllm.rag import DEFAULT_INDEX
from pagedllm.rag.layout import LAYOUT_HELP, Layout
from pagedllm.report import format_table
from pagedllm.settings import Field, add_flags, from_args, settings


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "rag",
        help="RAG: ingest documents, search, answer with retrieved context, benchmark",
        description="Retrieval-augmented generation over a local faiss index.",
    )
    sub = p.add_subparsers(dest="rag_command", required=True)
    for add in (_add_ingest, _add_search, _add_ask, _add_bench):
        add(sub)


def _index_arg(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--index", default=DEFAULT_INDEX, help=f"index folder (default: ./{DEFAULT_INDEX})")
    sp.add_argument(
        "--embedding-url",
        default=None,
        help="embed with this server's /v1/embeddings (e.g. http://127.0.0.1:8000/v1 of `pagedllm serve "
        "--embedding-model default`) instead of loading the model here; key: $PAGEDLLM_API_KEY or $OPENAI_API_KEY",
    )


def _add_ingest(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser(
        "ingest",
        help="chunk, embed and index text/Markdown files or folders",
        description="With no PATH, ingests the default corpus: the Python language reference "
        "(pydoc_data.topics, one document per topic).",
    )
    sp.add_argument(
        "paths", nargs="*", metavar="PATH", help="files or folders (.txt, .md, .rst); none = default corpus"
    )
    _index_arg(sp)
    sp.add_argument("--chunk-size", type=int, default=256, help="chunk length in the LLM's tokens (default 256)")
    sp.add_argument("--chunk-overlap", type=int, default=32, help="tokens repeated between chunks (default 32)")
    sp.add_argument(
        "--model",
        default=None,
        help="model whose tokenizer measures chunks (default: SmolLM2-135M-Instruct)",
    )
    sp.add_argument(
        "--topics",
        default=None,
        help="default corpus only: comma-separated topic names to ingest (default: every topic)",
    )
    sp.add_argument("--no-progress", action="store_true", help="no progress bars (default: show them)")
    sp.set_defaults(func=cmd_ingest)


def _add_search(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("search", help="retrieval only: the top-k chunks with source, position and score")
    sp.add_argument("question", help="the text to search the index for")
    _index_arg(sp)
    sp.add_argument("--top-k", type=int, default=4, help="chunks to return (default: 4)")
    sp.add_argument("--json", action="store_true", help="print JSON, with the chunks' texts (default: a list)")
    sp.set_defaults(func=cmd_search)


# `rag ask`'s penalties, as a one-off study measured them on `rag bench`'s questions with the default model
# (docs/benchmarks.md; `git show 6f12652:benchmarks/rag_ask_penalties.py`): greedy, 11 of 12 answers looped;
# repetition 1.1 left 1 of 12 and kept every answer on its topic's key phrase (frequency 0.5: 5 loops; 1.15 with
# 0.3: none, but 2 answers off topic).
REPETITION_PENALTY = 1.1
FREQUENCY_PENALTY = 0.0


@settings
class RagAskConfig:
    """`rag ask`'s settings; answering in process takes the engine's from EngineConfig."""

    index: str = DEFAULT_INDEX
    """the index folder `pagedllm rag ingest` wrote (default: ./rag-index)"""
    embedding_url: str | None = None
    """embed the questions with this server's /v1/embeddings (e.g. http://127.0.0.1:8000/v1 of `pagedllm serve
    --embedding-model default`) instead of loading the model here; key: $PAGEDLLM_API_KEY or $OPENAI_API_KEY
    (default: the model is loaded here)"""
    top_k: int = Field(default=4, ge=1)
    """chunks retrieved for the question (default: 4)"""
    layout: Layout = Field(default="canonical", description=LAYOUT_HELP + " (default: canonical)")
    max_tokens: int = Field(default=256, ge=1)
    """most tokens in the answer (default: 256)"""
    temperature: float = Field(default=0.0, ge=0)
    """sampling temperature; 0 is greedy, the same answer every time (default: 0)"""
    repetition_penalty: float = Field(default=REPETITION_PENALTY, gt=0)
    """divides the logits of the tokens already in the prompt or the answer (vLLM's; 1 is off), against a small
    model that writes one sentence over and over (default: 1.1; 1 turns it off)"""
    frequency_penalty: float = Field(default=FREQUENCY_PENALTY, ge=-2, le=2)
    """subtracted from a token's logit once per time the answer already has it (OpenAI's; 0 is off), against a
    looping answer (default: 0, off)"""
    base_url: str | None = None
    """answer with an OpenAI-compatible server (e.g. http://localhost:8000/v1) instead of in process (default: in
    process)"""
    api_key: str | None = None
    """for --base-url (default: $OPENAI_API_KEY)"""
    server_model: str | None = None
    """the model name sent to --base-url (default: the server's first)"""
    show_prompt: bool = False
    """print the chat messages before answering (default: off)"""


def _add_ask(sub: argparse._SubParsersAction) -> None:
    from pagedllm.engine.config import add_engine_args

    sp = sub.add_parser("ask", help="retrieve, build the prompt, stream the answer and list its sources")
    sp.add_argument("question", help="the question to answer from the index")
    add_flags(sp.add_argument_group("retrieval and answer"), RagAskConfig)
    add_engine_args(sp, model_positional=False)
    sp.set_defaults(func=cmd_ask)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from pagedllm.engine.config import add_engine_args
    from pagedllm.rag.bench import RagBenchConfig

    sp = sub.add_parser("bench", help="prefix-cache hit rate and TTFT per layout, prefix caching on and off")
    add_flags(sp.add_argument_group("workload and report"), RagBenchConfig)
    add_engine_args(sp, model_positional=False)  # its --seed also seeds the question workload
    sp.set_defaults(func=cmd_bench)


def _ingest_docs(args):
    from pagedllm.rag.corpus import default_corpus, load_paths

    if args.paths:
        if args.topics:
            raise UserError("--topics applies to the default corpus only (give no PATH)")
        return load_paths(args.paths)
    topics = [t.strip() for t in args.topics.split(",") if t.strip()] if args.topics else None
    return default_corpus(topics)


def cmd_ingest(args) -> int:
    from pagedllm.rag.index import ingest

    docs = _ingest_docs(args)
    if not docs:
        raise UserError("no text or Markdown files found in the given paths")
    rep = ingest(
        docs,
        args.index,
        args.chunk_size,
        args.chunk_overlap,
        args.model,
        progress=not args.no_progress,
        embedding_url=args.embedding_url,
    )
    if rep.embedded:
        print(
            f"{rep.documents} documents: {rep.changed} new or changed ({rep.new_chunks} chunks embedded), "
            f"{rep.unchanged} unchanged; index {args.index} has {rep.total_chunks} chunks ({rep.seconds:.1f} s)"
        )
    else:
        print(f"{rep.documents} documents unchanged; nothing to do (index {args.index} has {rep.total_chunks} chunks)")
    return 0


def cmd_search(args) -> int:
    from pagedllm.rag.index import RagIndex

    hits = RagIndex(args.index, args.embedding_url).search(args.question, args.top_k)
    if args.json:
        print(json.dumps([h.to_dict() for h in hits], indent=1, ensure_ascii=False))
        return 0
    for h in hits:
        preview = " ".join(h.text.split())[:100]
        print(f"{h.rank + 1:2d}. {h.score:.3f}  {h.source} #{h.position}  [{h.chunk_id}]  {preview}")
    return 0


def _print_sources(hits) -> None:
    """The sources best match first (retrieval rank), each with the number its excerpt has in the prompt (the
    layout's order, which the answer cites), so a reader sees what matched best and what [n] points to."""
    print("\nSources (best match first):")
    for n, h in sorted(enumerate(hits, 1), key=lambda nh: nh[1].rank):
        print(f"  [{n}] {h.source} #{h.position} (score {h.score:.3f}, chunk {h.chunk_id})")


def _answer_stream(ask: RagAskConfig, args, messages: list[dict], answer) -> Iterator[str]:
    """The answer's text deltas: from --base-url's server, or an engine loaded here; with --repetition-penalty
    and --frequency-penalty, whose defaults keep the small default model from looping."""
    from pagedllm.rag.answer import stream_engine, stream_openai

    if ask.base_url:
        return stream_openai(
            ask.base_url,
            messages,
            answer,
            model=ask.server_model,
            max_tokens=ask.max_tokens,
            temperature=ask.temperature,
            api_key=ask.api_key or os.environ.get("OPENAI_API_KEY"),
            frequency_penalty=ask.frequency_penalty,
            repetition_penalty=ask.repetition_penalty,
        )
    from pagedllm.engine import EngineConfig, LLMEngine
    from pagedllm.sampling_params import SamplingParams

    engine = LLMEngine(dataclasses.replace(EngineConfig.from_args(args), log_stats_interval=0))
    params = SamplingParams(
        temperature=ask.temperature,
        max_tokens=ask.max_tokens,
        repetition_penalty=ask.repetition_penalty,
        frequency_penalty=ask.frequency_penalty,
    )
    return stream_engine(engine, engine.tokenizer.apply_chat_template(messages), params, answer)


def cmd_ask(args) -> int:
    from pagedllm.rag.answer import Answer
    from pagedllm.rag.pipeline import RagPipeline

    ask = from_args(RagAskConfig, args)
    pipe = RagPipeline(
        ask.index, top_k=ask.top_k, layout=ask.layout, popularity="persist", embedding_url=ask.embedding_url
    )
    messages, hits = pipe.build_messages(args.question)
    pipe.save()
    if ask.show_prompt:
        for m in messages:
            print(f"--- {m['role']} ---\n{m['content']}")
        print("--- answer ---")
    answer = Answer()
    for delta in _answer_stream(ask, args, messages, answer):
        sys.stdout.write(delta)
        sys.stdout.flush()
    print()
    _print_sources(hits)
    if answer.prompt_tokens:
        cached = "" if answer.cached_tokens is None else f", {answer.cached_tokens} from the prefix cache"
        ttft = "" if answer.ttft is None else f", TTFT {answer.ttft * 1000:.0f} ms"
        print(
            f"({answer.prompt_tokens} prompt tokens{cached}, {answer.output_tokens} output tokens{ttft})",
            file=sys.stderr,
        )
    return 0


def _bench_blend(cfg, engine) -> int:
    """`rag bench --kv-blend RATIOS`: passage KV reuse against prefix caching alone (rag/blend_bench.py)."""
    import json

    from pagedllm.rag.blend_bench import BLEND_COLUMNS, run_blend_bench

    result = run_blend_bench(cfg, engine)
    path = os.path.join(cfg.out, "rag_blend.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print()
    print(format_table(result["rows"], BLEND_COLUMNS, markdown=True))
    print(f"wrote {path}")
    return 0


def cmd_bench(args) -> int:
    from pagedllm.engine.config import EngineConfig
    from pagedllm.rag.bench import COUNT_COLUMNS, RagBenchConfig, count_layouts, markdown_table, run_bench, save

    cfg = from_args(RagBenchConfig, args)
    engine = EngineConfig.from_args(args)  # validates the engine flags
    if cfg.count_only:
        rows = count_layouts(cfg, engine.seed, engine.block_size, engine.model)
        print()
        print(format_table(rows, COUNT_COLUMNS))
        return 0
    os.makedirs(cfg.out, exist_ok=True)
    if cfg.kv_blend is not None:
        return _bench_blend(cfg, engine)
    result = run_bench(cfg, engine, partial_path=os.path.join(cfg.out, "rag_bench_partial.json"))
    paths = save(result, cfg.out)
    print()
    print(markdown_table(result["rows"]))
    chk = result["answer_check"]
    print(
        f"\nanswers for the same question and prompt identical across settings: "
        f"{chk['groups_identical']}/{chk['groups_compared']}"
    )
    for m in chk["mismatches"][:5]:
        print(f"  differs: {m['question']!r} in {', '.join(m['settings'])}")
    print(f"wrote {paths['json']}, {paths['table']}, {paths['plot']}")
    return 0
