"""The fused C step's Gated DeltaNet recurrence alone (recurrent.c's rec_scan items of one layer), token loop
against the chunked scan, and the recurrence's share of a whole fused-step prefill.

The recurrence: `rec_scan_as` called for every (sequence, value head) item of one layer over a prompt chunk of
--tokens tokens from a carried state, on random rows (the conv's q, k, v, the projections' z, b, a), by the token
loop (`deltanet_token` per token) and by the chunked scan (64-token chunks). Shapes: transformers'
Qwen3_5TextConfig defaults (16 key heads, 32 value heads of 128) and Qwen3.5-2B's (16 and 16 of 128,
real_sizes.py's `qwen3.5-2b`). One thread, CPU time (process time), median of --repeat after one warm-up.

The share: one prefill step of --tokens tokens (the whole prompt in one step, no prefix caching) of a
random-weight Qwen3.5-2B-shaped model's first --layers layers (fused_vs_torch.hybrid_folder, int8 weights; three
Gated DeltaNet layers to each full-attention one), CPU time of `LLMEngine.step()` against its linear layers'
recurrence as measured alone; --no-share skips it (it writes a ~1 GB folder under ~/.cache/pagedllm/real-sizes
once).

--mamba2: Mamba2's recurrence alone instead, per (sequence, head) item, by the token loop (`mamba2_token`) and
by the SSD form (`mamba2_chunked`, 64-token chunks), at Granite-4.0-H-Tiny's shape (48 heads of 64, state 128,
one group) and Nemotron-H-8B's (128 heads of 64, state 128, 8 groups; benchmarks/kv/state_bytes.py's configs).

    .venv/bin/python -m benchmarks.kernels.recurrent_scan
    .venv/bin/python -m benchmarks.kernels.recurrent_scan --tokens 64 128 --no-share
    .venv/bin/python -m benchmarks.kernels.recurrent_scan --cpu-target x86-64-v3 --no-share
    .venv/bin/python -m benchmarks.kernels.recurrent_scan --mamba2 --tokens 8 16 64 256 1024
"""

from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import time

if __name__ == "__main__":  # before torch loads: the class to build and measure (cpu_target.py)
    from benchmarks import cpu_target

    cpu_target.select()

import numpy as np

from benchmarks.common import cpu_line
from pagedllm.model.kernels import cpu_kernel

MIX_GATED_DELTANET, MIX_MAMBA2 = 0, 1  # recurrent.h's RecMixer.kind
SHAPES = {"Qwen3_5TextConfig defaults": (16, 32, 128), "Qwen3.5-2B": (16, 16, 128)}  # key heads, value heads, dim
# heads, head dim, state size, groups (benchmarks/kv/state_bytes.py's configs)
MAMBA2_SHAPES = {"Granite-4.0-H-Tiny": (48, 64, 128, 1), "Nemotron-H-8B": (128, 64, 128, 8)}


