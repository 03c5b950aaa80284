"""Prefix caching on a hybrid model (issue 35): on a shared-prefix workload, a Qwen3.5-shaped hybrid (three Gated
DeltaNet layers to one full-attention layer) against its attention-only twin (the same shape, every layer full
attention): the prefix-cache hit rate of each, whether the hybrid's greedy answers equal a run with caching off,
and the time to first token of a prefix hit against a cold request.

The workload: `--prefixes` system prompts of `--prefix` tokens, each followed by `--questions` questions of 48
tokens, 8 tokens decoded greedily; "one by one" sends each request after the previous finished, "in a burst" sends
a prefix's questions together. A hybrid's hit starts from a recurrent-state checkpoint at a block boundary
(kv/state_slots.py). Under --mamba-cache-mode align one exists only where a prompt chunk ended, so the first prompt
of a prefix leaves none at the prefix's end; the second finds the prefix's KV without a state, is cut there and
leaves one; the third hits. Under all the mixers emit the state at every block boundary inside a chunk, so the
second hits. The hybrid runs under each mode of `--mamba-cache-mode`; `--part` picks the hit-rate count (no timing)
or the TTFT pairs (timed: run them alone on the machine).

    python -m benchmarks.kv.hybrid_prefix [--prefix 1000] [--prefixes 3] [--questions 4] [--repeats 5]
        [--mamba-cache-mode align all] [--part hits ttft] [--kv-cache-memory BYTES]

The hit-rate rows also say whether every block and state slot came back when the requests ended, and after a
burst of them aborted two steps in (nothing leaks, also under memory pressure).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from typing import Any

import torch
from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

from pagedllm import SamplingParams
from pagedllm.engine import EngineConfig, LLMEngine

VOCAB = 4096
SHAPE: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=2, head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
    linear_value_head_dim=32, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _save(folder: str, twin: bool) -> str:
    from devkit.tiny_tokenizer import save_tiny_tokenizer

    cfg = Qwen3_5TextConfig(**SHAPE, layer_types=["full_attention"] * 8 if twin else None)
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    save_tiny_tokenizer(folder, VOCAB)
    return folder


def _engine(folder: str, caching: bool, mode: str = "align", memory: int = 2**28) -> LLMEngine:
    config = EngineConfig(
        model=folder, dtype="float32", max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=512,
        kv_cache_memory=memory, enable_prefix_caching=caching, log_stats_interval=0, mamba_cache_mode=mode,
    )  # fmt: skip
    return LLMEngine(config)


def _drain(engine: LLMEngine, done: dict[str, list[int]]) -> None:
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids


def _workload(engine: LLMEngine, groups: list[list[list[int]]], burst: bool) -> tuple[dict[str, list[int]], float]:
    """Every prompt's greedy tokens, and the prefix cache's hit rate over the workload."""
    done: dict[str, list[int]] = {}
    for g, prompts in enumerate(groups):
        for q, p in enumerate(prompts):
            engine.add_request(f"{g}-{q}", p, GREEDY)
            if not burst:
                _drain(engine, done)
        _drain(engine, done)
    st = engine.stats()
    return done, st.prefix_cache_hits / st.prefix_cache_queries


def _ttft(engine: LLMEngine, prompt: list[int], rid: str) -> tuple[float, float]:
    """Seconds to the first token, wall-clock and this process's CPU time (less moved by other processes' load)."""
    t0, c0 = time.perf_counter(), time.process_time()
    engine.add_request(rid, prompt, GREEDY)
    while True:
        if any(out.outputs[0].token_ids for out in engine.step()):
            ttft = time.perf_counter() - t0, time.process_time() - c0
            break
    _drain(engine, {})
    return ttft


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", type=int, default=1000)
    ap.add_argument("--prefixes", type=int, default=3)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mamba-cache-mode", nargs="+", choices=["align", "all"], default=["align", "all"])
    ap.add_argument("--part", nargs="+", choices=["hits", "ttft"], default=["hits", "ttft"])
    ap.add_argument("--kv-cache-memory", type=int, default=2**28, help="bytes (hits: a small one is memory pressure)")
    args = ap.parse_args()
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    groups = [(lambda pre: [pre + tokens(48) for _ in range(args.questions)])(tokens(args.prefix)) for _ in range(3)]
    groups = groups[: args.prefixes]
    hybrid, twin = _save(tempfile.mkdtemp(), False), _save(tempfile.mkdtemp(), True)
    runs = [(f"hybrid, {m}", hybrid, m) for m in args.mamba_cache_mode] + [("twin", twin, "align")]
    n = sum(len(g) for g in groups)
    print(f"{len(groups)} prefixes of {args.prefix} tokens x {args.questions} questions of 48, 8 tokens decoded")
    if "hits" in args.part:
        _hits(runs, hybrid, groups, n, args.kv_cache_memory)
    if "ttft" in args.part:
        _ttfts(runs, args.prefix, args.repeats, tokens)


def _hits(runs: list[tuple[str, str, str]], hybrid: str, groups: list[list[list[int]]], n: int, memory: int) -> None:
    print(
        "| arrival | model, --mamba-cache-mode | hit rate | answers = caching off | blocks, slots back: end / abort |"
    )
    print("|---|---|---|---|---|")
    for burst in (False, True):
        arrival = "in a burst" if burst else "one by one"
        off, _ = _workload(_engine(hybrid, False, memory=memory), groups, burst)
        for name, folder, mode in runs:
            engine = _engine(folder, True, mode, memory)
            got, rate = _workload(engine, groups, burst)
            same = f"{sum(got[k] == off[k] for k in off)}/{n}" if folder == hybrid else "-"
            back = f"{_all_back(engine)} / {_aborted_back(engine, groups)}"
            print(f"| {arrival} | {name} | {rate:.1%} | {same} | {back} |")
    print()


def _all_back(engine: LLMEngine) -> bool:
    """Every block free (cached ones count: evictable) and every state slot back: nothing leaked."""
    kv, rs = engine.kv, engine.kv.recurrent
    slots = rs is None or rs.slots.num_free == rs.slots.num_slots
    held = rs is not None and rs.checkpoints is not None and bool(rs.checkpoints.holds)
    return kv.num_free_blocks == kv.num_blocks and slots and not held


def _aborted_back(engine: LLMEngine, groups: list[list[list[int]]]) -> bool:
    """Every prompt again in a burst, aborted after two steps (prefills, checkpoint holds and waits in flight):
    then everything is back."""
    ids = [f"abort-{g}-{q}" for g, prompts in enumerate(groups) for q in range(len(prompts))]
    for rid, prompt in zip(ids, (p for prompts in groups for p in prompts)):
        engine.add_request(rid, prompt, GREEDY)
    engine.step()
    engine.step()
    for rid in ids:
        engine.abort_request(rid)
    return _all_back(engine)


def _ttfts(runs: list[tuple[str, str, str]], prefix_len: int, repeats: int, tokens: Any) -> None:
    print("| model | cold TTFT, wall / CPU (median) | prefix-hit TTFT, wall / CPU (median) | hit / cold, wall / CPU |")
    print("|---|---|---|---|")
    for name, folder, mode in runs:
        engine = _engine(folder, True, mode)
        prefix = tokens(prefix_len)
        _ttft(engine, prefix + tokens(48), "warm-0")  # under align: leaves no state at the prefix's end ...
        _ttft(engine, prefix + tokens(48), "warm-1")  # ... this one does
        cold, hit = [], []
        for i in range(repeats):  # paired: a cold request, then a hit, in turn (the load moves)
            cold.append(_ttft(engine, tokens(prefix_len + 48), f"cold-{i}"))
            hit.append(_ttft(engine, prefix + tokens(48), f"hit-{i}"))
        (cw, cc), (hw, hc) = ([statistics.median(x[k] for x in pairs) for k in (0, 1)] for pairs in (cold, hit))
        print(
            f"| {name} | {cw * 1000:.0f} / {cc * 1000:.0f} ms | {hw * 1000:.0f} / {hc * 1000:.0f} ms | "
            f"**{hw / cw:.2f}** / {hc / cc:.2f} |"
        )


if __name__ == "__main__":
    main()
