"""One model's decode on the fused C step against the torch path, in paired rounds in one process (issue 36.1).

Loads the model once, prefills one request of random tokens, then decodes in rounds: each round times `--steps`
decode steps on the fused step, then as many on the torch path (the same weights, the same kernels for the
matmuls and the routed experts; the torch path pays torch's per-op cost around them). The machine is shared, so
the rounds are paired and the medians reported; the ratio is what counts. Tok/s is of the whole engine step;
the runner's share (`runner.execute`) is given too.

    .venv/bin/python -m benchmarks.kernels.fused_vs_torch --model FILE.gguf --steps 16 --rounds 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

if __name__ == "__main__":  # before torch loads: the class to build and measure (cpu_target.py)
    from benchmarks import cpu_target

    cpu_target.select()

from benchmarks.common import cpu_line
from pagedllm import SamplingParams
from pagedllm.engine import EngineConfig, LLMEngine


def run(a) -> dict[str, list[float]]:
    """Per path: each round's (step ms, runner ms), as two lists of per-round means."""
    engine = LLMEngine(
        EngineConfig(model=a.model, dtype=a.dtype, log_stats_interval=0, max_model_len=a.input_len + 1024)
    )
    runner, fused = engine.runner, engine.runner.fused
    if fused is None:
        raise SystemExit("this model does not run the fused step here (see the log line)")
    rng = random.Random(0)
    prompt = [rng.randrange(200, engine.model_config.vocab_size) for _ in range(a.input_len)]
    need = 8 + 2 * a.rounds * a.steps
    engine.add_request("0", prompt, SamplingParams(temperature=0, max_tokens=need + 8, ignore_eos=True))
    for _ in range(8):  # the prefill and a few warm-up decodes (fused)
        engine.step()
    inner = [0.0]
    execute = runner.execute

    def timed(chunks):
        t = time.perf_counter()
        out = execute(chunks)
        inner[0] += time.perf_counter() - t
        return out

    runner.execute = timed
    out: dict[str, list[float]] = {"fused step": [], "fused runner": [], "torch step": [], "torch runner": []}
    for _ in range(a.rounds):
        for path, step in (("fused", fused), ("torch", None)):
            runner.fused, inner[0] = step, 0.0
            t = time.perf_counter()
            for _ in range(a.steps):
                engine.step()
            out[f"{path} step"].append(1e3 * (time.perf_counter() - t) / a.steps)
            out[f"{path} runner"].append(1e3 * inner[0] / a.steps)
    runner.fused = fused
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="GGUF file (its weights kept quantized: the fused step's)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=16, help="decode steps per path per round")
    p.add_argument("--rounds", type=int, default=3)
    cpu_target.add_argument(p)
    a = p.parse_args()
    ms = {k: statistics.median(v) for k, v in run(a).items()}
    print(f"CPU: {cpu_line()}")
    for path in ("fused", "torch"):
        step, inner = ms[f"{path} step"], ms[f"{path} runner"]
        print(f"{path:<6} {1e3 / step:6.2f} tok/s  (step {step:8.2f} ms, runner.execute {inner:8.2f} ms)")
    print(
        f"fused / torch: {ms['torch step'] / ms['fused step']:.2f}x decode tok/s, "
        f"{ms['torch runner'] / ms['fused runner']:.2f}x runner time (medians of {a.rounds} paired rounds)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
