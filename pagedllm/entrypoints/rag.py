"""`pagedllm rag ingest|search|ask|bench`: retrieval-augmented generation with a prefix-cache-aware prompt layout."""

from __future__ import annotations

import argparse
import json
import os
import sys

from pagedllm.errors import UserError
from pagedllm.rag import DEFAULT_INDEX


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
    sp.add_argument("--model", default=None, help="model whose tokenizer measures chunks (default: SmolLM2-135M)")
    sp.add_argument("--topics", default=None, help="default corpus only: comma-separated topic names to ingest")
    sp.add_argument("--no-progress", action="store_true", help="no progress bars")
    sp.set_defaults(func=cmd_ingest)


def _add_search(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("search", help="retrieval only: the top-k chunks with source, position and score")
    sp.add_argument("question")
    _index_arg(sp)
    sp.add_argument("--top-k", type=int, default=4)
    sp.add_argument("--json", action="store_true", help="print JSON (with chunk texts)")
    sp.set_defaults(func=cmd_search)


def _add_ask(sub: argparse._SubParsersAction) -> None:
    from pagedllm.engine.config import add_engine_args

    sp = sub.add_parser("ask", help="retrieve, build the prompt, stream the answer and list its sources")
    sp.add_argument("question")
    _index_arg(sp)
    sp.add_argument("--top-k", type=int, default=4)
    sp.add_argument("--layout", choices=["naive", "canonical", "popular"], default="canonical")
    sp.add_argument("--max-tokens", type=int, default=256)
    sp.add_argument("--temperature", type=float, default=0.0)
    sp.add_argument(
        "--base-url",
        default=None,
        help="answer with an OpenAI-compatible server (e.g. http://localhost:8000/v1) instead of in-process",
    )
    sp.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="for --base-url (default: $OPENAI_API_KEY)"
    )
    sp.add_argument("--server-model", default=None, help="model name sent to --base-url (default: its first model)")
    sp.add_argument("--show-prompt", action="store_true", help="print the chat messages before answering")
    add_engine_args(sp, model_positional=False)
    sp.set_defaults(func=cmd_ask)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from pagedllm.engine.config import add_engine_args

    sp = sub.add_parser("bench", help="prefix-cache hit rate and TTFT per layout, prefix caching on and off")
    _index_arg(sp)
    sp.add_argument("--num-questions", type=int, default=40)
    sp.add_argument("--top-k", type=int, default=4)
    sp.add_argument("--max-tokens", type=int, default=32, help="greedy output tokens per answer")
    sp.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of topic popularity (default 1.1)")
    sp.add_argument("--layouts", default="naive,canonical,popular", help="comma-separated")
    sp.add_argument(
        "--caching",
        choices=["both", "on", "off"],
        default="both",
        help="prefix-caching settings to run (overrides --enable-prefix-caching; default both)",
    )
    sp.add_argument("--base-url", default=None, help="run against an OpenAI-compatible server instead (its own cache)")
    sp.add_argument("--server-model", default=None)
    sp.add_argument("--out", default="rag-bench", help="folder for rag_bench.json / .md / .png (default ./rag-bench)")
    sp.add_argument(
        "--count-only",
        action="store_true",
        help="no model, no timing: count what the prefix cache would serve per layout (seconds)",
    )
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
    print("\nSources:")
    for i, h in enumerate(hits):
        print(f"  [{i + 1}] {h.source} #{h.position} (score {h.score:.3f}, chunk {h.chunk_id})")


def cmd_ask(args) -> int:
    from pagedllm.rag.generate import Answer, stream_engine, stream_openai
    from pagedllm.rag.pipeline import RagPipeline

    pipe = RagPipeline(
        args.index, top_k=args.top_k, layout=args.layout, popularity="persist", embedding_url=args.embedding_url
    )
    messages, hits = pipe.build_messages(args.question)
    pipe.save()
    if args.show_prompt:
        for m in messages:
            print(f"--- {m['role']} ---\n{m['content']}")
        print("--- answer ---")
    answer = Answer()
    if args.base_url:
        stream = stream_openai(
            args.base_url,
            messages,
            answer,
            model=args.server_model,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            api_key=args.api_key,
        )
    else:
        from pagedllm.engine import EngineConfig, LLMEngine
        from pagedllm.sampling_params import SamplingParams

        cfg = EngineConfig.from_args(args)
        cfg.log_stats_interval = 0
        engine = LLMEngine(cfg)
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
        stream = stream_engine(engine, engine.tokenizer.apply_chat_template(messages), params, answer)
    for delta in stream:
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


def _count_only(args, layouts: list[str], block_size: int, model: str | None) -> int:
    """`rag bench --count-only`: what the prefix cache would serve per layout, printed as a table."""
    from pagedllm.rag.bench import count_layouts

    rows = count_layouts(
        args.index,
        args.num_questions,
        args.seed,
        args.top_k,
        layouts,
        args.zipf,
        block_size,
        model,
        embedding_url=args.embedding_url,
    )
    print(f"\n{'layout':<11}{'hit rate':>9}{'prompt tokens':>15}{'from cache':>12}{'median computed':>17}")
    for r in rows:
        print(
            f"{r['layout']:<11}{r['hit_rate']:>9.1%}{r['prompt_tokens']:>15}{r['cached_tokens']:>12}"
            f"{r['computed_median']:>17.1f}"
        )
    return 0


def cmd_bench(args) -> int:
    from dataclasses import asdict, fields, is_dataclass

    from pagedllm.engine.config import EngineConfig
    from pagedllm.rag.bench import markdown_table, run_bench, save
    from pagedllm.rag.layout import LAYOUTS

    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    for lay in layouts:
        if lay not in LAYOUTS:
            raise UserError(f"--layouts: unknown layout {lay!r} (choose from {', '.join(LAYOUTS)})")
    if args.num_questions < 1:
        raise UserError("--num-questions must be at least 1")
    caching = {"both": [True, False], "on": [True], "off": [False]}[args.caching]
    cfg = EngineConfig.from_args(args)  # validates the engine flags
    if args.count_only:
        return _count_only(args, layouts, cfg.block_size, cfg.model)
    # JSON-ready (the result records them): a speculative config as its dict, which EngineConfig takes back
    engine_kwargs = {
        f.name: asdict(v) if is_dataclass(v := getattr(cfg, f.name)) and not isinstance(v, type) else v
        for f in fields(cfg)
    }
    os.makedirs(args.out, exist_ok=True)
    result = run_bench(
        args.index,
        args.num_questions,
        args.seed,
        args.top_k,
        layouts,
        caching,
        args.max_tokens,
        engine_kwargs,
        args.base_url,
        args.server_model,
        zipf_s=args.zipf,
        partial_path=os.path.join(args.out, "rag_bench_partial.json"),
        embedding_url=args.embedding_url,
    )
    paths = save(result, args.out)
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
