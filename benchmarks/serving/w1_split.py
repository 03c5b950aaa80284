"""Where pagedllm's W1 time goes: steps that compute prompt tokens against decode-only steps.

Runs `pagedllm bench throughput`'s workload (N prompts of random token ids, all submitted at once, greedy,
ignore_eos; the same engine flags as `real_sizes w1` gives it: --max-num-seqs N, --speculative-config none) on
the in-process `LLMEngine`, timing every `engine.step()`. A step is "prefill" when the scheduler gave it any
prompt token (chunked prefill mixes the running requests' decode rows into those steps), "decode-only"
otherwise; the wall time of each kind is summed, with the tokens each computed. The figure to set beside vLLM's
logged prompt / generation throughput. With --phases each kind's time is split further as step_profile.py splits
a decode step: the fused C step's phases (its first thread's clock; matmuls, attention, the rest), the runner's
Python around the C call, and the engine's own work outside `runner.execute` (scheduling, sampling, outputs); on
the torch path (no fused step) only the runner against the engine. docs/benchmarks.md, "pagedllm's W1 time split".

    .venv/bin/python -m benchmarks.serving.w1_split --model FOLDER             # 64 x 256 in / 128 out
    .venv/bin/python -m benchmarks.serving.w1_split --model FOLDER --engine-args "--quantization none"
    .venv/bin/python -m benchmarks.serving.w1_split --model FOLDER --phases    # each kind's time split further
"""

from __future__ import annotations

