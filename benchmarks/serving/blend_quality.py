"""kv_blend's quality on corpora of different kinds, all offline: the fixed shares against the bound mode.

Three corpora: `pydoc` (pydoc_data.topics, the RAG default's text), `licenses` (prose: the licence texts of
/usr/share/common-licenses) and `stdlib` (code: the Python standard library's own sources). Each is cut into
passages of 100-400 tokens at blank lines; a prompt holds 3-6 of them (seeded) in the RAG layout (rag/layout.py:
the system prompt, the excerpts, a question naming one excerpt's word). The passages are stored first in
canonical order (kv_blend at recompute 1.0: exact), then asked `shuffle`d or `new-front` (a passage of another
prompt in front). Per setting, each prompt answered greedily and teacher-forced over full prefill's answer
(rag/blend_bench.measure, as `rag bench --kv-blend`): top-1 agreement and KL over the answer's positions, the
share of identical answers, prompt tokens computed, TTFT against prefix caching alone.

    nice python -m benchmarks.serving.blend_quality --prompts 10 --max-tokens 16 --out blend_quality.json

`--bounds attention:0.02,kv:0.01` runs the bound mode with each selection estimate (engine/blend.py ESTIMATE) side
by side.

`--api` measures the same through a `pagedllm serve` it starts: `/v1/completions` with token-id prompts and
`kv_blend` ({"segments", "recompute"} or {"segments", "max_deviation"}), every teacher-forced position its own
request of one greedy token with `logprobs: 20` (prompt logprobs would turn the cache and kv_blend off), the
reference (no kv_blend) and the blend requests kept apart by `cache_salt`. Top-1 agreement and identical answers
are exact; KL is over the reference's 20 most likely tokens (a token missing from the blend's 20 taken at the
blend's 20th logprob: a lower bound); TTFT is the client's latency of the first request of each prompt (one
token). The bound runs with the server's estimate (the default); prompt tokens computed are not reported.

    nice python -m benchmarks.serving.blend_quality --api --prompts 16 --max-tokens 8 --bounds kv:0.01
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pagedllm.rag.blend_bench import BlendPrompt, _warm, make_blend_row, measure
from pagedllm.rag.index import Hit
from pagedllm.rag.layout import messages_in_order, segmented_prompt

STDLIB = [
    "textwrap",
    "heapq",
    "bisect",
    "shlex",
    "fractions",
    "statistics",
    "difflib",
    "calendar",
    "glob",
    "fnmatch",
    "colorsys",
    "gettext",
    "string",
    "queue",
    "sched",
    "graphlib",
    "ipaddress",
    "netrc",
    "plistlib",
    "tabnanny",
]


def corpus_texts(name: str) -> list[tuple[str, str]]:
    """(source, text) documents of a corpus."""
    if name == "pydoc":
        from pydoc_data.topics import topics

        return sorted(topics.items())
    if name == "licenses":
        root = Path("/usr/share/common-licenses")
        return [(p.name, p.read_text(errors="replace")) for p in sorted(root.iterdir()) if p.is_file()]
    if name == "stdlib":
        lib = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
        return [(f"{m}.py", (lib / f"{m}.py").read_text()) for m in STDLIB if (lib / f"{m}.py").exists()]
    raise SystemExit(f"--corpora: unknown corpus {name!r}")


def passages(name: str, tokenizer, lo: int = 100, hi: int = 400) -> list[Hit]:
    """The corpus cut at blank lines into passages of lo..hi tokens (a longer paragraph run is cut at hi)."""
    out: list[Hit] = []
    for source, text in corpus_texts(name):
        buf: list[str] = []
        for para in [*text.split("\n\n"), ""]:
            cand = "\n\n".join([*buf, para]).strip() if para else ""
            n = len(tokenizer.encode(cand)) if cand else 0
            if para and n <= hi:
                buf.append(para)
                continue
            piece = "\n\n".join(buf).strip()
            if lo <= len(tokenizer.encode(piece)) <= hi:
                out.append(Hit(f"{name}-{len(out):05d}", source, source, len(out), 0.0, piece, 0))
            buf = [para] if para and len(tokenizer.encode(para)) <= hi else []
    return out


def question(hit: Hit, number: int) -> tuple[str, str]:
    """A question about excerpt `number`, naming its longest word (an answer on topic names it)."""
    words = sorted({w.strip(".,:;()[]'\"`") for w in hit.text.split()}, key=lambda w: (-len(w), w))
    word = next((w for w in words if w.isidentifier()), words[0])
    return f"What does excerpt [{number}] say about {word}?", word.lower()


def build(name: str, tokenizer, n: int, order: str, seed: int) -> tuple[list[BlendPrompt], list[BlendPrompt]]:
    """The measured prompts (passages in `order`) and the priming ones (the same passages in canonical order)."""
    rng = random.Random(seed)
    pool = passages(name, tokenizer)
    chosen = [sorted(rng.sample(pool, rng.randint(3, 6)), key=lambda h: h.chunk_id) for _ in range(n)]
    measured, priming = [], []
    for i, hits in enumerate(chosen):
        asked = list(hits)
        if order == "shuffle":
            while asked == hits:
                rng.shuffle(asked)
        else:  # a passage of the next prompt in front (stored when that prompt primes)
            asked = [next(h for h in chosen[(i + 1) % n] if h not in hits), *hits]
        target = rng.randrange(len(asked))
        q, term = question(asked[target], target + 1)
        for dest, hs in ((measured, asked), (priming, hits)):
            ids, spans = segmented_prompt(tokenizer, messages_in_order(q, hs), hs)
            dest.append(BlendPrompt(q, term, ids, spans))
    return measured, priming


def settings(args) -> list[tuple[str, float | dict | None]]:
    """The fixed shares, then the bound mode at each `estimate:bound` of --bounds."""
    out: list[tuple[str, float | dict | None]] = [(f"recompute {r:g}", r) for r in args.recompute]
    for item in args.bounds.split(","):
        est, bound = item.split(":")
        est, _, tail = est.partition("+")
        label = f"bound {bound} ({est}{f', tail {tail}' if tail else ''})"
        out.append((label, {"kv_blend_max_deviation": float(bound), "estimate": est, "tail": float(tail or 0)}))
    return out


def run_corpus(name: str, order: str, args, loaded, log) -> list[dict]:
    from pagedllm.engine import EngineConfig, LLMEngine, blend

    cfg = EngineConfig(model=args.model, dtype=args.dtype, log_stats_interval=0, seed=args.seed)
    ref_engine = LLMEngine(cfg, loaded)
    prompts, priming = build(name, ref_engine.tokenizer, args.prompts, order, args.seed)
    sizes = [e - s for p in prompts for s, e in p.spans]
    log(
        f"{name} {order}: {len(prompts)} prompts of {statistics.mean(len(p.ids) for p in prompts):.0f} tokens, "
        f"{len(sizes) / len(prompts):.1f} passages of {statistics.mean(sizes):.0f} tokens ({min(sizes)}-{max(sizes)})"
    )
    _warm(ref_engine, priming, None)
    ref = measure(ref_engine, prompts, None, None, args.max_tokens, forced=not args.ttft_only)
    rows = [make_blend_row("prefix caching", None, prompts, ref, ref)]
    misses: dict[str, list] = {}
    engine = LLMEngine(cfg, loaded)
    _warm(engine, priming, 1.0)  # every passage stored, exact
    for label, setting in settings(args):
        kw = dict(setting) if isinstance(setting, dict) else setting
        if isinstance(kw, dict):
            blend.ESTIMATE, blend.TAIL = kw.pop("estimate"), kw.pop("tail")
        m = measure(engine, prompts, kw, ref, args.max_tokens, forced=not args.ttft_only)
        row = make_blend_row(label, None, prompts, m, ref)
        rows.append(row)
        misses[label] = _misses(ref.logits, m.logits)
        log(
            f"  {label:28s} computed {row.computed_tokens:6d}/{row.prompt_tokens}  top-1 {row.top1_agreement:.1%}  "
            f"KL {row.kl_mean:.4f}  identical {row.identical_answers:.0%}  TTFT {row.ttft_vs_prefix:.2f}x  "
            f"misses at margins {[x[2] for x in misses[label]]}"
        )
    return [{"corpus": name, "order": order, **vars(r), "misses": misses.get(r.setting, [])} for r in rows]


def _misses(ref: list, got: list) -> list[tuple[int, int, float]]:
    """(prompt, answer position, the reference's top-1 minus top-2 logprob there) where the top-1 differs: how
    near a tie each miss is."""
    out = []
    for i, (a, b) in enumerate(zip(ref, got)):
        top2 = a.topk(2, -1).values
        for j in (a.argmax(-1) != b.argmax(-1)).nonzero().flatten().tolist():
            out.append((i, j, round(float(top2[j, 0] - top2[j, 1]), 3)))
    return out


@dataclass
class _Served:
    """One setting through the API: per prompt its greedy answer (text), first-request latency and, per
    teacher-forced position, the top logprobs ({token text: logprob}) and the greedy token's text."""

    answers: list[str] = field(default_factory=list)
    answer_ids: list[list[int]] = field(default_factory=list)  # the reference's: the positions teacher-forced
    ttfts: list[float] = field(default_factory=list)
    tops: list[list[dict[str, float]]] = field(default_factory=list)
    greedy: list[list[str]] = field(default_factory=list)


def _complete(client, ids: list[int], max_tokens: int, salt: str, blend: dict | None, logprobs: int | None = None):
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "cache_salt": salt, "ignore_eos": True}
    if logprobs is not None:
        body["logprobs"] = logprobs
    if blend is not None:
        body["kv_blend"] = blend
    t0 = time.perf_counter()
    r = client.post("/v1/completions", json=body)
    if r.status_code != 200:
        raise SystemExit(f"the server answered {r.status_code}: {r.text}")
    return r.json()["choices"][0], (time.perf_counter() - t0) * 1000


