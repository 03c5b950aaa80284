"""Where a one-sequence decode step's time goes: matmuls, attention, and everything else.

Runs `LLMEngine.step()` in a loop on one request (256 random prompt tokens, then decode, EOS ignored), and
splits each decode step into: the fused C step's phases (its first thread's clock between the barriers that
end each phase: the matmuls, attention, and the rest: norms, RoPE + KV write, silu * up), the runner's Python
around the C call, and the engine's own work (scheduling, sampling, detokenizing, outputs). The issue's target
is "outside matmuls + attention" at most 20% of the step.

    .venv/bin/python -m benchmarks.kernels.step_profile                     # --dtype auto, 128 decode steps
    .venv/bin/python -m benchmarks.kernels.step_profile --dtype float32 --no-fused   # the torch path, step time only
    .venv/bin/python -m benchmarks.kernels.step_profile --cpu-target x86-64-v3      # the AVX2 build of the kernels

It also measures the machine's read bandwidth (roofline.py) and reports the matmuls' effective GB/s against it:
the weights' bytes over the matmul phases' time, since one sequence's step reads every weight once.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

if __name__ == "__main__":  # before torch loads: the class to build and measure (cpu_target.py)
    from benchmarks import cpu_target

    cpu_target.select()

import numpy as np

from benchmarks.common import cpu_line
from benchmarks.kernels.roofline import read_bandwidth_gbs
from pagedllm import SamplingParams
from pagedllm.engine import EngineConfig, LLMEngine
from pagedllm.model.fused_step import PHASES

MATMULS = ("qkv", "o", "gate_up", "down", "lm_head", "experts")  # experts: a sparse layer's routed ones


def run(a) -> dict[str, float]:
    engine = LLMEngine(
        EngineConfig(
            model=a.model,
            dtype=a.dtype,
            quantization=a.quantization,
            quantized_activations=a.quantized_activations,
            log_stats_interval=0,
            max_model_len=2048,
        )
    )
    runner = engine.runner
    if a.no_fused:
        runner.fused = None
    rng = random.Random(0)
    for i in range(a.batch):
        prompt = [rng.randrange(200, engine.model_config.vocab_size) for _ in range(a.input_len)]
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=a.steps + 8, ignore_eos=True))
    while min(r.num_output_tokens for r in engine.requests.values()) < 4:  # prefills and a few warm-up decodes
        engine.step()
    inner = [0.0]
    execute = runner.execute

    def timed(chunks):
        t = time.perf_counter()
        out = execute(chunks)
        inner[0] += time.perf_counter() - t
        return out

    runner.execute = timed
    if runner.fused is not None:
        runner.fused.profile = np.zeros(len(PHASES))
    load = runner.model.expert_load
    reads = load.reads[0]
    t = time.perf_counter()
    for _ in range(a.steps):
        engine.step()
    total = time.perf_counter() - t
    out = {"step": total, "runner": inner[0]}
    if runner.fused is not None:
        out.update(dict(zip(PHASES, runner.fused.profile.tolist())))
    ms = {k: 1e3 * v / a.steps for k, v in out.items()}
    ms.update(_bytes_read(runner.model, (load.reads[0] - reads) / a.steps) if runner.fused is not None else {})
    return ms


def _bytes_read(model, expert_reads: float) -> dict[str, float]:
    """What a step's matmuls read: every quantized weight but the experts, and of a sparse layer's experts the
    ones it routed to (`expert_reads` per step, the engine's counter: each active expert's weights once)."""
    kernels = [layer.moe.kernel for layer in model.decoder_layers if layer.moe is not None and layer.moe.kernel]
    experts = {id(w) for k in kernels for w in (*k.gate_up, *k.down)}
    dense = sum(w.nbytes for w in model.quant_weights() if id(w) not in experts)
    per_expert = sum(k.nbytes for k in kernels) / max(1, sum(len(k.gate_up) for k in kernels))
    every = sum(len(k.gate_up) for k in kernels)
    return {"weight_bytes": dense + expert_reads * per_expert, "expert_reads": expert_reads, "experts_total": every}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file or folder (default: the default model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantized-activations", default="auto", choices=["auto", "int16", "none"])
    p.add_argument("--quantization", default=None)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--batch", type=int, default=1, help="sequences decoding together (rows per step)")
    p.add_argument("--no-fused", action="store_true", help="the torch path (ModelRunner without the C step)")
    cpu_target.add_argument(p)
    a = p.parse_args()
    ms = run(a)
    print(f"CPU: {cpu_line()}")
    step = ms["step"]
    print(
        f"decode step of {a.batch} sequence(s), {a.input_len} prompt tokens each, mean of {a.steps} steps: "
        f"{step:.3f} ms ({a.batch * 1e3 / step:.1f} tok/s); runner.execute {ms['runner']:.3f} ms, engine outside it "
        f"{step - ms['runner']:.3f} ms"
    )
    if "qkv" not in ms:
        return 0
    c_total = sum(ms[k] for k in PHASES)
    matmul = sum(ms[k] for k in MATMULS)
    for k in PHASES:
        print(f"  {k:<16}{ms[k]:8.3f} ms  {ms[k] / step:6.1%}")
    rest = step - matmul - ms["attention"]
    print(
        f"  {'runner Python':<16}{ms['runner'] - c_total:8.3f} ms  {(ms['runner'] - c_total) / step:6.1%}  "
        "(arrays, ctypes, embedding lookup)"
    )
    print(f"  {'engine':<16}{step - ms['runner']:8.3f} ms  {(step - ms['runner']) / step:6.1%}")
    print(
        f"matmuls {matmul:.3f} ms + attention {ms['attention']:.3f} ms = {(matmul + ms['attention']) / step:.1%}; "
        f"everything else {rest:.3f} ms = {rest / step:.1%} of the step (target <= 20%)"
    )
    if ms["experts_total"]:
        print(f"experts read per step: {ms['expert_reads']:.1f} of {ms['experts_total']:.0f} (routed, all layers)")
    gbs, bw = ms["weight_bytes"] / matmul / 1e6, read_bandwidth_gbs()
    print(
        f"matmuls read {ms['weight_bytes'] / 2**20:.1f} MiB of weights in {matmul:.3f} ms: {gbs:.1f} GB/s = "
        f"{gbs / bw:.0%} of the measured read bandwidth ({bw:.1f} GB/s, roofline.py)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
