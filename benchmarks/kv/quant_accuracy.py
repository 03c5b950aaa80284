"""What a quantized KV cache costs in accuracy and buys in speed: the same passages with a float32 cache and with
each quantized --kv-cache-dtype, side by side in one process.

    .venv/bin/python -m benchmarks.kv.quant_accuracy [--passages 32 --tokens 1024 --decode-context 4096]

Texts: `--passages` windows of `--tokens` tokens from the RAG corpus (`pydoc_data.topics`): the first window of
each topic that long, longest topic first, then the second windows, and so on (26 topics have 1,024 tokens), run
through the default model (float32 activations) in chunks of 512 tokens as the engine prefills them, so every
chunk after the first reads the earlier ones from the cache. For each dtype against the float32 cache: the mean
KL divergence of the next-token distributions (KL(float32 || quantized), nats, over every position), the
perplexity of the passages' own next tokens and its change, the greedy top-1 agreement, and how many of the
disagreements are near-ties of the reference (its top two within NEAR_TIE nats of each other). With
/work/anchors-work/llamacpp-venv present, the same token ids through llama.cpp on the same GGUF with its f32 and
q8_0 caches (type_k / type_v; a q8_0 V cache needs flash attention, so both runs use it).

Then decode speed at a long context: one sequence with `--decode-context` cached tokens, `--decode-steps` decode
steps timed per dtype, interleaved, best of three rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from pagedllm.model.kernels.kv_quant import QUANT_KV_DTYPES
from pagedllm.model.loader import load_model
from pagedllm.model.runner import ModelRunner, SeqChunk
from pagedllm.rag.corpus import default_corpus

LLAMACPP_PY = "/work/anchors-work/llamacpp-venv/bin/python"
DTYPES = {"float32": torch.float32, **{k: v for k, v in QUANT_KV_DTYPES.items() if k != "fp8"}}


def passages(tokenizer, count: int, tokens: int) -> list[list[int]]:
    docs = [tokenizer.encode(d.text) for d in sorted(default_corpus(), key=lambda d: -len(d.text))]
    windows = [
        ids[k * tokens : (k + 1) * tokens]
        for k in range(max(map(len, docs)) // tokens)
        for ids in docs
        if len(ids) >= (k + 1) * tokens
    ]
    return windows[:count]


def all_logits(loaded, kv_dtype: torch.dtype, ids: list[int], chunk: int = 512) -> torch.Tensor:
    blocks = -(-len(ids) // 16)
    runner = ModelRunner(loaded, blocks, 16, kv_dtype)
    table = list(range(blocks))
    return torch.cat(
        [runner.execute([SeqChunk(ids[s : s + chunk], s, table, all_logits=True)]) for s in range(0, len(ids), chunk)]
    )


NEAR_TIE = 0.05  # nats between the reference's top two next tokens


class Tally:
    """Sums over positions: KL to the reference, negative log-likelihood of the next token, top-1 agreement, and
    the disagreements at a near-tie of the reference."""

    def __init__(self) -> None:
        self.kl = self.nll = self.agree = self.near_ties = 0.0
        self.n = 0

    def add(self, ref_logp: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
        logp = logits[:-1].float().log_softmax(-1)
        self.kl += (ref_logp.exp() * (ref_logp - logp)).sum().item()
        self.nll -= logp.gather(1, targets[:, None]).sum().item()
        same = ref_logp.argmax(-1) == logp.argmax(-1)
        self.agree += same.sum().item()
        top2 = ref_logp.topk(2, -1).values
        self.near_ties += (~same & (top2[:, 0] - top2[:, 1] < NEAR_TIE)).sum().item()
        self.n += len(targets)

    def row(self, name: str, ref_ppl: float) -> dict:
        ppl = float(torch.tensor(self.nll / self.n).exp())
        return {
            "cache": name,
            "mean_kl": self.kl / self.n,
            "ppl": ppl,
            "ppl_change": ppl / ref_ppl - 1,
            "top1_agreement": self.agree / self.n,
            "positions": self.n,
            "near_tie_share": self.near_ties / max(1, self.n - self.agree),
        }


def accuracy(loaded, texts: list[list[int]]) -> list[dict]:
    tallies = {name: Tally() for name in DTYPES}
    for i, ids in enumerate(texts):
        targets = torch.tensor(ids[1:])
        ref = all_logits(loaded, torch.float32, ids)
        ref_logp = ref[:-1].log_softmax(-1)
        for name, dtype in DTYPES.items():  # float32 against itself: KL 0, agreement 1, the reference perplexity
            tallies[name].add(ref_logp, ref if name == "float32" else all_logits(loaded, dtype, ids), targets)
        print(f"passage {i + 1}/{len(texts)}", file=sys.stderr)
    ref_ppl = float(torch.tensor(tallies["float32"].nll / tallies["float32"].n).exp())
    return [t.row(name, ref_ppl) for name, t in tallies.items()]


LLAMACPP_SCRIPT = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
path, texts = sys.argv[1], json.load(open(sys.argv[2]))
def run(t):
    llm = Llama(model_path=path, n_ctx=max(map(len, texts)) + 8, logits_all=True, type_k=t, type_v=t,
                flash_attn=True, n_threads=2, n_batch=512, verbose=False)
    out = []
    for ids in texts:
        llm.reset()
        llm.eval(ids)
        x = np.array(llm.scores[:len(ids) - 1], dtype=np.float64)
        out.append(x - np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True)) - x.max(1, keepdims=True))
    return out
ref, q8 = run(0), run(8)  # GGML_TYPE_F32, GGML_TYPE_Q8_0
kl = nll_r = nll_q = agree = n = 0.0
for r, q, ids in zip(ref, q8, texts):
    t = np.array(ids[1:])
    kl += (np.exp(r) * (r - q)).sum(); agree += (r.argmax(1) == q.argmax(1)).sum(); n += len(t)
    nll_r -= r[np.arange(len(t)), t].sum(); nll_q -= q[np.arange(len(t)), t].sum()
print(json.dumps({"mean_kl": kl / n, "ppl_f32": float(np.exp(nll_r / n)), "ppl_q8_0": float(np.exp(nll_q / n)),
                  "top1_agreement": agree / n, "positions": n}))
"""


