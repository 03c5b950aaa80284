"""The default model (SmolLM2-135M-Instruct Q4_1 GGUF) against transformers loading the same GGUF (dequantized).

float32, dequantized (--quantization none) and quantized as stored (the default, the fused C step): greedy
continuations are token-for-token equal to transformers' `generate` (the quantized path: the six prompts below,
8 of 8 in a wider run; its weights are the file's exact values, only the summation order differs).
bfloat16: teacher-forced logits agree with transformers within a stated tolerance; the top-1 agreement rate is
printed and must be high (bf16 rounding legitimately flips near-ties).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from pagedllm.model import (
    ModelRunner,
    SeqChunk,
    default_model_path,
    load_model,
    load_model_config,
    load_tokenizer,
)
from pagedllm.model.kernels import cpu_kernel

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how photosynthesis works, step by step.",
    "List some tips for staying productive when working from home.",
]
MORE_PROMPTS = [  # for the quantized path: new prompts, two ending early on EOS
    "What is the capital of France, and why is it famous?",
    "Write a haiku about the ocean.",
    "Summarize the plot of Romeo and Juliet.",
]
N_NEW = 64
BF16_MAX_ABS_TOL = 1.5  # max |diff| over all positions: measured 0.81
BF16_MEAN_ABS_TOL = 0.25  # measured 0.12
BF16_MIN_TOP1 = 0.9


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM, GgufConfig

    path = default_model_path()
    folder, name = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, quantization_config=GgufConfig(gguf_file=path, dequantize=True)
    )
    return model.eval()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]


def _hf_greedy(hf_model, tok, prompts):
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            g = hf_model.generate(
                torch.tensor([ids]),
                max_new_tokens=N_NEW,
                do_sample=False,
                eos_token_id=tok.eos_token_ids,
                pad_token_id=tok.eos_token_ids[0],
            )
            outs.append(g[0, len(ids) :].tolist())
    return outs


@pytest.fixture(scope="module")
def hf_greedy(hf_model, tok, prompts):
    return _hf_greedy(hf_model, tok, prompts)


def _greedy(runner: ModelRunner, prompts: list[list[int]], eos: list[int], block_size: int) -> list[list[int]]:
    """All prompts batched together: one prefill step, then batched decode steps (argmax)."""
    need = [-(-(len(p) + N_NEW) // block_size) for p in prompts]
    free = list(range(runner.num_blocks))[::-1]  # reversed ids: non-contiguous tables
    tables = []
    for n in need:
        tables.append(free[:n])
        free = free[n:]
    outs: list[list[int]] = [[] for _ in prompts]
    logits = runner.execute([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)])
    live = list(range(len(prompts)))
    nxt = {i: int(logits[k].argmax()) for k, i in enumerate(live)}
    while live:
        for i in live:
            outs[i].append(nxt[i])
        live = [i for i in live if nxt[i] not in eos and len(outs[i]) < N_NEW]
        if not live:
            break
        chunks = [SeqChunk([outs[i][-1]], len(prompts[i]) + len(outs[i]) - 1, tables[i]) for i in live]
        logits = runner.execute(chunks)
        nxt = {i: int(logits[k].argmax()) for k, i in enumerate(live)}
    return outs


def test_default_config_and_tokenizer(tok):
    cfg = load_model_config(None)
    assert cfg.architecture == "LlamaForCausalLM" and cfg.num_layers == 30 and cfg.num_kv_heads == 3
    assert cfg.tie_word_embeddings
    assert tok.encode("Hello") == tok.hf.encode("Hello", add_special_tokens=False)
    assert tok.encode("Hello", add_special_tokens=True)[0] != tok.bos_token_id  # no BOS added for SmolLM2
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert tok.eos_token_ids == [2]


def test_float32_greedy_matches_transformers(hf_greedy, tok, prompts, model_fp32_dense):
    assert model_fp32_dense.quantization == "none"
    runner = ModelRunner(model_fp32_dense, num_blocks=64, block_size=16)
    ours = _greedy(runner, prompts, tok.eos_token_ids, 16)
    for p, a, b in zip(PROMPTS, ours, hf_greedy):
        assert a == b, f"{p!r}:\n ours {tok.decode(a)!r}\n   hf {tok.decode(b)!r}"
    assert sum(len(o) for o in ours) >= 2 * N_NEW  # the prompts really produce long continuations


def test_quantized_float32_greedy_matches_transformers(hf_model, hf_greedy, tok, prompts, model_fp32):
    """Weights as stored (Q4_1 / Q8_0), float32 activations, the fused C step: the same tokens as transformers
    on the dequantized weights, for the parity prompts (batched) and three more (one at a time)."""
    assert model_fp32.quantization == "gguf" and model_fp32.weight_bytes <= 150 * 10**6
    runner = ModelRunner(model_fp32, num_blocks=128, block_size=16)
    assert runner.fused is not None
    ours = _greedy(runner, prompts, tok.eos_token_ids, 16)
    more = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in MORE_PROMPTS]
    ours += [_greedy(runner, [ids], tok.eos_token_ids, 16)[0] for ids in more]
    want = hf_greedy + _hf_greedy(hf_model, tok, more)
    for p, a, b in zip(PROMPTS + MORE_PROMPTS, ours, want):
        assert a == b, f"{p!r}:\n ours {tok.decode(a)!r}\n   hf {tok.decode(b)!r}"


@pytest.mark.parametrize("target", [t for t in cpu_kernel.runnable_targets() if t != "native"])
def test_every_cpu_class_gives_transformers_greedy_tokens(hf_greedy, tok, prompts, model_fp32, target, monkeypatch):
    """The same weights through the kernels built for another CPU class (x86-64-v3 = AVX2, x86-64-v4 = AVX-512,
    x86-64 = the portable C path): the same greedy tokens as transformers. The portable build is an order of
    magnitude slower (scalar conversions; `--quantization auto` dequantizes where it loses to dense), so it
    continues one prompt, the vector builds all three."""
    n = 1 if target == "x86-64" else len(prompts)
    monkeypatch.setenv("PAGEDLLM_CPU_TARGET", target)
    cpu_kernel.load.cache_clear()
    try:
        runner = ModelRunner(model_fp32, num_blocks=64, block_size=16)
        assert runner.fused is not None
        assert cpu_kernel.isa(runner.fused.lib)["matmul"] == cpu_kernel.EXPECTED_ISA[target]
        ours = _greedy(runner, prompts[:n], tok.eos_token_ids, 16)
    finally:
        monkeypatch.delenv("PAGEDLLM_CPU_TARGET")
        cpu_kernel.load.cache_clear()
    assert len(ours) == n
    for p, a, b in zip(PROMPTS, ours, hf_greedy):
        assert a == b, f"{target}, {p!r}:\n ours {tok.decode(a)!r}\n   hf {tok.decode(b)!r}"


@pytest.fixture(scope="module")
def hf16(hf_model):
    import copy

    return copy.deepcopy(hf_model).to(torch.bfloat16)


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_bfloat16_logits_close_to_transformers(hf16, hf_greedy, prompts, quantization):
    """Dequantized: a bfloat16 model throughout. Quantized (the default): float32 activations, with steps of
    the measured number of rows or more on AMX with bfloat16 inputs where the CPU has it: closer to float32 than
    hf16."""
    loaded = load_model(None, dtype="bfloat16", quantization=quantization)
    assert loaded.dtype == torch.bfloat16
    runner = ModelRunner(loaded, num_blocks=64, block_size=16)
    agree = total = 0
    max_abs = 0.0
    sum_abs = 0.0
    free = list(range(64))[::-1]
    for ids, cont in zip(prompts, hf_greedy):
        seq = ids + cont
        with torch.inference_mode():
            ref = hf16(torch.tensor([seq])).logits[0].float()[len(ids) - 1 :]
        n = -(-len(seq) // 16)
        table, free = free[:n], free[n:]
        got = [runner.execute([SeqChunk(ids, 0, table)])[0]]
        for j, t in enumerate(cont[:-1]):  # teacher-forced decode steps
            got.append(runner.execute([SeqChunk([t], len(ids) + j, table)])[0])
        got_t = torch.stack(got)
        ref = ref[: len(got)]
        diff = (got_t - ref).abs()
        max_abs = max(max_abs, diff.max().item())
        sum_abs += diff.mean().item() * len(got)
        agree += int((got_t.argmax(-1) == ref.argmax(-1)).sum())
        total += len(got)
    rate = agree / total
    mean_abs = sum_abs / total
    print(
        f"\nbf16 ({quantization}) vs transformers bf16: top-1 agreement {rate:.3f} over {total} positions, "
        f"max |logit diff| {max_abs:.3f}, mean {mean_abs:.4f}"
    )
    assert rate >= BF16_MIN_TOP1
    assert max_abs < BF16_MAX_ABS_TOL
    assert mean_abs < BF16_MEAN_ABS_TOL
