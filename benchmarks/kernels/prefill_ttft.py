"""Prefill time of one prompt with and without the int8 route (issue 36, item 2): paired, in one process.

The same GGUF is loaded twice, under --quantized-activations int8 (the int8 route from the row count the kernel
choice measured it faster) and int16 (the route before it: 16-bit activations, or q-bf16 past its threshold),
and one prompt of `--tokens` random ids is prefilled in one chunk (the fused step, as a server's first step for
a lone request: the time to the first token, less the scheduler's microseconds), the two loads in alternation,
`--rounds` times; the medians and the ratio of each round's pair are printed. The kernel choice's log line says
which kernel serves which row count. With `--threads 1` the time is the thread's CPU time (time.thread_time):
on a machine other processes load, that is the figure they do not change, where the wall time is theirs too.

    .venv/bin/python -m benchmarks.kernels.prefill_ttft                          # the default model
    .venv/bin/python -m benchmarks.kernels.prefill_ttft --cpu-target x86-64-v3   # the AVX2 build
    .venv/bin/python -m benchmarks.kernels.prefill_ttft \
        --model ~/.cache/pagedllm/real-sizes/llama-3.2-1b-random.Q4_0-gguf.gguf
    .venv/bin/python -m benchmarks.kernels.prefill_ttft --threads 1 --llamacpp ../anchors-work/llamacpp-venv/bin/python

`--int8-on KINDS` (comma-separated: qkv, o, gate_up, down, lm_head) puts only those matmuls of the int8 load on
the int8 route, the rest on the 16-bit one (issue 36 item 2). `--llamacpp PYTHON` adds llama.cpp (the anchor
venv's llama-cpp-python, built for the same class) on the same file and prompt, in its own process that stays
up between rounds: its prompt evaluation (`Llama.eval`, the cache cleared first; one thread runs it in the
calling thread, so `--threads 1` times its thread CPU time too) is the third member of each round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap
import time

if __name__ == "__main__":  # before torch loads: the class to build and measure (cpu_target.py)
    from benchmarks import cpu_target

    cpu_target.select()

import torch

from pagedllm.model import ModelRunner, SeqChunk, load_model
from pagedllm.model.layers.decoder import MATMUL_KINDS

LLAMACPP = textwrap.dedent("""
    import json, sys, time
    from llama_cpp import Llama
    path, threads = sys.argv[1], int(sys.argv[2])
    llm = Llama(path, n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=threads, n_threads_batch=threads,
                verbose=False)
    clock = time.thread_time if threads == 1 else time.perf_counter
    print("ready", flush=True)
    for line in sys.stdin:
        ids = json.loads(line)
        llm.reset()
        t = clock()
        llm.eval(ids)
        print(clock() - t, flush=True)
""")


class LlamaCpp:
    """llama.cpp in its own process (the anchor venv's python): one prompt evaluated per call, its seconds."""

    def __init__(self, python: str, path: str, threads: int):
        self.proc = subprocess.Popen(
            [python, "-c", LLAMACPP, path, str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready", "llama.cpp did not load"

    def prefill(self, ids: list[int]) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(ids) + "\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=0, help="kernel threads (default: torch's)")
    p.add_argument("--llamacpp", default=None, help="the llama.cpp anchor venv's python: time it too")
    p.add_argument(
        "--int8-on", default=None, help=f"the int8 load's route on these only: comma-separated of {MATMUL_KINDS}"
    )
    cpu_target.add_argument(p)
    a = p.parse_args()
    kinds = [k for k in (a.int8_on or "").split(",") if k]
    if bad := set(kinds) - set(MATMUL_KINDS):
        p.error(f"--int8-on: unknown kinds {sorted(bad)}")
    if a.threads:
        torch.set_num_threads(a.threads)
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    routes = ("int8", "int16")
    models = {q: load_model(a.model, a.dtype, verbose=False, quantized_activations=q) for q in routes}
    choice = models["int8"].kernel_choice
    if kinds:  # the others on the 16-bit route (the kernel choice's row count kept)
        chosen = {id(w) for k, ws in models["int8"].model.weights_by_kind().items() if k in kinds for w in ws}
        for w in models["int8"].model.quant_weights():
            w.i8_min_rows = w.i8_min_rows if id(w) in chosen else 0
    blocks = (a.tokens + 15) // 16 + 1
    runners = {q: ModelRunner(m, num_blocks=blocks, block_size=16) for q, m in models.items()}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, models["int8"].config.vocab_size, (a.tokens,), generator=g).tolist()
    llama = None
    if a.llamacpp:
        from pagedllm.model.config import resolve_model_path

        llama = LlamaCpp(a.llamacpp, resolve_model_path(a.model), torch.get_num_threads())
    times: dict[str, list[float]] = {q: [] for q in (*routes, "llama.cpp")}
    for r in range(a.rounds + 1):  # round 0: warm-up
        for q in routes if r % 2 else routes[::-1]:
            t = clock()
            runners[q].execute([SeqChunk(ids, 0, list(range(blocks)))])
            if r:
                times[q].append(clock() - t)
        if llama is not None:
            took = llama.prefill(ids)
            if r:
                times["llama.cpp"].append(took)
    if llama is not None:
        llama.close()
    name = a.model or "the default model"
    kernel = choice.kernel_for(a.tokens) if choice is not None else "?"
    threads = torch.get_num_threads()
    print(
        f"{name}, {models['int8'].dtype}, {a.tokens}-token prompt, {a.rounds} paired rounds, {threads} threads"
        + (" (thread CPU time)" if clock is time.thread_time else " (wall time)")
    )
    print(
        f"  kernel at {a.tokens} rows under int8: {kernel} (int8 from {choice.i8_min_rows if choice else 0} rows",
        end="",
    )
    print(f", on {a.int8_on} only)" if a.int8_on else ")")
    for q in [k for k, v in times.items() if v]:
        print(f"  {q:>9}: median {1e3 * statistics.median(times[q]):8.1f} ms, best {1e3 * min(times[q]):8.1f} ms")
    ratios = [x / y for x, y in zip(times["int8"], times["int16"])]
    print(f"  int8 / int16: median of paired ratios {statistics.median(ratios):.2f}x")
    for q in routes if times["llama.cpp"] else ():
        ratios = [x / y for x, y in zip(times[q], times["llama.cpp"])]
        print(f"  {q} / llama.cpp: median of paired ratios {statistics.median(ratios):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
