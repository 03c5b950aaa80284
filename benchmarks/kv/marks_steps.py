"""A hybrid model's steps that leave prefix-cache checkpoints inside their prompt chunks (state marks,
--mamba-cache-mode all: the state at every block boundary) on the torch path, as the runner ran them before the
fused C step wrote states at marks, against the fused C step; and the time to first token of a cold prompt under
--mamba-cache-mode all (either way) against none (no checkpoints, every step fused).

The workload (hybrid_prefix.py's): a system prompt of `--prefix` tokens followed by `--questions` questions of 48,
sent one after the other, 8 tokens decoded greedily: the first prompt marks every block boundary of its chunks;
each later one hits at the system prompt's last full block and marks the boundaries of its tail. Each round takes
a new system prompt through two engines on the same loaded weights, one whose marked steps run the torch path
("before") and one whose steps all run fused ("after"), in turn; only the steps with marks are timed (wall
clock around `ModelRunner.execute`). Then `--repeats` cold prompts of prefix + 48 tokens per engine, in turn:
mode none (fused), all before, all after. Run it alone on the machine (the bench lock).

    python -m benchmarks.kv.marks_steps [--hybrid qwen3.5-2b@8] [--root DIR] [--quantization int8]
        [--prefix 1000] [--questions 3] [--rounds 3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from typing import Any, Literal

if __name__ == "__main__":  # before torch loads: the class to build and measure (cpu_target.py)
    from benchmarks import cpu_target

    cpu_target.select()

from benchmarks.common import cpu_line
from benchmarks.kernels.fused_vs_torch import hybrid_folder
from pagedllm import SamplingParams
from pagedllm.engine import EngineConfig, LLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


class Timed:
    """An engine whose runner's steps with state marks are timed, and run on the torch path when `torch_marks`
    (the runner's fallback before this change); steps without marks run fused either way."""

    def __init__(self, engine: LLMEngine, torch_marks: bool) -> None:
        self.engine = engine
        self.marked: list[tuple[int, float]] = []  # each step with marks: its tokens, its seconds
        runner, execute, fused = engine.runner, engine.runner.execute, engine.runner.fused

        def run(chunks: list[Any]) -> Any:
            if not any(c.state_marks for c in chunks):
                return execute(chunks)
            runner.fused = None if torch_marks else fused
            t = time.perf_counter()
            try:
                return execute(chunks)
            finally:
                self.marked.append((sum(len(c.token_ids) for c in chunks), time.perf_counter() - t))
                runner.fused = fused

        runner.execute = run

    def send(self, rid: str, prompt: list[int]) -> float:
        """Seconds to the prompt's first token; runs it to its end."""
        t0, first = time.perf_counter(), None
        self.engine.add_request(rid, prompt, GREEDY)
        while self.engine.has_unfinished_requests():
            outs = self.engine.step()
            if first is None and any(o.outputs[0].token_ids for o in outs):
                first = time.perf_counter() - t0
        assert first is not None
        return first


def _engine(loaded: Any, mode: Literal["none", "align", "all"], budget: int) -> LLMEngine:
    config = EngineConfig(
        max_model_len=4096, max_num_seqs=4, max_num_batched_tokens=512, kv_cache_memory=budget,
        log_stats_interval=0, mamba_cache_mode=mode,
    )  # fmt: skip
    engine = LLMEngine(config, loaded)
    if engine.runner.fused is None:
        raise SystemExit("this model does not run the fused step here (see the log line)")
    return engine


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hybrid", default="qwen3.5-2b@8", help="NAME@L of fused_vs_torch.HYBRID_SHAPES")
    p.add_argument("--root", default="~/.cache/pagedllm/real-sizes", help="where the random folder is written")
    p.add_argument("--quantization", default="int8")
    p.add_argument("--prefix", type=int, default=1000)
    p.add_argument("--questions", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-cache-memory", type=int, default=2**30)
    cpu_target.add_argument(p)
    a = p.parse_args()
    from pagedllm.model import load_model

    loaded = load_model(hybrid_folder(a.hybrid, a.root), "auto", "cpu", False, a.quantization)
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, loaded.config.vocab_size) for _ in range(n)]

    paths = {"all, marks on torch": Timed(_engine(loaded, "all", a.kv_cache_memory), True)}
    paths["all, marks fused"] = Timed(_engine(loaded, "all", a.kv_cache_memory), False)
    rounds: dict[str, list[list[tuple[int, float]]]] = {k: [] for k in paths}
    for r in range(a.rounds):
        prefix = tokens(a.prefix)
        questions = [prefix + tokens(48) for _ in range(a.questions)]
        for name, timed in paths.items():
            timed.marked = []
            for q, prompt in enumerate(questions):
                timed.send(f"{r}-{q}", prompt)
            rounds[name].append(timed.marked)
    print(f"CPU: {cpu_line()}")
    print(f"{a.hybrid} {a.quantization}: a prefix of {a.prefix} + {a.questions} questions of 48, {a.rounds} rounds")
    _table(rounds)
    _cold(loaded, paths, a, tokens)
    return 0


def _table(rounds: dict[str, list[list[tuple[int, float]]]]) -> None:
    """Each step with marks of a round (the same steps on both paths), its median time per path over the rounds,
    and the round's total."""
    torch_runs, fused_runs = rounds.values()
    assert [[n for n, _ in run] for run in torch_runs] == [[n for n, _ in run] for run in fused_runs]
    print("| step with marks | tokens | marks on torch | marks fused | torch / fused |")
    print("|---|---|---|---|---|")
    steps = [(str(i + 1), n) for i, (n, _) in enumerate(torch_runs[0])] + [("all", 0)]
    for i, (name, n) in enumerate(steps):
        per = [
            statistics.median(sum(t for _, t in run) if name == "all" else run[i][1] for run in runs) * 1e3
            for runs in (torch_runs, fused_runs)
        ]
        tok = sum(m for m, _ in torch_runs[0]) if name == "all" else n
        print(f"| {name} | {tok} | {per[0]:.0f} ms | {per[1]:.0f} ms | {per[0] / per[1]:.2f}x |")


def _cold(loaded: Any, paths: dict[str, Timed], a: Any, tokens: Any) -> None:
    """Cold prompts of prefix + 48 tokens, one engine after the other in turn: their TTFT medians."""
    engines = {"none": Timed(_engine(loaded, "none", a.kv_cache_memory), False)} | paths
    ttft: dict[str, list[float]] = {k: [] for k in engines}
    for i in range(a.repeats):
        for name, timed in engines.items():
            ttft[name].append(timed.send(f"cold-{i}", tokens(a.prefix + 48)))
    none = statistics.median(ttft["none"])
    print(f"\n| --mamba-cache-mode | cold TTFT, {a.prefix + 48} tokens (median of {a.repeats}) | against none |")
    print("|---|---|---|")
    for name, got in ttft.items():
        print(f"| {name} | {statistics.median(got) * 1e3:.0f} ms | {statistics.median(got) / none:.2f}x none |")


if __name__ == "__main__":
    sys.exit(main())
