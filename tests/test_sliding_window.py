"""A sliding-window model (a tiny random Mistral, window 24, 200-token prompts) token for token against
transformers through the engine, on each attention path: the torch path, the C decode kernel, and the fused C step
(weights on the int8 grid, so `--quantization int8` runs the very weights transformers runs); with prefix caching,
chunked prefill and preemption on, every block back at the end. And a sliding model holds fewer blocks than a
full-attention one of the same shape on the same long request.

The window must matter for the test to mean anything: without it transformers gives other tokens (checked)."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from engine_helpers import assert_all_blocks_free, run_all
from kernel_helpers import needs_kernel
from model_helpers import VOCAB, all_logits

from devkit.tiny_tokenizer import save_tiny_tokenizer
from pagedllm import SamplingParams
from pagedllm.engine import EngineConfig, LLMEngine
from pagedllm.kv.hashing import hash_full_blocks
from pagedllm.kv.sizing import window_blocks
from pagedllm.model import ModelRunner, SeqChunk, load_model
from pagedllm.model.layers.attention import AttentionSpec

WINDOW, PROMPT, NEW = 24, 200, 40
BLOCK = 16
BLOCK_BYTES = BLOCK * 2 * 2 * 2 * 16 * 4  # tokens x (K, V) x layers x KV heads x head_dim x float32


def _snap_to_int8_grid(w: torch.Tensor) -> None:
    """w [N, K] onto values RTN int8 in groups of 32 (pagedllm's --quantization int8) gives back exactly: each
    group d * q with a float16 d and one |q| = 127."""
    g = w.view(w.shape[0], -1, 32)
    d = (g.abs().amax(-1, keepdim=True) / 127).to(torch.float16).float()
    g.copy_(torch.round(g / d).clamp(-127, 127) * d)


def _mistral(folder: str, window: int | None):
    from transformers import AutoModelForCausalLM, MistralConfig

    cfg = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
        sliding_window=window,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                _snap_to_int8_grid(p.data)
    hf.save_pretrained(folder, safe_serialization=True)
    save_tiny_tokenizer(folder, VOCAB)
    return hf


@torch.inference_mode()
def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def _engine(folder: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=folder, dtype="float32", max_model_len=512, log_stats_interval=0, **kw))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, VOCAB, (120,), generator=g).tolist()
    out = [torch.randint(3, VOCAB, (PROMPT,), generator=g).tolist() for _ in range(3)]
    return out + [shared + torch.randint(3, VOCAB, (PROMPT - 120,), generator=g).tolist()]


@pytest.fixture(scope="module")
def sliding(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("mistral_sw"))
    hf = _mistral(folder, WINDOW)
    prompts = _prompts()
    return folder, prompts, [_hf_greedy(hf, p, NEW) for p in prompts]


@pytest.fixture(scope="module")
def full_folder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("mistral_full"))
    return folder, _mistral(folder, None)


def test_the_window_changes_transformers_tokens(sliding, full_folder):
    _, prompts, want = sliding
    assert _hf_greedy(full_folder[1], prompts[0], NEW) != want[0]


PATHS = {
    "torch": dict(env="torch", quantization="none"),
    "decode_kernel": dict(env="", quantization="none"),
    "fused": dict(env="", quantization="int8"),
}


@pytest.mark.parametrize("path", [pytest.param(p, marks=() if p == "torch" else needs_kernel) for p in PATHS])
def test_greedy_equals_transformers(sliding, path, monkeypatch):
    folder, prompts, want = sliding
    monkeypatch.setenv("PAGEDLLM_ATTENTION", PATHS[path]["env"])
    engine = _engine(
        folder,
        quantization=PATHS[path]["quantization"],
        max_num_batched_tokens=48,  # prompts in chunks, mixed with other requests' decodes
        kv_cache_memory=7 * BLOCK_BYTES,  # four requests do not fit at once: preemptions
    )
    assert (engine.runner.fused is not None) == (path == "fused")
    assert engine.kv.sliding_window == WINDOW
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    assert run_all(engine, prompts, params) == want
    assert engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(engine)
    # Prefix caching: A, then B (which evicts A's oldest blocks), then A again: a hit from the blocks of A's
    # last window alone (vLLM's sliding-window hit), the blocks before it null.
    engine = _engine(folder, quantization=PATHS[path]["quantization"], kv_cache_memory=20 * BLOCK_BYTES)
    a, b = prompts[0], prompts[1]
    assert run_all(engine, [a], params) == [want[0]] and run_all(engine, [b], params) == [want[1]]
    assert run_all(engine, [a], params) == [want[0]]
    assert engine.kv.prefix_stats.hits == (PROMPT - 1) // BLOCK * BLOCK
    assert_all_blocks_free(engine)


def _peak_blocks(folder: str, prompt: list[int], n: int) -> int:
    engine = _engine(folder, max_num_batched_tokens=64)
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.kv.num_used_blocks)
    assert_all_blocks_free(engine)
    return peak


def test_sliding_model_holds_fewer_blocks_than_a_full_one(sliding, full_folder):
    """The same shape, the same 400-token request: the full-attention model ends holding all 26 blocks, the
    sliding one the few its window reaches (plus a prefill chunk's)."""
    prompt = (sliding[1][0] * 2)[:400]
    full, slid = _peak_blocks(full_folder[0], prompt, 16), _peak_blocks(sliding[0], prompt, 16)
    assert full == -(-416 // BLOCK)
    assert slid <= window_blocks(64 + WINDOW, WINDOW, BLOCK) + 64 // BLOCK + 1 and slid < full // 3


@needs_kernel
def test_fused_step_scale_softcap_and_window_match_the_torch_path(sliding):
    """What no tiny Mistral exercises (Gemma 2's soft-cap, a query_pre_attn_scalar scale) through the fused
    step's prefill tiles and decode tokens, against the torch path (itself checked against the definition in
    test_attention_spec.py), on the same int8 weights."""
    loaded = load_model(sliding[0], dtype="float32", quantization="int8", verbose=False)
    specs = [AttentionSpec(window=20, scale=0.3, softcap=4.0), AttentionSpec(scale=0.2, softcap=2.5)]
    for layer, spec in zip(loaded.model.layers, specs):
        layer.attn_spec = spec
    prompt = sliding[1][1][:90]
    logits = {}
    for fused in (True, False):
        runner = ModelRunner(loaded, 16, BLOCK, fused=fused)
        assert (runner.fused is not None) == fused
        table = list(range(15, -1, -1))
        rows = [all_logits(runner, [SeqChunk(prompt[s : s + 37], s, table)])[0] for s in range(0, 90, 37)]
        rows += [runner.execute([SeqChunk([prompt[i]], i, table)]) for i in range(60, 90)]  # decodes over it
        logits[fused] = torch.cat(rows)
    torch.testing.assert_close(logits[True], logits[False], atol=2e-4, rtol=1e-4)


def test_kv_page_shows_the_groups_and_no_skipped_block(sliding):
    """The /kv data of a request whose old blocks went back: one sliding group that frees, the request's table
    without the null entries (block 0 is not shown held by it), its stored tokens those of the blocks it holds."""
    from pagedllm.engine.block_map import block_map
    from pagedllm.engine.kv_snapshot import take_snapshot
    from pagedllm.server.kv_page import kv_blocks_json

    engine = _engine(sliding[0], max_num_batched_tokens=32, kv_cache_memory=64 * BLOCK_BYTES)
    engine.add_request("r", sliding[1][0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for _ in range(5):  # 160 of its 200 prompt tokens computed: all but the last window's blocks given back
        engine.step()
    data = json.loads(kv_blocks_json(block_map(take_snapshot(engine))))  # as the route answers
    held = engine.kv.num_used_blocks
    assert data["kv_groups"] == [{"window": WINDOW, "layers": [0, 1], "frees_blocks": True, "blocks": held}]
    (req,) = data["requests"]
    assert req["skipped_blocks"] == len(engine.kv.get_block_ids(req["request_id"])) - held > 0
    # block 0 was its first block: now free, still caching its prefix, and not drawn as held by it
    assert len(req["block_ids"]) == held and 0 not in req["block_ids"]
    assert data["map"]["states"][data["map"]["state"][0]] == "cached"
    assert data["counters"]["num_used_blocks"] == held
    assert data["counters"]["tokens_stored"] == engine.kv.num_stored_tokens
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(engine)


def test_bench_sweep_window_rows(full_folder, tmp_path):
    """`bench sweep --rows window` on a full-attention model: the row with a window over the same shape allocates
    fewer KV slots on the same long-tail workload, in the same budget."""
    import argparse
    import json

    from pagedllm.bench import sweep

    p = argparse.ArgumentParser()
    sweep.add_sweep_parser(p.add_subparsers())
    out = tmp_path / "w.json"
    flags = "--rows window --max-model-len 512 --num-prompts 4 --median-len 300 --output-len 4 --sliding-window 32"
    args = p.parse_args(["sweep", "--model", full_folder[0], "--dtype", "float32", *flags.split()])
    args.save_result = str(out)
    assert args.func(args) == 0
    rows = {r["setting"]: r for r in json.loads(out.read_text())["rows"]}
    full, slid = rows["paged b16, full attention"], rows["paged b16, sliding window 32"]
    assert full["completed"] == slid["completed"] == 4
    assert slid["kv_slots_allocated"] < full["kv_slots_allocated"] / 2
    assert slid["peak_kv_slots_allocated"] < full["peak_kv_slots_allocated"]


def test_disk_tier_serves_a_sliding_model(sliding, tmp_path):
    """--kv-offload-dir under a sliding model: A's blocks evicted from RAM by B and C come back from disk for A
    again (the chain from the start, then the blocks out of the window null), and the tokens stay transformers'."""
    folder, prompts, want = sliding
    engine = _engine(folder, kv_cache_memory=20 * BLOCK_BYTES, kv_offload_dir=str(tmp_path / "kv"))
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    for i in range(3):
        assert run_all(engine, [prompts[i]], params) == [want[i]]
    engine.disk_tier.flush()
    assert engine.kv.pool.get_cached_block(hash_full_blocks(prompts[0][:192], BLOCK, None, [])[11]) is None
    assert run_all(engine, [prompts[0]], params) == [want[0]]
    assert engine.kv.prefix_stats.disk_hits > 0
    assert engine.kv.prefix_stats.hits == (PROMPT - 1) // BLOCK * BLOCK
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("attention", [pytest.param("torch"), pytest.param("", marks=needs_kernel)])
def test_mixed_sliding_and_full_layers(tmp_path, attention, monkeypatch):
    """Qwen2 with layer 0 full and layer 1 sliding (max_window_layers 1): each layer masks by its own window,
    equal to transformers; each is its own KV-cache group (the sliding one's old blocks go back)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, use_sliding_window=True, sliding_window=WINDOW,
        max_window_layers=1, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    save_tiny_tokenizer(str(tmp_path), VOCAB)
    prompt = _prompts()[2]
    want = _hf_greedy(hf, prompt, 32)
    monkeypatch.setenv("PAGEDLLM_ATTENTION", attention)
    engine = _engine(str(tmp_path), max_num_batched_tokens=48, kv_cache_memory=64 * BLOCK_BYTES)
    assert engine.kv.sliding_window is None and [g.window for g in engine.kv_groups] == [None, WINDOW]
    assert run_all(engine, [prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)) == [want]
    assert_all_blocks_free(engine)
    cfg.use_sliding_window, cfg.layer_types = False, None
    full = AutoModelForCausalLM.from_config(Qwen2Config(**cfg.to_dict()), dtype=torch.float32).eval()
    full.load_state_dict(hf.state_dict())
    assert full.config.layer_types == ["full_attention"] * 2
    assert _hf_greedy(full, prompt, 32) != want  # the window mattered