def measure_api(client, token_ids: dict[str, int], prompts, salt: str, blend, ref: _Served | None, n: int) -> _Served:
    """Per prompt, each position its own one-token request (the first one timed: the prompt's first request).
    The reference decodes its answer so, one token at a time (`token_ids`: a token's text to its id, as the
    server writes the text); a blend setting is teacher-forced on the reference's answer and answers once more
    with n tokens (the identical-answer column)."""
    m = _Served()
    for i, p in enumerate(prompts):
        kw = None if blend is None else {"segments": [list(s) for s in p.spans], **blend}
        answer = [] if ref is None else ref.answer_ids[i]
        tops, greedy, ms = [], [], 0.0
        for j in range(n):
            out, t = _complete(client, p.ids + answer[:j], 1, salt, kw, 20)
            ms = ms or t
            tops.append(out["logprobs"]["top_logprobs"][0])
            greedy.append(out["logprobs"]["tokens"][0])
            if ref is None:
                answer.append(token_ids[greedy[-1]])
        m.ttfts.append(ms)
        m.tops.append(tops)
        m.greedy.append(greedy)
        m.answer_ids.append(answer)
        m.answers.append("".join(greedy) if ref is None else _complete(client, p.ids, n, salt, kw)[0]["text"])
    return m


def served_row(label: str, m: _Served, ref: _Served) -> dict:
    """Top-1 agreement, KL over the reference's top 20, identical answers and TTFT against the reference."""
    kl, agree, n = 0.0, 0, 0
    for ra, ma, rg, mg in zip(ref.tops, m.tops, ref.greedy, m.greedy):
        for rt, mt, rtok, mtok in zip(ra, ma, rg, mg):
            floor = min(mt.values())
            kl += sum(math.exp(lp) * (lp - mt.get(tok, floor)) for tok, lp in rt.items())
            agree += rtok == mtok
            n += 1
    return {
        "setting": label,
        "positions": n,
        "top1_agreement": agree / n,
        "kl_top20": kl / n,
        "identical_answers": sum(a == b for a, b in zip(m.answers, ref.answers)) / len(m.answers),
        "ttft_median_ms": statistics.median(m.ttfts),
        "ttft_vs_prefix": statistics.median(m.ttfts) / statistics.median(ref.ttfts),
    }


