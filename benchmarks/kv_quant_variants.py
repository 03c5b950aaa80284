"""Why a quantized KV cache loses accuracy, and what fixes it: quantization schemes tried on the same passages
without writing any kernel, by quantizing and dequantizing K and/or V in float32 on the torch path before they are
written to a float32 cache ("fake quantization"), each against the float32 cache.

    .venv/bin/python benchmarks/kv_quant_variants.py --set int8 --passages 32    # or --set parts / fp8 / scale

Passages as benchmarks/kv_quant_accuracy.py (windows of 1,024 tokens of the RAG corpus, 512-token chunks,
float32 activations). Per variant: mean KL(float32 || variant), greedy top-1 agreement, the disagreements, and
how many of them are near-ties of the reference (its top two within 0.01 / 0.05 / 0.1 nats). The torch path with
a float32 cache gives the fused C step's logits (KL 0, 100% agreement), so its figures compare with the
benchmark's. Variant names: kv / k / v (what is quantized), g32 / g64 (values per scale; 64 = one scale per
(token, KV head) row of the default model), had (rotated by the normalized 64-point Walsh-Hadamard transform
first, as model/kernels/kv_quant.py does), rhad (random signs, then Hadamard), clip90 (scale 0.9 x amax / 127),
f32scale (an exact scale instead of one rounded up to a bfloat16).
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from kv_quant_accuracy import passages

from pagedllm.model.layers import attention
from pagedllm.model.loader import load_model
from pagedllm.model.runner import ModelRunner, SeqChunk


def hadamard(d: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def fake(
    x: torch.Tensor,
    group: int,
    dtype: torch.dtype = torch.int8,
    rot: torch.Tensor | None = None,
    clip: float = 1.0,
    bf16_scale: bool = True,
) -> torch.Tensor:
    """x quantized to `dtype` codes with a scale per `group` values (amax x clip / the format's top, rounded up
    to a bfloat16 unless not bf16_scale), then dequantized; rotated by `rot` first and back after."""
    top = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}[dtype]
    x = x.float()
    x = x @ rot.T if rot is not None else x
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    s = (g.abs().amax(-1, keepdim=True) * clip / top).clamp_min(2.0**-100)
    if bf16_scale:
        s = ((s.view(torch.int32) + 0xFFFF) & -65536).view(torch.float32)
    q = (g / s).clamp(-top, top)
    q = q.round() if dtype == torch.int8 else q.to(dtype).float()
    y = (q * s).reshape(x.shape)
    return y @ rot if rot is not None else y


H = hadamard(64)
RH = H @ torch.diag((torch.randint(0, 2, (64,), generator=torch.Generator().manual_seed(0)) * 2 - 1).float())
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
SETS = {
    "int8": {  # the layout this replaced, and the rotated row with one or two scales
        "kv_g32": dict(k=lambda x: fake(x, 32), v=lambda x: fake(x, 32)),
        "kv_had_g64": dict(k=lambda x: fake(x, 64, rot=H), v=lambda x: fake(x, 64, rot=H)),
        "kv_had_g32": dict(k=lambda x: fake(x, 32, rot=H), v=lambda x: fake(x, 32, rot=H)),
    },
    "parts": {  # K or V, plain and rotated; one scale per row unrotated
        "k_g32": dict(k=lambda x: fake(x, 32)),
        "v_g32": dict(v=lambda x: fake(x, 32)),
        "kv_g64": dict(k=lambda x: fake(x, 64), v=lambda x: fake(x, 64)),
        "k_had_g64": dict(k=lambda x: fake(x, 64, rot=H)),
        "v_had_g64": dict(v=lambda x: fake(x, 64, rot=H)),
        "khad_g64_v_g64": dict(k=lambda x: fake(x, 64, rot=H), v=lambda x: fake(x, 64)),
    },
    "scale": {  # the scale's choice
        "kv_g32_f32scale": dict(k=lambda x: fake(x, 32, bf16_scale=False), v=lambda x: fake(x, 32, bf16_scale=False)),
        "kv_rhad_g64": dict(k=lambda x: fake(x, 64, rot=RH), v=lambda x: fake(x, 64, rot=RH)),
        "kv_had_g64_clip90": dict(k=lambda x: fake(x, 64, rot=H, clip=0.9), v=lambda x: fake(x, 64, rot=H, clip=0.9)),
    },
    "fp8": {
        "e4m3_g32": dict(k=lambda x: fake(x, 32, E4), v=lambda x: fake(x, 32, E4)),
        "e4m3_had_g64": dict(k=lambda x: fake(x, 64, E4, H), v=lambda x: fake(x, 64, E4, H)),
        "e5m2_g32": dict(k=lambda x: fake(x, 32, E5), v=lambda x: fake(x, 32, E5)),
        "e5m2_had_g64": dict(k=lambda x: fake(x, 64, E5, H), v=lambda x: fake(x, 64, E5, H)),
    },
}

VARIANT: dict = {}
_write = attention.TorchPagedAttention.forward


def _forward(self, q, k, v, k_cache, v_cache, meta, *spec):  # K and V as the variant would store them
    k = VARIANT["k"](k).to(k.dtype) if "k" in VARIANT else k
    v = VARIANT["v"](v).to(v.dtype) if "v" in VARIANT else v
    return _write(self, q, k, v, k_cache, v_cache, meta, *spec)


def logits(loaded, ids: list[int], chunk: int = 512) -> torch.Tensor:
    blocks = -(-len(ids) // 16)
    runner = ModelRunner(loaded, blocks, 16, torch.float32, fused=False)
    table = list(range(blocks))
    return torch.cat(
        [runner.execute([SeqChunk(ids[s : s + chunk], s, table, all_logits=True)]) for s in range(0, len(ids), chunk)]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", choices=SETS, default="int8")
    ap.add_argument("--passages", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=1024)
    args = ap.parse_args()
    attention.TorchPagedAttention.forward = _forward
    loaded = load_model(None, "float32")
    texts = passages(loaded.tokenizer, args.passages, args.tokens)
    variants = SETS[args.set]
    stats = {name: {"kl": 0.0, "agree": 0, "n": 0, "margins": []} for name in variants}
    for i, ids in enumerate(texts):
        VARIANT.clear()
        ref = logits(loaded, ids)[:-1].log_softmax(-1)
        top2 = ref.topk(2, -1).values
        margin = top2[:, 0] - top2[:, 1]
        for name, variant in variants.items():
            VARIANT.clear()
            VARIANT.update(variant)
            logp = logits(loaded, ids)[:-1].log_softmax(-1)
            s = stats[name]
            s["kl"] += (ref.exp() * (ref - logp)).sum().item()
            differ = ref.argmax(-1) != logp.argmax(-1)
            s["agree"] += (~differ).sum().item()
            s["n"] += len(ref)
            s["margins"] += margin[differ].tolist()
        print(f"passage {i + 1}/{len(texts)}", file=sys.stderr, flush=True)
    print(
        f"{len(texts)} passages x {args.tokens} tokens\n| variant | mean KL | top-1 agreement | disagreements | "
        "margin < 0.01 | < 0.05 | < 0.1 nats |\n|---|---|---|---|---|---|---|"
    )
    for name, s in stats.items():
        m = torch.tensor(s["margins"] or [1.0])
        print(
            f"| {name} | {s['kl'] / s['n']:.2e} | {s['agree'] / s['n']:.2%} | {len(s['margins'])} | "
            + " | ".join(f"{(m < t).float().mean():.0%}" for t in (0.01, 0.05, 0.1))
            + " |"
        )


if __name__ == "__main__":
    main()
