"""A layer's AttentionSpec (sliding window, softmax scale, Gemma 2's logit soft-cap, gpt-oss's sinks) on the torch
path and the C decode kernel, against attention written out token by token from its definition; and the one step builder
(`step_index`) against the arithmetic it replaces."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from kernel_helpers import needs_kernel

from pagedllm.model.config import ModelConfig
from pagedllm.model.kernels import cpu_kernel
from pagedllm.model.layers.attention import (
    AttentionSpec,
    CpuPagedAttention,
    TorchPagedAttention,
    build_metadata,
    step_index,
)

LIB = cpu_kernel.load()
SPECS = [
    AttentionSpec(),
    AttentionSpec(window=7),
    AttentionSpec(window=16, scale=0.3),
    AttentionSpec(scale=0.5, softcap=2.0),
    AttentionSpec(window=5, scale=0.4, softcap=1.5),
    AttentionSpec(window=1),
    AttentionSpec(sinks=torch.zeros(1)),  # the sinks are drawn per test, one per query head (_with_sinks)
    AttentionSpec(window=6, scale=0.3, sinks=torch.zeros(1)),
]


def _with_sinks(spec: AttentionSpec, heads: int) -> AttentionSpec:
    """`spec` with one sink per head where it has sinks: spread over the scores' range, so some heads' sinks take
    most of the weight and others almost none."""
    return spec if spec.sinks is None else replace(spec, sinks=torch.linspace(-3.0, 6.0, heads))


def _case(new_lens: list[int], kvh: int, group: int, d: int, bs: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    starts = [rng.randrange(0, 60) for _ in new_lens]
    need = [-(-(s + n) // bs) for s, n in zip(starts, new_lens)]
    ids = list(range(1, sum(need) + 2))
    rng.shuffle(ids)
    tables, at = [], 0
    for k in need:
        tables.append(ids[at : at + k])
        at += k
    shape = (sum(need) + 2, bs, kvh, d)
    kc, vc = torch.randn(shape, generator=g) * 2, torch.randn(shape, generator=g)
    T = sum(new_lens)
    q = torch.randn(T, kvh * group, d, generator=g) * 2
    k, v = torch.randn(T, kvh, d, generator=g) * 2, torch.randn(T, kvh, d, generator=g)
    return q, k, v, kc, vc, starts, tables


def _reference(q, k, v, kc, vc, new_lens, starts, tables, spec: AttentionSpec) -> torch.Tensor:
    """Each query over its own context, from the definition: positions max(0, p - window + 1) .. p."""
    kc, vc = kc.clone(), vc.clone()
    bs, kvh, d = kc.shape[1], kc.shape[2], kc.shape[3]
    g = q.shape[1] // kvh
    scale = spec.scale if spec.scale is not None else d**-0.5
    out, t = torch.empty_like(q), 0
    for n, start, table in zip(new_lens, starts, tables):
        for j in range(n):  # write first: a chunk's queries see each other's keys
            p = start + j
            kc[table[p // bs], p % bs], vc[table[p // bs], p % bs] = k[t + j], v[t + j]
        for j in range(n):
            p = start + j
            lo = 0 if spec.window is None else max(0, p - spec.window + 1)
            keys = torch.stack([kc[table[i // bs], i % bs] for i in range(lo, p + 1)])  # [L, kvh, d]
            vals = torch.stack([vc[table[i // bs], i % bs] for i in range(lo, p + 1)])
            for h in range(q.shape[1]):
                s = (keys[:, h // g] @ q[t + j, h]).double() * scale
                if spec.softcap is not None:
                    s = spec.softcap * torch.tanh(s / spec.softcap)
                if spec.sinks is not None:  # one more logit in the softmax, of a zero value
                    s = torch.cat([s, spec.sinks[h : h + 1].double()])
                p = torch.softmax(s, 0)[: len(keys)]
                out[t + j, h] = (p.float() @ vals[:, h // g]).float()
        t += n
    return out


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("lens", [[1] * 5, [1, 9, 1, 20, 3]], ids=["decode", "mixed"])
def test_torch_path_matches_the_definition(spec, lens):
    q, k, v, kc, vc, starts, tables = _case(lens, 2, 3, 16, 8, len(lens))
    spec = _with_sinks(spec, q.shape[1])
    ref = _reference(q, k, v, kc, vc, lens, starts, tables, spec)
    meta = build_metadata(lens, starts, tables, 8, torch.device("cpu"))
    out = TorchPagedAttention().forward(q, k, v, kc, vc, meta, spec)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@needs_kernel
@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("head_dim", [64, 32, 20])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_matches_the_definition(spec, head_dim, kv_dtype, monkeypatch):
    calls = []
    real = cpu_kernel.decode_attention
    monkeypatch.setattr(cpu_kernel, "decode_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    lens = [1] * 6
    q, k, v, kc, vc, starts, tables = _case(lens, 2, 2, head_dim, 5, head_dim)
    spec = _with_sinks(spec, q.shape[1])
    kc, vc, k, v = kc.to(kv_dtype), vc.to(kv_dtype), k.to(kv_dtype), v.to(kv_dtype)
    ref = _reference(q, k.float(), v.float(), kc.float(), vc.float(), lens, starts, tables, spec)
    meta = build_metadata(lens, starts, tables, 5, torch.device("cpu"))
    out = CpuPagedAttention(LIB).forward(q, k, v, kc, vc, meta, spec)
    tol = 1e-4 if kv_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    assert calls == [1]


@needs_kernel
def test_decode_kernel_never_reads_blocks_before_the_window():
    """Blocks out of the window go back to the pool and are handed to other requests: the kernel must not read
    them (here: NaN in every block but the window's, and block ids past the cache in the table there)."""
    bs, d, window, ctx = 4, 32, 6, 30
    kc = torch.full((12, bs, 1, d), float("nan"))
    vc = torch.full((12, bs, 1, d), float("nan"))
    first = (ctx - window) // bs  # the first block holding a position in the window
    table = [999] * first + list(range(1, 1 + -(-ctx // bs) - first))
    g = torch.Generator().manual_seed(0)
    for i in range(first, -(-ctx // bs)):
        kc[table[i]], vc[table[i]] = torch.randn(bs, 1, d, generator=g), torch.randn(bs, 1, d, generator=g)
    q = torch.randn(1, 2, d, generator=g)
    out = cpu_kernel.decode_attention(LIB, q, kc, vc, torch.tensor([table]), torch.tensor([ctx]), d**-0.5, window, None)
    keys = torch.stack([kc[table[p // bs], p % bs, 0] for p in range(ctx - window, ctx)])
    vals = torch.stack([vc[table[p // bs], p % bs, 0] for p in range(ctx - window, ctx)])
    ref = torch.softmax(q[0] @ keys.T * d**-0.5, -1) @ vals
    torch.testing.assert_close(out[0], ref, atol=1e-5, rtol=1e-4)


def test_step_index_positions_slots_and_tables():
    lens, starts, tables = [3, 1, 5], [2, 9, 0], [[4, 7], [1, 2, 3], [5, 6]]
    ix = step_index(lens, starts, tables, 4)
    assert ix.seq.tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 2]
    assert ix.positions.tolist() == [2, 3, 4, 9, 0, 1, 2, 3, 4]
    assert ix.slots.tolist() == [4 * 4 + 2, 4 * 4 + 3, 7 * 4 + 0, 3 * 4 + 1, 20, 21, 22, 23, 24]
    assert ix.tables.tolist() == [[4, 7, 0], [1, 2, 3], [5, 6, 0]]
    assert ix.tables.dtype == np.int64
    with pytest.raises(ValueError, match="cannot hold"):
        step_index([5], [0], [[1]], 4)


def test_layer_specs_from_the_config():
    cfg = ModelConfig("MistralForCausalLM", 8, 8, 8, 3, 1, 1, 8, sliding_window=4)
    assert [AttentionSpec.for_layer(cfg, i).window for i in range(3)] == [4, 4, 4]
    cfg.layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    cfg.attn_scale, cfg.attn_logit_softcapping = 0.25, 30.0
    assert [AttentionSpec.for_layer(cfg, i) for i in range(3)] == [
        AttentionSpec(4, 0.25, 30.0),
        AttentionSpec(None, 0.25, 30.0),
        AttentionSpec(4, 0.25, 30.0),
    ]


@needs_kernel
@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
def test_decode_kernel_window_on_quantized_caches(kv_dtype):
    """int8 / fp8 caches (codes, a scale per row, rotated rows): the kernel and the torch path read the same codes,
    and both keep to the window. The history is written by a prefill through the torch path."""
    from pagedllm.model.kernels import kv_quant

    spec = AttentionSpec(window=9, scale=0.3, softcap=3.0, sinks=torch.tensor([-1.0, 0.5, 2.0, 4.0]))
    bs, kvh, d, hist = 4, 2, 32, [23, 40, 9]
    g = torch.Generator().manual_seed(5)
    tables = [list(range(i * 12, i * 12 + 12)) for i in range(3)]
    shape = kv_quant.cache_shape(36, bs, kvh, d, kv_dtype)
    kc, vc = torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype)
    T = sum(hist)
    meta = build_metadata(hist, [0, 0, 0], tables, bs, torch.device("cpu"))
    x = [torch.randn(T, kvh * h, d, generator=g) for h in (2, 1, 1)]
    TorchPagedAttention().forward(x[0], x[1], x[2], kc, vc, meta, spec)
    q, k, v = (
        torch.randn(3, 4, d, generator=g),
        torch.randn(3, kvh, d, generator=g),
        torch.randn(3, kvh, d, generator=g),
    )
    meta = build_metadata([1, 1, 1], hist, tables, bs, torch.device("cpu"))
    ref = TorchPagedAttention().forward(q, k, v, kc.clone(), vc.clone(), meta, spec)
    out = CpuPagedAttention(LIB).forward(q, k, v, kc, vc, meta, spec)
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=1e-3)
    far = TorchPagedAttention().forward(q, k, v, kc.clone(), vc.clone(), meta, replace(spec, window=None))
    assert not torch.allclose(far, ref, atol=1e-2)  # the window mattered


def test_sliding_window_read_from_configs():
    """Qwen2's layer types (use_sliding_window, max_window_layers) as transformers derives them; Mistral's window on
    every layer; GGUF's {arch}.attention.sliding_window."""
    from transformers import Qwen2Config

    from pagedllm.model.config import config_from_gguf, config_from_hf_dict
    from pagedllm.model.families.base import GGUFHeader

    hf = Qwen2Config(num_hidden_layers=6, use_sliding_window=True, sliding_window=64, max_window_layers=4)
    d = {**hf.to_dict(), "architectures": ["Qwen2ForCausalLM"]}
    d.pop("layer_types")  # older config.json files have none: derived as transformers does
    cfg = config_from_hf_dict(d, "test")
    assert cfg.sliding_window == 64 and cfg.layer_types == hf.layer_types
    assert [cfg.layer_window(i) for i in range(6)] == [None] * 4 + [64, 64]
    off = config_from_hf_dict({**d, "use_sliding_window": False}, "test")
    assert off.sliding_window is None and off.layer_window(5) is None
    mistral = config_from_hf_dict(
        {"architectures": ["MistralForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
         "num_hidden_layers": 2, "num_attention_heads": 1, "sliding_window": 4096}, "test"
    )  # fmt: skip
    assert [mistral.layer_window(i) for i in range(2)] == [4096, 4096]
    md = {"general.architecture": "llama", "llama.embedding_length": 8, "llama.attention.head_count": 1,
          "llama.vocab_size": 8, "llama.feed_forward_length": 8, "llama.block_count": 2,
          "llama.attention.sliding_window": 32}  # fmt: skip
    header = GGUFHeader(md, "llama.", {"token_embd.weight": (8, 8), "output.weight": (8, 8)}, lambda name: [])
    assert config_from_gguf(header, "test").layer_window(1) == 32
