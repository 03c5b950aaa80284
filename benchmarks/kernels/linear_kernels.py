"""Every matmul kernel pagedllm could use, on every weight shape of a model, at the row counts steps have.

One "step" is all of the model's linear layers (each layer's qkv, o, gate/up, down, with distinct weights per
layer as in the real model, so the caches see its real working set) plus the LM head, at `rows` rows of
activations. Kernels (a kernel that cannot run here is left out and said so):
- dense-f32 / dense-bf16: oneDNN with the weight packed once (pagedllm's dense path; AMX for bf16 where the CPU
  has it); the weights dequantized from the model;
- q-f32: pagedllm's C kernel, float32 activations, weights as stored (Q4_1 / Q8_0 for the default GGUF; every
  GGML type: gguf_types.py);
- q-dot: the same weights with the activations rounded to 16-bit integers per group of 32 (the dot route:
  integer products, VNNI where the CPU has it);
- q-bf16: pagedllm's bfloat16-activation kernel (AMX, else AVX-512 BF16 vdpbf16ps), the same stored weights;
- int4pack-bf16 / int4pack-f32: torch's `_weight_int4pack_mm_for_cpu` (groups of 32, scale and zero per group;
  the LM head too), activations in that dtype;
- int8pack-bf16 / int8pack-f32: torch's `_weight_int8pack_mm` (one scale per row).
It prints the CPU, then for each kernel the megabytes of weights it reads per step and the ms per step for
each shape and in total, and the fastest kernel per dtype and row count: the table `quant.py`'s choice by row
count comes from.

    .venv/bin/python -m benchmarks.kernels.linear_kernels                       # default model, rows 1,4,16,64,256
    .venv/bin/python -m benchmarks.kernels.linear_kernels --rows 1,64 --kernels q-f32,dense-f32 --repeat 5
    .venv/bin/python -m benchmarks.kernels.linear_kernels --cpu-target x86-64-v3   # the AVX2 class, on any newer x86
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

if __name__ == "__main__":  # before torch loads: the class to build and measure (cpu_target.py)
    from benchmarks import cpu_target

    cpu_target.select()

import torch

from benchmarks.common import cpu_line
from pagedllm.model import load_model
from pagedllm.model.kernels.onednn_linear import linear, pack
from pagedllm.model.kernels.quant_linear import QuantWeight, bf16_kernel, qlinear

SHAPES = ["qkv", "o", "gate_up", "down", "lm_head"]


def quant_weights(loaded) -> dict[str, list[QuantWeight]]:
    """The model's quantized weights by shape name (one per layer; the LM head once)."""
    m = loaded.model
    out = {"qkv": [], "o": [], "gate_up": [], "down": [], "lm_head": [m.lm_head.quant]}
    for layer in m.decoder_layers:
        out["qkv"].append(layer.qkv.quant)
        out["o"].append(layer.o.quant)
        out["gate_up"].append(layer.mlp.gate_up.quant)
        out["down"].append(layer.mlp.down.quant)
    return out


def dense_of(q: QuantWeight) -> torch.Tensor:
    """The float32 weight a quantized one stands for, through the kernel itself (x = identity)."""
    eye = torch.eye(q.k, dtype=torch.float32)
    return qlinear(eye, q).T.contiguous()