def run_corpus_api(name: str, order: str, args, client, tokenizer, log) -> list[dict]:
    """The table of run_corpus through the server: the reference under one cache salt, primed with the passages
    in canonical order (prefix cache warmed alike), every kv_blend setting under another, primed at recompute 1.0
    (exact: every passage stored). A blend request never registers blocks past its first copied token, so the
    settings do not read one another's approximations."""
    from pagedllm.engine import blend as engine_blend

    prompts, priming = build(name, tokenizer, args.prompts, order, args.seed)
    for p in priming:
        _complete(client, p.ids, 1, "ref", None)
        _complete(client, p.ids, 1, "blend", {"segments": [list(s) for s in p.spans], "recompute": 1.0})
    token_ids = {}
    for tid in range(tokenizer.vocab_size):  # a text two tokens decode to keeps the first (rare but byte tokens)
        token_ids.setdefault(tokenizer.decode([tid], skip_special_tokens=False), tid)
    ref = measure_api(client, token_ids, prompts, "ref", None, None, args.max_tokens)
    rows = [served_row("prefix caching", ref, ref)]
    for label, setting in settings(args):
        if isinstance(setting, dict):
            if (setting["estimate"], setting["tail"]) != (engine_blend.ESTIMATE, engine_blend.TAIL):
                log(f"  {label}: skipped (the server selects with its own ESTIMATE and TAIL)")
                continue
            blend = {"max_deviation": setting["kv_blend_max_deviation"]}
        else:
            blend = {"recompute": setting}
        rows.append(
            served_row(label, measure_api(client, token_ids, prompts, "blend", blend, ref, args.max_tokens), ref)
        )
        r = rows[-1]
        log(
            f"  {label:28s} top-1 {r['top1_agreement']:.1%} of {r['positions']}  KL(top 20) {r['kl_top20']:.4f}  "
            f"identical {r['identical_answers']:.0%}  TTFT {r['ttft_vs_prefix']:.2f}x"
        )
    return [{"corpus": name, "order": order, **r} for r in rows]