import argparse
import json
import shlex
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF folder or GGUF file")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--engine-args", default="", help="more `bench throughput` engine flags, as one string")
    p.add_argument("--phases", action="store_true", help="split each kind's time by the fused C step's phases")
    p.add_argument("--out", default=None, help="also write the figures and every step's record to this JSON file")
    a = p.parse_args()

    from pagedllm import LLM, SamplingParams
    from pagedllm.bench.throughput import random_requests
    from pagedllm.engine import EngineConfig
    from pagedllm.entrypoints.cli import build_parser

    argv = ["bench", "throughput", "--model", a.model, "--max-num-seqs", str(a.num_prompts)]
    argv += ["--speculative-config", "none", *shlex.split(a.engine_args)]
    args = build_parser().parse_args(argv)
    llm = LLM(**dict(vars(EngineConfig.from_args(args))))
    engine = llm.engine
    reqs = random_requests(a.num_prompts, a.input_len, a.output_len, 0.0, engine.model_config.vocab_size, args.seed)

    # what each step computes, read from the scheduler's output before the step runs it
    record: dict[str, float] = {}
    schedule = engine.scheduler.schedule

    def counted():
        out = schedule()
        prompt = sum(
            max(0, min(r.num_computed_tokens + n, r.num_prompt_tokens) - r.num_computed_tokens)
            for r, n in out.scheduled
        )
        record.update(rows=out.num_tokens, seqs=len(out.scheduled), prompt=prompt)
        return out

    engine.scheduler.schedule = counted  # type: ignore[method-assign]
    runner, prof = engine.runner, None
    if a.phases:
        import numpy as np

        from pagedllm.model.fused_step import PHASES

        execute = runner.execute

        def timed(chunks):
            t = time.perf_counter()
            try:
                return execute(chunks)
            finally:
                record["runner_s"] = record.get("runner_s", 0.0) + time.perf_counter() - t

        runner.execute = timed  # type: ignore[method-assign]
        if runner.fused is not None:
            prof = runner.fused.profile = np.zeros(len(PHASES))
    for i, (prompt, out_len) in enumerate(reqs):
        params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
        engine.add_request(str(i), prompt, params, prompt_token_ids=engine.encode_prompt(prompt))
    steps: list[dict[str, float]] = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        record.clear()
        before = None if prof is None else prof.copy()
        t = time.perf_counter()
        engine.step()
        steps.append({"s": time.perf_counter() - t, **record})
        if prof is not None and before is not None:
            steps[-1].update(zip(PHASES, (prof - before).tolist()))
    total = time.perf_counter() - start

    pre = [s for s in steps if s.get("prompt", 0) > 0]
    dec = [s for s in steps if s.get("prompt", 0) == 0 and s.get("rows", 0) > 0]

    def tot(group: list[dict[str, float]], key: str) -> float:
        return sum(s.get(key, 0) for s in group)

    n_in, n_out = a.num_prompts * a.input_len, a.num_prompts * a.output_len
    res = {
        "total_s": total,
        "output_tok_s": n_out / total,
        "steps": len(steps),
        "mean_rows": tot(steps, "rows") / len(steps),
        "prefill_steps": len(pre),
        "prefill_s": tot(pre, "s"),
        "prefill_prompt_tokens": tot(pre, "prompt"),
        "prefill_decode_rows": tot(pre, "rows") - tot(pre, "prompt"),
        "prefill_mean_rows": tot(pre, "rows") / max(1, len(pre)),
        "prompt_tok_s_in_prefill_steps": tot(pre, "prompt") / max(1e-9, tot(pre, "s")),
        "decode_steps": len(dec),
        "decode_s": tot(dec, "s"),
        "decode_tokens": tot(dec, "rows"),
        "decode_mean_rows": tot(dec, "rows") / max(1, len(dec)),
        "decode_tok_s_in_decode_steps": tot(dec, "rows") / max(1e-9, tot(dec, "s")),
        "other_s": total - tot(pre, "s") - tot(dec, "s"),
    }
    print(f"{a.model}: W1 {a.num_prompts} x {a.input_len} in / {a.output_len} out ({n_in} in, {n_out} out)")
    print(
        f"total {total:.1f} s, {res['output_tok_s']:.1f} output tok/s; {len(steps)} steps, "
        f"{res['mean_rows']:.1f} rows per step; the first step {steps[0]['s']:.2f} s (no warm-up, as bench throughput)"
    )
    print(
        f"prefill steps: {len(pre)}, {res['prefill_s']:.1f} s ({100 * res['prefill_s'] / total:.0f}%), "
        f"{res['prefill_prompt_tokens']:.0f} prompt tokens + {res['prefill_decode_rows']:.0f} decode rows, "
        f"{res['prefill_mean_rows']:.0f} rows per step, {res['prompt_tok_s_in_prefill_steps']:.1f} prompt tok/s"
    )
    print(
        f"decode-only steps: {len(dec)}, {res['decode_s']:.1f} s ({100 * res['decode_s'] / total:.0f}%), "
        f"{res['decode_tokens']:.0f} tokens, {res['decode_mean_rows']:.1f} rows per step, "
        f"{res['decode_tok_s_in_decode_steps']:.1f} tok/s"
    )
    if a.phases:
        for name, group in (("prefill", pre), ("decode-only", dec)):
            _phases(name, group, tot, prof is not None)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump({**res, "per_step": steps}, f, indent=1)


MATMULS = ("qkv", "o", "gate_up", "down", "lm_head", "experts")  # as step_profile.py: the matmul phases


def _phases(name: str, group: list[dict[str, float]], tot, fused: bool) -> None:
    """One kind's time: matmuls, attention, the C step's other phases, the runner's Python, the engine's."""
    from pagedllm.model.fused_step import PHASES

    wall, runner = tot(group, "s"), tot(group, "runner_s")
    parts = {}
    if fused:
        parts["matmuls"] = sum(tot(group, k) for k in MATMULS)
        parts["attention"] = tot(group, "attention")
        parts["other C phases"] = sum(tot(group, k) for k in PHASES) - parts["matmuls"] - parts["attention"]
        parts["runner Python"] = runner - sum(tot(group, k) for k in PHASES)
    else:
        parts["runner (torch path)"] = runner
    parts["engine"] = wall - runner
    each = ", ".join(f"{k} {v:.1f} s ({100 * v / max(1e-9, wall):.0f}%)" for k, v in parts.items())
    print(f"  {name} {wall:.1f} s: {each}")
    if fused:
        top = sorted(((tot(group, k), k) for k in PHASES), reverse=True)[:5]
        print("    largest C phases: " + ", ".join(f"{k} {v:.1f} s" for v, k in top))


if __name__ == "__main__":
    main()
