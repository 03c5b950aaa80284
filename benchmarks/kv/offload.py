"""Repeated RAG with a RAM pool too small for its prefixes: the prefix cache's disk tier (--kv-offload-dir) side by
side with the RAM pool alone, and a restarted engine on the tier's folder against a cold one.

    .venv/bin/python -m benchmarks.kv.offload [--docs 16 --doc-tokens 512 --pool-tokens 2048 --passes 2]

Workload: `--docs` passages of the RAG corpus (`pydoc_data.topics`, the longest topics, each cut to
`--doc-tokens` tokens) behind one shared instruction; a request is instruction + passage + question. A pass asks
`--questions` questions about every passage, passages round-robin, so between two visits of a passage the others'
prefixes go through the pool (which holds `--pool-tokens`, a few passages). Requests run one at a time, greedy, 4
output tokens: TTFT is that prompt's prefill (or its cache hit). Rows, each on a fresh engine:
- RAM only: `--passes` passes, no tier; its first pass is also the cold server's;
- disk tier: the same with a fresh --kv-offload-dir;
- restart: a new engine on the disk tier's folder (what a redeployed server finds), one pass.
Figures: prefix-cache hit rate (tokens served from the cache / prompt tokens), disk hits, mean TTFT; and the
ratios the issue's targets name. Every row's answers must equal the RAM-only row's.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

from pagedllm import SamplingParams
from pagedllm.engine import EngineConfig, LLMEngine
from pagedllm.model.loader import load_model
from pagedllm.rag.corpus import default_corpus

INSTRUCTION = (
    "You answer questions about the Python language reference. Use only the passage below; if it does "
    "not hold the answer, say so.\n\n"
)
QUESTIONS = ["What is this passage about?", "Give one example from the passage.", "What should a beginner note?"]


def workload(tokenizer, docs: int, doc_tokens: int, questions: int) -> list[list[int]]:
    """One pass: every passage asked `questions` questions, passages round-robin."""
    corpus = sorted(default_corpus(), key=lambda d: -len(d.text))[:docs]
    passages = [tokenizer.decode(tokenizer.encode(d.text)[:doc_tokens]) for d in corpus]
    return [
        tokenizer.encode(f"{INSTRUCTION}Passage:\n{p}\n\nQuestion: {QUESTIONS[q % len(QUESTIONS)]}\nAnswer:")
        for q in range(questions)
        for p in passages
    ]


def run_pass(engine: LLMEngine, prompts: list[list[int]]) -> dict:
    """One request at a time: (TTFTs, tokens, prompt tokens, cached tokens, disk-hit tokens)."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    s0 = engine.stats()
    ttfts, answers = [], []
    for i, prompt in enumerate(prompts):
        rid = f"{engine.num_steps}-{i}"
        t0 = time.perf_counter()
        engine.add_request(rid, prompt, params)
        first = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.outputs[0].token_ids:
                    first = time.perf_counter() - t0
                if out.finished:
                    answers.append(out.outputs[0].token_ids)
        ttfts.append(first)
    s1 = engine.stats()
    return {
        "ttfts": ttfts,
        "answers": answers,
        "queries": s1.prefix_cache_queries - s0.prefix_cache_queries,
        "hits": s1.prefix_cache_hits - s0.prefix_cache_hits,
        "disk_hits": s1.prefix_cache_disk_hits - s0.prefix_cache_disk_hits,
    }


def summary(name: str, passes: list[dict]) -> dict:
    q, h, d = (sum(p[k] for p in passes) for k in ("queries", "hits", "disk_hits"))
    ttfts = [t for p in passes for t in p["ttfts"]]
    return {
        "row": name,
        "requests": len(ttfts),
        "hit_rate": h / q,
        "disk_hit_rate": d / q,
        "mean_ttft_ms": 1000 * statistics.mean(ttfts),
        "answers": [a for p in passes for a in p["answers"]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--doc-tokens", type=int, default=512)
    ap.add_argument("--questions", type=int, default=2, help="questions per passage per pass")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--pool-tokens", type=int, default=2048, help="the RAM pool, in tokens")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    loaded = load_model(None, args.dtype)
    prompts = workload(loaded.tokenizer, args.docs, args.doc_tokens, args.questions)
    probe = LLMEngine(EngineConfig(kv_cache_memory=2**24, log_stats_interval=0), loaded)
    pool = args.pool_tokens // 16 * probe.runner.bytes_per_block
    del probe

    def engine(tier: str | None) -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                kv_cache_memory=pool,
                max_model_len=2048,
                log_stats_interval=0,
                speculative_config=None,
                kv_offload_dir=tier,
            ),
            loaded,
        )

    print(
        f"{len(prompts)} requests a pass, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
        f"RAM pool {args.pool_tokens} tokens ({pool / 2**20:.1f} MiB), {args.passes} passes"
    )
    tier = tempfile.mkdtemp(prefix="pagedllm-kv-offload-")
    try:
        ram_engine = engine(None)
        ram = [run_pass(ram_engine, prompts) for _ in range(args.passes)]
        disk_engine = engine(tier)
        disk = [run_pass(disk_engine, prompts) for _ in range(args.passes)]
        disk_engine.disk_tier.flush()
        restart = [run_pass(engine(tier), prompts)]
    finally:
        shutil.rmtree(tier, ignore_errors=True)
    rows = [
        summary("RAM only", ram),
        summary("disk tier", disk),
        summary("cold server, pass 1", ram[:1]),
        summary("restart on the tier, pass 1", restart),
    ]
    print("| row | requests | prefix hit rate | of it from disk | mean TTFT ms |\n|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['row']} | {r['requests']} | {r['hit_rate']:.1%} | {r['disk_hit_rate']:.1%} | "
            f"{r['mean_ttft_ms']:.1f} |"
        )
    print(
        f"disk tier vs RAM only: hit rate x{rows[1]['hit_rate'] / rows[0]['hit_rate']:.2f}, mean TTFT "
        f"x{rows[1]['mean_ttft_ms'] / rows[0]['mean_ttft_ms']:.2f}; restart vs cold, first pass: mean TTFT "
        f"x{rows[3]['mean_ttft_ms'] / rows[2]['mean_ttft_ms']:.2f}"
    )
    same = rows[1]["answers"] == rows[0]["answers"] and rows[3]["answers"] == rows[2]["answers"]
    print("answers equal the RAM-only engine's:", "yes" if same else "NO")


if __name__ == "__main__":
    main()
