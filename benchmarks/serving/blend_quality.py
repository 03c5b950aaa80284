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
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
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
        out.append((f"bound {bound} ({est})", {"kv_blend_max_deviation": float(bound), "estimate": est}))
    return out


def run_corpus(name: str, order: str, args, loaded, log) -> list[dict]:
    from pagedllm.engine import EngineConfig, LLMEngine, blend

    cfg = EngineConfig(dtype=args.dtype, log_stats_interval=0, seed=args.seed)
    ref_engine = LLMEngine(cfg, loaded)
    prompts, priming = build(name, ref_engine.tokenizer, args.prompts, order, args.seed)
    sizes = [e - s for p in prompts for s, e in p.spans]
    log(
        f"{name} {order}: {len(prompts)} prompts of {statistics.mean(len(p.ids) for p in prompts):.0f} tokens, "
        f"{len(sizes) / len(prompts):.1f} passages of {statistics.mean(sizes):.0f} tokens ({min(sizes)}-{max(sizes)})"
    )
    _warm(ref_engine, priming, None)
    ref = measure(ref_engine, prompts, None, None, args.max_tokens)
    rows = [make_blend_row("prefix caching", None, prompts, ref, ref)]
    engine = LLMEngine(cfg, loaded)
    _warm(engine, priming, 1.0)  # every passage stored, exact
    for label, setting in settings(args):
        kw = dict(setting) if isinstance(setting, dict) else setting
        if isinstance(kw, dict):
            blend.ESTIMATE = kw.pop("estimate")
        m = measure(engine, prompts, kw, ref, args.max_tokens)
        row = make_blend_row(label, None, prompts, m, ref)
        rows.append(row)
        log(
            f"  {label:28s} computed {row.computed_tokens:6d}/{row.prompt_tokens}  top-1 {row.top1_agreement:.1%}  "
            f"KL {row.kl_mean:.4f}  identical {row.identical_answers:.0%}  TTFT {row.ttft_vs_prefix:.2f}x"
        )
    return [{"corpus": name, "order": order, **vars(r)} for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpora", default="pydoc,licenses,stdlib")
    ap.add_argument("--orders", default="shuffle,new-front")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--recompute", type=lambda s: [float(x) for x in s.split(",")], default=[0, 0.05, 0.15, 0.3])
    ap.add_argument("--bounds", default="attention:0.02,attention:0.01,kv:0.01", help="estimate:max_deviation,...")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from pagedllm.engine import EngineConfig
    from pagedllm.engine.memory import resolve_device
    from pagedllm.model.loader import load_model

    cfg = EngineConfig(dtype=args.dtype)
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