def llamacpp(gguf: str, texts: list[list[int]]) -> dict | None:
    probe = [LLAMACPP_PY, "-c", "import llama_cpp, numpy"]
    if not os.path.exists(LLAMACPP_PY) or subprocess.run(probe, capture_output=True).returncode != 0:
        print(f"llama.cpp: no llama_cpp + numpy in {LLAMACPP_PY}, its q8_0 rows are left out", file=sys.stderr)
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(texts, f)
    try:
        out = subprocess.run(
            [LLAMACPP_PY, "-c", LLAMACPP_SCRIPT, gguf, f.name], capture_output=True, text=True, timeout=3600
        )
    finally:
        os.unlink(f.name)
    if out.returncode != 0:
        print(f"llama.cpp run failed: {out.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def decode_speed(loaded, context: int, steps: int) -> dict[str, float]:
    """Seconds per decode step at `context` cached tokens, per dtype, best of three interleaved rounds."""
    blocks = -(-(context + steps + 1) // 16)
    ids = [(i * 7919) % 20000 + 300 for i in range(context + steps)]
    runners = {
        name: ModelRunner(loaded, blocks, 16, dtype)
        for name, dtype in DTYPES.items()
        if name in ("float32", "int8", "fp8_e4m3")
    }
    table = list(range(blocks))
    for runner in runners.values():
        for s in range(0, context, 512):
            runner.execute([SeqChunk(ids[s : min(s + 512, context)], s, table)])
    best = {name: float("inf") for name in runners}
    for _ in range(3):
        for name, runner in runners.items():
            t0 = time.perf_counter()
            for k in range(steps):
                runner.execute([SeqChunk(ids[context + k : context + k + 1], context + k, table)])
            best[name] = min(best[name], (time.perf_counter() - t0) / steps)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passages", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--decode-context", type=int, default=4096)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--no-llamacpp", action="store_true")
    args = ap.parse_args()
    loaded = load_model(None, "float32")
    texts = passages(loaded.tokenizer, args.passages, args.tokens)
    print(f"{len(texts)} passages x {args.tokens} tokens, float32 activations, {torch.get_num_threads()} threads")
    print(
        f"| KV cache | mean KL (nats) | perplexity | change | greedy top-1 agreement | disagreements at a "
        f"near-tie (< {NEAR_TIE} nats) |\n|---|---|---|---|---|---|"
    )
    for r in accuracy(loaded, texts):
        print(
            f"| pagedllm {r['cache']} | {r['mean_kl']:.2e} | {r['ppl']:.3f} | {r['ppl_change']:+.2%} | "
            f"{r['top1_agreement']:.2%} | {r['near_tie_share']:.0%} |"
        )
    q8 = None if args.no_llamacpp else llamacpp(loaded.path, texts)
    if q8 is not None:
        print(f"| llama.cpp f32 | 0 | {q8['ppl_f32']:.3f} | | |")
        print(
            f"| llama.cpp q8_0 | {q8['mean_kl']:.2e} | {q8['ppl_q8_0']:.3f} | "
            f"{q8['ppl_q8_0'] / q8['ppl_f32'] - 1:+.2%} | {q8['top1_agreement']:.2%} |"
        )
    speed = decode_speed(loaded, args.decode_context, args.decode_steps)
    print(
        f"\ndecode at a {args.decode_context}-token context, one sequence, ms per step (best of 3): "
        + ", ".join(f"{name} {1000 * s:.2f} ({speed['float32'] / s:.2f}x float32's speed)" for name, s in speed.items())
    )


if __name__ == "__main__":
    main()
