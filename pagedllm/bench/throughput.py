"""`pagedllm bench throughput`: offline throughput (no server), the workload of vLLM's `bench throughput`.

N prompts of random token ids with random input / output lengths, all submitted at once, ignore_eos so every
request generates exactly its output length.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from pagedllm.errors import UserError


def random_requests(
    num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int, seed: int
) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs; lengths uniform in [len * (1 - r), len * (1 + r)]."""
    rng = random.Random(seed)

    def length(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - range_ratio)), int(n * (1 + range_ratio))))

    # Ids from the middle of the vocabulary: ordinary tokens, no special ones.
    lo, hi = min(1000, vocab_size // 4), vocab_size - 1
    return [([rng.randint(lo, hi) for _ in range(length(input_len))], length(output_len)) for _ in range(num_prompts)]


def add_throughput_parser(sub: argparse._SubParsersAction) -> None:
    from pagedllm.engine import add_engine_args

    p = sub.add_parser(
        "throughput",
        help="offline throughput on the in-process engine",
        description="Offline throughput: N random prompts at once through the in-process engine.",
    )
    add_engine_args(p, model_positional=False)
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=64, help="prompts, all submitted at once (default: 64)")
    w.add_argument("--input-len", type=int, default=256, help="tokens per prompt, random ids (default: 256)")
    w.add_argument(
        "--output-len", type=int, default=128, help="tokens generated per prompt, end of text ignored (default: 128)"
    )
    w.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="lengths vary uniformly by this share around --input-len and --output-len (default: 0, all equal)",
    )
    w.add_argument("--output-json", default=None, help="also write the figures to this JSON file (default: none)")
    p.set_defaults(func=run_throughput)


def run_throughput(args: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams
    from pagedllm.engine import EngineConfig

    for flag in ("num_prompts", "input_len", "output_len"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')}: must be at least 1, got {getattr(args, flag)}")
    if not 0 <= args.range_ratio < 1:
        raise UserError(f"--range-ratio: must be in [0, 1), got {args.range_ratio}")
    config = EngineConfig.from_args(args)
    llm = LLM(**{k: v for k, v in vars(config).items()})
    reqs = random_requests(
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.range_ratio,
        llm.engine.model_config.vocab_size,
        args.seed,
    )
    params = [SamplingParams(temperature=0, max_tokens=out, ignore_eos=True) for _, out in reqs]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    elapsed = time.perf_counter() - start
    n_in = sum(len(p) for p, _ in reqs)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {
        "num_prompts": len(reqs),
        "elapsed_s": elapsed,
        "requests_per_s": len(reqs) / elapsed,
        "output_tokens_per_s": n_out / elapsed,
        "total_tokens_per_s": (n_in + n_out) / elapsed,
        "input_tokens": n_in,
        "output_tokens": n_out,
        "dtype": str(llm.engine.loaded.dtype).split(".")[-1],
        "num_preemptions": llm.engine.stats().num_preemptions,
    }
    print(
        f"Throughput: {result['requests_per_s']:.2f} requests/s, {result['total_tokens_per_s']:.1f} total "
        f"tokens/s, {result['output_tokens_per_s']:.1f} output tokens/s  ({len(reqs)} prompts, {n_in} in, "
        f"{n_out} out, {elapsed:.1f} s, {result['dtype']})"
    )
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0