def step_rows(
    rng: np.random.Generator, T: int, width: int, conv_dim: int, out_k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A step's rows as recurrent.h lays them out (raw, canonical, conv, out, one after the other), the raw and
    conv rows random: (all the rows, the conv rows [T, conv_dim], the out rows [T, out_k])."""
    rows = np.zeros(T * (2 * width + conv_dim + out_k), np.float32)
    rows[: T * width] = rng.standard_normal(T * width)
    conv = rows[2 * T * width : 2 * T * width + T * conv_dim].reshape(T, conv_dim)
    conv[:] = rng.standard_normal((T, conv_dim))
    return rows, conv, rows[-T * out_k :].reshape(T, out_k)


class DeltaNetScan:
    """One Gated DeltaNet layer's rec_scan items over given sequences, on random rows: RecMixer and RecStep as
    model_step.c hands them to recurrent.c (no permutation: the raw rows are the canonical ones).

    `lens`: each sequence's tokens in this chunk; `marks`: per sequence, the offsets after which its state is also
    written to a row of its own (RecStep's marks); `carried`: the sequences start from a random state (positions
    past 0) instead of zeros. `dk`: the key head dim (default: `dim`, also the value head's)."""

    def __init__(
        self,
        key_heads: int,
        value_heads: int,
        dim: int,
        lens: list[int],
        marks: list[list[int]] | None = None,
        carried: bool = True,
        seed: int = 0,
        dk: int | None = None,
    ) -> None:
        self.lib = cpu_kernel.load()
        if self.lib is None:
            raise RuntimeError("the CPU kernels could not be built here")
        rng = np.random.default_rng(seed)
        dk = dk or dim
        heads, dv, S = value_heads, dim, len(lens)
        marks = marks or [[] for _ in lens]
        key, value = key_heads * dk, heads * dv
        conv_dim, self.T = 2 * key + value, sum(lens)
        width = conv_dim + value + 2 * heads
        self.items = S * heads
        self.slots = S + sum(len(m) for m in marks)
        f32 = np.float32
        self.rows, conv, self.out = step_rows(rng, self.T, width, conv_dim, value)
        conv[:, : 2 * key] = np.log1p(np.exp(conv[:, : 2 * key]))  # q, k after silu: mostly positive, correlated
        self.state0 = (rng.standard_normal((self.slots, heads, dk, dv)) * 0.1).astype(f32)
        self.state = self.state0.copy()
        self._keep = [
            a_log := rng.uniform(-2, 1, heads).astype(f32),  # spread as a trained model's (hybrid_folder)
            dt_bias := (rng.standard_normal(heads) * 0.5).astype(f32),
            norm := (1 + 0.1 * rng.standard_normal(dv)).astype(f32),
        ]
        fields = dict(kind=MIX_GATED_DELTANET, width=width, conv_dim=conv_dim, kernel=4, heads=heads)
        mixer = cpu_kernel.c_structs("recurrent.h")["RecMixer"](
            **fields,
            groups=key_heads,
            dk=dk,
            dv=dv,
            out_k=value,
            a_log=a_log.ctypes.data,
            dt_bias=dt_bias.ctypes.data,
            norm=norm.ctypes.data,
            eps=1e-6,
            rec_state=self.state.ctypes.data,
            slots=self.slots,
        )
        self._set_step(mixer, lens, marks, carried)

    def _set_step(self, mixer: ctypes.Structure, lens: list[int], marks: list[list[int]], carried: bool) -> None:
        """The RecStep of these sequences and marks over self.rows, and a thread's scan scratch for `mixer`."""
        S = len(lens)
        self._keep += [
            first := np.cumsum([0, *lens[:-1]]).astype(np.int64),
            lens_a := np.array(lens, np.int64),
            slot := np.arange(S, dtype=np.int64),
            positions := np.concatenate([np.arange(n) + (7 if carried else 0) for n in lens]).astype(np.int64),
            mark_first := np.cumsum([0, *[len(m) for m in marks]]).astype(np.int64),
            mark_at := np.array([a for m in marks for a in m], np.int64),
            mark_row := np.arange(S, self.slots, dtype=np.int64),
        ]
        step = cpu_kernel.c_structs("recurrent.h")["RecStep"](
            first=first.ctypes.data,
            len=lens_a.ctypes.data,
            slot=slot.ctypes.data,
            positions=positions.ctypes.data,
            T=self.T,
            S=S,
            rows=self.rows.ctypes.data,
            mark_first=mark_first.ctypes.data if len(mark_at) else None,
            mark_at=mark_at.ctypes.data if len(mark_at) else None,
            mark_row=mark_row.ctypes.data if len(mark_at) else None,
        )
        self.mixer, self.step = mixer, step
        # a thread's scan scratch, 64-byte aligned, as model_step.c allocates it
        size = self.lib.rec_scratch_bytes(ctypes.addressof(mixer))
        self._scratch = np.zeros(size + 64, np.uint8)
        self._args = ctypes.addressof(mixer), ctypes.addressof(step)
        self._scratch_at = self._scratch.ctypes.data + (-self._scratch.ctypes.data) % 64

    def run(self, chunked: bool) -> tuple[np.ndarray, np.ndarray]:
        """Every item from the starting states, by the chunked scan or the token loop: the mixer's output rows
        (after the gated norm) and every state row (the slots, then the marks' rows), as copies."""
        self.state[:] = self.state0
        self.scan(chunked)
        return self.out.copy(), self.state.copy()

    def scan(self, chunked: bool) -> None:
        """The layer's items once, advancing the states in place (what a timing repeats)."""
        for i in range(self.items):
            self.lib.rec_scan_as(*self._args, i, int(chunked), self._scratch_at)


class Mamba2Scan(DeltaNetScan):
    """One Mamba2 layer's rec_scan items, as DeltaNetScan's: `heads` heads of `head_dim` channels, a state of
    `state` per channel, B and C in `groups` groups (heads / groups heads share one); `lens`, `marks`, `carried`
    as DeltaNetScan's."""

    def __init__(
        self,
        heads: int,
        head_dim: int,
        state: int,
        groups: int,
        lens: list[int],
        marks: list[list[int]] | None = None,
        carried: bool = True,
        seed: int = 0,
    ) -> None:
        self.lib = cpu_kernel.load()
        if self.lib is None:
            raise RuntimeError("the CPU kernels could not be built here")
        rng = np.random.default_rng(seed)
        S, inner = len(lens), heads * head_dim
        marks = marks or [[] for _ in lens]
        conv_dim, self.T = inner + 2 * groups * state, sum(lens)
        width = inner + conv_dim + heads
        self.items = S * heads
        self.slots = S + sum(len(m) for m in marks)
        f32 = np.float32
        self.rows, _, self.out = step_rows(rng, self.T, width, conv_dim, inner)
        self.state0 = (rng.standard_normal((self.slots, heads, head_dim, state)) * 0.1).astype(f32)
        self.state = self.state0.copy()
        a_log = rng.uniform(-2, 1, heads).astype(f32)
        dt_bias = (rng.standard_normal(heads) * 0.5).astype(f32)
        d = rng.standard_normal(heads).astype(f32)
        norm = np.ones(inner, f32)
        self._keep = [a_log, dt_bias, d, norm]
        fields = dict(kind=MIX_MAMBA2, width=width, conv_dim=conv_dim, kernel=4, heads=heads, groups=groups)
        mixer = cpu_kernel.c_structs("recurrent.h")["RecMixer"](
            **fields,
            dk=head_dim,
            dv=state,
            out_k=inner,
            a_log=a_log.ctypes.data,
            dt_bias=dt_bias.ctypes.data,
            d=d.ctypes.data,
            norm=norm.ctypes.data,
            dt_min=0.0,
            dt_max=float("inf"),
            eps=1e-5,
            rec_state=self.state.ctypes.data,
            slots=self.slots,
        )
        self._set_step(mixer, lens, marks, carried)


def median_cpu_ms(fn, repeat: int) -> float:
    """The median CPU (process) time of `fn` over `repeat` calls after one warm-up, in ms."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return statistics.median(times) * 1e3


def recurrence_ms(shape: tuple[int, ...], tokens: int, repeat: int) -> dict[str, float]:
    """One layer's recurrence over a `tokens`-token chunk from a carried state, per path, and the paths' largest
    difference relative to the output's largest value. `shape`: a SHAPES (Gated DeltaNet) or MAMBA2_SHAPES one."""
    scan = DeltaNetScan(*shape, [tokens]) if len(shape) == 3 else Mamba2Scan(*shape, [tokens])
    (tok, _), (chk, _) = scan.run(False), scan.run(True)
    diff = float(np.abs(tok - chk).max() / np.abs(tok).max())
    return {
        "token loop": median_cpu_ms(lambda: scan.scan(False), repeat),
        "chunked": median_cpu_ms(lambda: scan.scan(True), repeat),
        "diff": diff,
    }


def prefill_ms(tokens: int, layers: int, repeat: int) -> float:
    """CPU ms of one fused prefill step of `tokens` random tokens (the whole prompt in one step) of the
    Qwen3.5-2B-shaped model's first `layers` layers, median of `repeat` after one warm-up."""
    from benchmarks.kernels.fused_vs_torch import hybrid_folder
    from pagedllm import SamplingParams
    from pagedllm.engine import EngineConfig, LLMEngine

    engine = LLMEngine(
        EngineConfig(
            model=hybrid_folder(f"qwen3.5-2b@{layers}"),
            quantization="int8",  # the fused step runs quantized weights (fused_vs_torch's --hybrid runs)
            log_stats_interval=0,
            max_model_len=tokens + 16,
            max_num_batched_tokens=tokens,
            enable_prefix_caching=False,
        )
    )
    if engine.runner.fused is None:
        raise SystemExit("this model does not run the fused step here (see the log line)")
    rng = random.Random(0)
    times = []
    for i in range(repeat + 1):
        prompt = [rng.randrange(200, engine.model_config.vocab_size) for _ in range(tokens)]
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        t = time.process_time()
        engine.step()
        times.append(time.process_time() - t)
        while engine.has_unfinished_requests():
            engine.step()
    return statistics.median(times[1:]) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--layers", type=int, default=4, help="the prefill model's layers (3 linear to 1 full)")
    p.add_argument("--no-share", action="store_true", help="the recurrence alone, no prefill step")
    p.add_argument("--mamba2", action="store_true", help="Mamba2's recurrence (MAMBA2_SHAPES) instead, alone")
    cpu_target.add_argument(p)
    a = p.parse_args()
    import torch

    torch.set_num_threads(1)  # the fused step runs on torch's thread count
    print(f"CPU: {cpu_line()}")
    if a.mamba2:
        print("one layer's Mamba2 recurrence in the fused C step, one thread, CPU ms (median):")
        for name, shape in MAMBA2_SHAPES.items():
            for n in a.tokens:
                got = recurrence_ms(shape, n, a.repeat)
                print(
                    f"  {name} {shape[0]} heads of {shape[1]}, state {shape[2]}, {shape[3]} groups, {n} tokens: "
                    f"token loop {got['token loop']:.2f}, chunked {got['chunked']:.2f} "
                    f"({got['token loop'] / got['chunked']:.2f}x); max |diff| {got['diff']:.1e} of the largest"
                )
        return 0
    print("one layer's Gated DeltaNet recurrence in the fused C step, one thread, CPU ms (median):")
    rec = {}
    for name, shape in SHAPES.items():
        for n in a.tokens:
            rec[name, n] = got = recurrence_ms(shape, n, a.repeat)
            print(
                f"  {name} {shape[0]}/{shape[1]} heads of {shape[2]}, {n} tokens: token loop "
                f"{got['token loop']:.2f}, chunked {got['chunked']:.2f} "
                f"({got['token loop'] / got['chunked']:.2f}x); max |diff| {got['diff']:.1e} of the largest"
            )
    if a.no_share:
        return 0
    linear = a.layers - a.layers // 4
    for n in a.tokens:
        step = prefill_ms(n, a.layers, a.repeat)
        got = rec["Qwen3.5-2B", n]
        print(
            f"  prefill step, Qwen3.5-2B-like first {a.layers} layers ({linear} linear), {n} tokens: {step:.1f} ms; "
            f"its recurrence {linear} x {got['chunked']:.2f} ms = {100 * linear * got['chunked'] / step:.1f}% "
            f"(with the token loop: {linear} x {got['token loop']:.2f} ms, "
            f"{100 * linear * got['token loop'] / (step + linear * (got['token loop'] - got['chunked'])):.1f}%)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
