"""How far the integer routes are from float32 activations: the dot route (--quantized-activations int16,
issue 27 item 3) and the int8 route (issue 36 item 2).

The dot route rounds each group of 32 inputs of every quantized matmul to 16-bit integers, the int8 route to
8-bit ones (llama.cpp's Q8_0 activations); each is a default only where its accuracy is within a stated bound.
This measures it per model: the same GGUF loaded twice (the route, and none), the same texts (Python's own
documentation, pydoc_data.topics, a real-language corpus that needs no download) fed in whole, and at every
position the next-token distributions compared: mean and max KL divergence (nats) and top-1 agreement; then
greedy continuations of the first tokens of each text, decoded one token a step (the decode path), and the share
identical to the float32 activations' token for token. With `--route int8` every matmul of a format the int8
route runs takes it at every row count, decode included (the kernel choice takes it only from the row count
where it is faster: this is the bound's worst case). `--dtype bfloat16` measures a bfloat16 load against the
same float32 reference (q-bf16 past its row count).

    .venv/bin/python -m benchmarks.kernels.dot_accuracy                       # the default model
    .venv/bin/python -m benchmarks.kernels.dot_accuracy \
        --model ~/.cache/pagedllm/real-sizes/llama-3.2-1b-random.Q4_0.gguf
    .venv/bin/python -m benchmarks.kernels.dot_accuracy --route int8
    .venv/bin/python -m benchmarks.kernels.dot_accuracy --route int8 --steps 0 --int8-on qkv --int8-on o

`--int8-on KINDS` (repeatable; KINDS comma-separated of qkv, o, gate_up, down, lm_head) measures the int8 route on
those matmuls only, the others on the 16-bit route: which matmul carries the error (issue 36 item 2). Each
selection is one row of the output, against the same float32 reference.

The stated bounds (docs/benchmarks.md), on the default model: int16 mean KL <= 1e-4 nats and top-1 agreement
>= 99.5% (the default); int8 mean KL <= 5e-3 nats and top-1 agreement >= 95% at every row count (opt-in,
--quantized-activations int8: not transformers' greedy tokens token for token).
"""

from __future__ import annotations

import argparse
import sys

if __name__ == "__main__":  # before torch loads: the class to build and measure (cpu_target.py)
    from benchmarks import cpu_target

    cpu_target.select()

import torch

from pagedllm.model import ModelRunner, SeqChunk, load_model
from pagedllm.model.kernels.quant_linear import I8_FORMATS
from pagedllm.model.layers.decoder import MATMUL_KINDS, CausalLM


def select_int8(net: CausalLM, kinds: set[str] | None) -> None:
    """The int8 route at every row count for the matmuls of `kinds` (None: every weight of a format it runs),
    the 16-bit route for the rest."""
    chosen = {id(w) for k, ws in net.weights_by_kind().items() if kinds is None or k in kinds for w in ws}
    for w in net.quant_weights():
        runs = w.fmt in I8_FORMATS or w.fmt == "mixed"
        w.i8_min_rows = 1 if runs and (kinds is None or id(w) in chosen) else 0


def texts(tokenizer, n: int, length: int) -> list[list[int]]:
    """n passages of Python's documentation, `length` tokens each."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        ids = tokenizer.encode(topics[key])
        if len(ids) >= length:
            out.append(ids[:length])
        if len(out) == n:
            break
    return out


def logits_of(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    table = list(range(runner.num_blocks))
    return runner.execute([SeqChunk(ids, 0, table, all_logits=True)])


def greedy(runner: ModelRunner, prompt: list[int], steps: int) -> list[int]:
    table, seq = list(range(runner.num_blocks)), list(prompt)
    logits = runner.execute([SeqChunk(seq, 0, table)])
    for _ in range(steps):
        seq.append(int(logits[-1].argmax()))
        logits = runner.execute([SeqChunk(seq[-1:], len(seq) - 1, table)])
    return seq[len(prompt) :]


def compare(runners: dict, route: str, data: list[list[int]], a: argparse.Namespace) -> tuple[float, float, float, int]:
    """Mean and max KL (nats), top-1 agreement and greedy continuations identical, `route` against float32."""
    kls, agree, same = [], [], 0
    for ids in data:
        ref = torch.log_softmax(logits_of(runners["none"], ids).float(), -1)
        got = torch.log_softmax(logits_of(runners[route], ids).float(), -1)
        kls.append((ref.exp() * (ref - got)).sum(-1))
        agree.append((ref.argmax(-1) == got.argmax(-1)).float())
        if a.steps:
            same += greedy(runners["none"], ids[: a.prompt], a.steps) == greedy(
                runners[route], ids[: a.prompt], a.steps
            )
    kl, top1 = torch.cat(kls), torch.cat(agree)
    return kl.mean().item(), kl.max().item(), 100 * top1.mean().item(), same


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    p.add_argument("--texts", type=int, default=8)
    p.add_argument("--length", type=int, default=256, help="tokens of each text (teacher-forced)")
    p.add_argument("--prompt", type=int, default=32, help="tokens each greedy continuation starts from")
    p.add_argument("--steps", type=int, default=64, help="greedy tokens decoded per text (0: none)")
    p.add_argument("--route", choices=("int16", "int8"), default="int16", help="the integer route measured")
    p.add_argument("--dtype", default="float32", help="the measured load's --dtype (the reference: float32)")
    p.add_argument(
        "--int8-on", action="append", default=None, help=f"with --route int8: comma-separated of {MATMUL_KINDS}"
    )
    p.add_argument("--no-fused", action="store_true", help="the torch path, not the fused C step")
    cpu_target.add_argument(p)
    a = p.parse_args()
    models = {"none": load_model(a.model, "float32", verbose=False, quantized_activations="none")}
    models[a.route] = load_model(a.model, a.dtype, verbose=False, quantized_activations=a.route)
    selections: list[set[str] | None] = [None]
    if a.int8_on:
        if a.route != "int8":
            p.error("--int8-on needs --route int8")
        selections = [set(k for k in sel.split(",") if k) for sel in a.int8_on]
        if bad := set().union(*selections) - set(MATMUL_KINDS):
            p.error(f"--int8-on: unknown kinds {sorted(bad)}")
    tok = models["none"].tokenizer
    if tok is not None:
        data = texts(tok, a.texts, a.length)
    else:  # a file without a tokenizer: random ids
        g = torch.Generator().manual_seed(0)
        data = torch.randint(100, models["none"].config.vocab_size, (a.texts, a.length), generator=g).tolist()
    blocks = (a.length + a.steps + 15) // 16 + 1
    name = a.model or "the default model"
    print(f"{name}: {len(data)} texts x {a.length} positions (teacher-forced), {a.route} ({a.dtype}) vs float32")
    for sel in selections:
        if a.route == "int8":  # at every row count, before the runner's fused step reads it
            select_int8(models["int8"].model, sel)
        runners = {q: ModelRunner(m, num_blocks=blocks, block_size=16, fused=not a.no_fused) for q, m in models.items()}
        kl, kl_max, top1, same = compare(runners, a.route, data, a)
        what = "every matmul" if sel is None else "int8 on " + ",".join(sorted(sel))
        print(f"  {what}: KL mean {kl:.2e} nats, max {kl_max:.2e}; top-1 agreement {top1:.2f}%", end="")
        print(f"; greedy ({a.steps} from {a.prompt}) identical: {same} of {len(data)}" if a.steps else "", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