def serve_and_run(args, log) -> list[dict]:
    """Start `pagedllm serve` (bfloat16 as the offline mode, speculation off), run every corpus and order
    through it, stop it."""
    import httpx

    from benchmarks.common import wait_ready
    from pagedllm.rag.tokens import get_tokenizer

    url = f"http://127.0.0.1:{args.port}"
    cmd = [
        sys.executable,
        "-m",
        "pagedllm.entrypoints.cli",
        "serve",
        "--port",
        str(args.port),
        "--max-model-len",
        "4096",
        "--speculative-config",
        "none",
        *(["--model", args.model] if args.model else []),
        "--log-level",
        "warning",
        "--dtype",
        args.dtype,
    ]
    proc = subprocess.Popen(cmd)
    rows: list[dict] = []
    try:
        wait_ready(url, proc)
        with httpx.Client(base_url=url, timeout=600) as client:
            for name in args.corpora.split(","):
                for order in args.orders.split(","):
                    log(f"{name} {order} (served)")
                    rows += run_corpus_api(name, order, args, client, get_tokenizer(), log)
                    if args.out:
                        args.out.write_text(
                            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows})
                        )
    finally:
        proc.terminate()
        proc.wait()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpora", default="pydoc,licenses,stdlib")
    ap.add_argument("--orders", default="shuffle,new-front")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--recompute", type=lambda s: [float(x) for x in s.split(",")], default=[0, 0.05, 0.15, 0.3])
    ap.add_argument(
        "--bounds",
        default="attention:0.02,kv:0.01",
        help="estimate[+tail]:max_deviation,... (engine/blend.py ESTIMATE, TAIL: the share of the copied tokens "
        "nearest the question always recomputed)",
    )
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--model", default=None, help="a GGUF file or HF folder (default: the default model)")
    ap.add_argument(
        "--ttft-only", action="store_true", help="no teacher-forced pass (random weights: TTFT and tokens computed)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--api", action="store_true", help="through a `pagedllm serve` started here (/v1/completions)")
    ap.add_argument("--port", type=int, default=8471)
    args = ap.parse_args()
    if args.api:
        serve_and_run(args, lambda s: print(s, flush=True))
        return
    from pagedllm.engine import EngineConfig
    from pagedllm.engine.memory import resolve_device
    from pagedllm.model.loader import load_model

    cfg = EngineConfig(model=args.model, dtype=args.dtype)
    loaded = load_model(
        cfg.model, cfg.dtype, resolve_device(cfg.device), True, cfg.quantization, None, cfg.quantized_activations
    )
    rows: list[dict] = []
    for name in args.corpora.split(","):
        for order in args.orders.split(","):
            rows += run_corpus(name, order, args, loaded, lambda s: print(s, flush=True))
            if args.out:
                args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}))


if __name__ == "__main__":
    main()
