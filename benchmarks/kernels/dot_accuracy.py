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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    p.add_argument("--texts", type=int, default=8)
    p.add_argument("--length", type=int, default=256, help="tokens of each text (teacher-forced)")
    p.add_argument("--prompt", type=int, default=32, help="tokens each greedy continuation starts from")
    p.add_argument("--steps", type=int, default=64, help="greedy tokens decoded per text")
    p.add_argument("--route", choices=("int16", "int8"), default="int16", help="the integer route measured")
    p.add_argument("--dtype", default="float32", help="the measured load's --dtype (the reference: float32)")
    cpu_target.add_argument(p)
    a = p.parse_args()
    setting = a.route
    models = {"none": load_model(a.model, "float32", verbose=False, quantized_activations="none")}
    models[a.route] = load_model(a.model, a.dtype, verbose=False, quantized_activations=setting)
    if a.route == "int8":  # at every row count, before the runner's fused step reads it
        for w in models["int8"].model.quant_weights():
            w.i8_min_rows = 1 if w.fmt in I8_FORMATS or w.fmt == "mixed" else 0
    tok = models["none"].tokenizer
    if tok is not None:
        data = texts(tok, a.texts, a.length)
    else:  # a file without a tokenizer: random ids
        g = torch.Generator().manual_seed(0)
        data = torch.randint(100, models["none"].config.vocab_size, (a.texts, a.length), generator=g).tolist()
    blocks = (a.length + a.steps + 15) // 16 + 1
    runners = {q: ModelRunner(m, num_blocks=blocks, block_size=16) for q, m in models.items()}
    kls, agree, same = [], [], 0
    for ids in data:
        ref = torch.log_softmax(logits_of(runners["none"], ids).float(), -1)
        got = torch.log_softmax(logits_of(runners[a.route], ids).float(), -1)
        kls.append((ref.exp() * (ref - got)).sum(-1))
        agree.append((ref.argmax(-1) == got.argmax(-1)).float())
        same += greedy(runners["none"], ids[: a.prompt], a.steps) == greedy(runners[a.route], ids[: a.prompt], a.steps)
    kl, top1 = torch.cat(kls), torch.cat(agree)
    name = a.model or "the default model"
    what = f"{a.route} ({a.dtype}) against float32 activations"
    print(f"{name}: {len(data)} texts x {a.length} positions (teacher-forced), {what}")
    print(f"  KL mean {kl.mean().item():.2e} nats, max {kl.max().item():.2e}; top-1 agreement {100 * top1.mean():.2f}%")
    print(f"  greedy continuations ({a.steps} tokens from {a.prompt}) identical: {same} of {len(data)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