def _int4pack(w: torch.Tensor, dtype: torch.dtype):
    """torch's int4 CPU format from a dense weight: asymmetric groups of 32 (what Q4_1 maps to exactly)."""
    n, k = w.shape
    g = w.reshape(n, k // 32, 32)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = lo + 8 * scale  # torch dequantizes (q - 8) * scale + zero
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(dtype)
    return packed, sz


def _int8pack(w: torch.Tensor, dtype: torch.dtype):
    scale = (w.abs().amax(1) / 127).clamp(min=1e-8)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale.to(dtype)


def _nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def make_kernel(name: str, weights: dict[str, list[QuantWeight]]):
    """(dtype, {shape: [callable(x) per weight]}, bytes of weights), or None where it cannot run here."""
    quant_bytes = sum(q.nbytes for ws in weights.values() for q in ws)
    if name in ("q-f32", "q-dot"):  # float32 activations, or rounded to 16 bits (the dot route)
        qs = {s: [dataclasses.replace(q, dot=name == "q-dot") for q in ws] for s, ws in weights.items()}
        return torch.float32, {s: [lambda x, q=q: qlinear(x, q) for q in ws] for s, ws in qs.items()}, quant_bytes
    if name == "q-bf16":  # every row count on it, whatever the loaded model's measured threshold
        if bf16_kernel() is None:
            return None
        amx = {s: [dataclasses.replace(q, amx_min_rows=1) for q in ws] for s, ws in weights.items()}
        return torch.bfloat16, {s: [lambda x, q=q: qlinear(x, q) for q in ws] for s, ws in amx.items()}, quant_bytes
    dtype = torch.bfloat16 if name.endswith("bf16") else torch.float32
    fns, nbytes = {}, 0
    for s, ws in weights.items():
        fns[s] = []
        for q in ws:
            w = dense_of(q)
            if name.startswith("dense"):
                wd = w.to(dtype)
                p = pack(wd)
                if p is None:
                    return None
                fns[s].append(lambda x, wd=wd, p=p: linear(x, wd, None, p))
                nbytes += _nbytes(wd)
            elif name.startswith("int4pack"):
                p, sz = _int4pack(w, dtype)
                fns[s].append(lambda x, p=p, sz=sz: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, 32, sz))
                nbytes += _nbytes(p, sz)
            else:
                q8, sc = _int8pack(w, dtype)
                fns[s].append(lambda x, q8=q8, sc=sc: torch.ops.aten._weight_int8pack_mm(x, q8, sc))
                nbytes += _nbytes(q8, sc)
    return dtype, fns, nbytes


def time_steps(fns: dict, dtype: torch.dtype, rows: int, k_of: dict[str, int], repeat: int) -> dict[str, float]:
    """Median over `repeat` steps of the ms spent on each shape (all its layers) in one step."""
    xs = {s: torch.randn(rows, k, dtype=torch.float32).to(dtype) for s, k in k_of.items()}
    per: dict[str, list[float]] = {s: [] for s in fns}
    for it in range(repeat + 1):
        for s, calls in fns.items():
            t = time.perf_counter()
            for fn in calls:
                fn(xs[s])
            if it:  # the first step warms up
                per[s].append((time.perf_counter() - t) * 1e3)
    return {s: statistics.median(v) for s, v in per.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    p.add_argument("--rows", default="1,4,8,16,64,256")
    p.add_argument(
        "--kernels", default="q-f32,dense-f32,int4pack-f32,int8pack-f32,q-bf16,dense-bf16,int4pack-bf16,int8pack-bf16"
    )
    p.add_argument("--repeat", type=int, default=5)
    cpu_target.add_argument(p)
    a = p.parse_args()
    loaded = load_model(a.model, "float32", quantization="gguf")
    weights = quant_weights(loaded)
    k_of = {s: ws[0].k for s, ws in weights.items()}
    print(f"CPU: {cpu_line()}; torch {torch.__version__}")
    print("shapes (out x in, count): " + ", ".join(f"{s} {ws[0].n}x{ws[0].k} x{len(ws)}" for s, ws in weights.items()))
    rows = [int(r) for r in a.rows.split(",")]
    totals: dict[tuple[str, int], float] = {}
    print(f"\n{'kernel':<15}{'MB':>6}{'rows':>5}" + "".join(f"{s:>9}" for s in SHAPES) + f"{'step ms':>9}")
    for name in a.kernels.split(","):
        made = make_kernel(name, weights)
        if made is None:
            print(f"{name:<15}  not available on this CPU / build")
            continue
        dtype, fns, nbytes = made
        for r in rows:
            ms = time_steps(fns, dtype, r, k_of, a.repeat)
            totals[(name, r)] = sum(ms.values())
            gbs = f"{nbytes / totals[(name, r)] / 1e6:>7.1f} GB/s" if r == 1 else ""
            print(
                f"{name:<15}{nbytes / 1e6:>6.0f}{r:>5}"
                + "".join(f"{ms[s]:>9.2f}" for s in SHAPES)
                + f"{totals[(name, r)]:>9.2f}{gbs}",
                flush=True,
            )
        del fns
    print("\nfastest per activation dtype and rows (ms per step):")
    for dt in ("f32", "bf16"):
        for r in rows:
            cands = {
                k: v
                for (k, rr), v in totals.items()
                if rr == r and (k.endswith(dt) or (dt == "bf16" and k == "q-bf16"))
            }
            if cands:
                best = min(cands, key=cands.get)
                print(
                    f"  {dt:<5}{r:>5} rows: {best} {cands[best]:.2f}  ("
                    + ", ".join(f"{k} {v:.2f}" for k, v in sorted(cands.items(), key=lambda kv: kv[1]))
                    + ")"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
