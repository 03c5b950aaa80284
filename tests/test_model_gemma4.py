"""Gemma 4 text (issue 35) against transformers float32 on a tiny random checkpoint: six layers, sliding (a window
of 8, shorter than every prompt) and full in Gemma's pattern, the last two reading the KV of the last earlier
layer of their kind (num_kv_shared_layers: layer 4 reads layer 3's, layer 5 layer 2's) with MLPs twice as wide,
full layers with their own head size and KV heads, keys equal to values there (attention_k_eq_v) and
proportional RoPE, per-layer input embeddings, a learned scalar per layer and the final logit soft-cap.

The sliding and full layers' KV rows differ in size (2 heads x 16 against 2 x 32), so the smaller ones use the
front of a cache slot's rows (runner.layer_view): the logits test runs both shapes through the engine's groups.
"""

from __future__ import annotations

import contextlib
import io
import logging
import random

import pytest
import torch
from engine_helpers import greedy_cached_chunked_preempted
from model_helpers import all_logits

from devkit.family_helpers import save_tokenizer
from devkit.gemma4_gguf import CONFIG, MOE, make_gemma4
from devkit.gemma4_gguf import write_gemma4_gguf as write_gguf  # the parity benchmark's writer too
from pagedllm import LLM, SamplingParams
from pagedllm.engine import EngineConfig, LLMEngine
from pagedllm.kv import kv_bytes_per_token
from pagedllm.model import ModelRunner, SeqChunk, load_model, load_model_config
from pagedllm.model.kernels import cpu_kernel

TOL = 1e-4  # of the largest logit

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> tuple[str, torch.nn.Module]:
    folder = str(tmp_path_factory.mktemp("gemma4"))
    return folder, make_gemma4(folder)


@pytest.fixture(scope="module")
def loaded(ckpt):
    return load_model(ckpt[0], dtype="float32", verbose=False)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, 256) for _ in range(n)]


@torch.inference_mode()
def _hf_greedy_agrees(model: torch.nn.Module, prompt: list[int], generated: list[int]) -> bool:
    """Whether transformers' greedy decoding of `prompt` gives `generated` (one pass over the whole sequence)."""
    logits = model(torch.tensor([prompt + generated])).logits[0][len(prompt) - 1 : -1]
    return logits.argmax(-1).tolist() == generated


def test_config_reads_what_transformers_builds(ckpt, loaded):
    """The shapes per layer, and kv-calc's parameter count equal to transformers' (the layer scalar is a buffer)."""
    from pagedllm.model.params import param_count

    cfg = loaded.config
    assert param_count(cfg)[0] == sum(p.numel() for p in ckpt[1].parameters())
    assert cfg.family == "gemma4" and cfg.kv_layout().kv_source == (0, 1, 2, 3, 3, 2)
    assert [cfg.layer_head_dim(i) for i in range(6)] == [16, 16, 32] * 2 and cfg.kv_slot_shape == (2, 32)
    assert [cfg.layer_intermediate_size(i) for i in range(6)] == [96] * 4 + [192] * 2
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "proportional"
    layers = loaded.model.decoder_layers
    assert [layer.kv_parts for layer in layers] == [2, 2, 1, 2, 0, 0]  # k = v on full layers, none when shared
    from pagedllm.model.fused_step import _model_blockers

    assert not _model_blockers(cfg)  # the C step computes each piece: test_the_fused_step_computes_...


@pytest.mark.parametrize("hybrid", [True, False])
def test_logits_match_transformers(ckpt, loaded, hybrid):
    """110 tokens prefilled in two chunks over shuffled blocks, then four decoded, with a table per KV-cache group
    (hybrid) or one for every layer: every position's logits within float32 accuracy of transformers."""
    _, hf = ckpt
    ids = _tokens(110, 1)
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0].float()
    layout = loaded.config.kv_layout(hybrid=hybrid)
    runner = ModelRunner(loaded, num_blocks=128, block_size=8, layout=layout)
    free = random.Random(2).sample(range(1, 128), 14 * len(layout.groups))
    tables = [free[g * 14 : (g + 1) * 14] for g in range(len(layout.groups))]

    def chunk(a: int, b: int, every: bool) -> SeqChunk:
        return SeqChunk(ids[a:b], a, tables[0], all_logits=every, group_tables=tables)

    got = all_logits(runner, [chunk(0, 45, True)]) + all_logits(runner, [chunk(45, 106, True)])
    got += [runner.execute([chunk(p, p + 1, False)]) for p in range(106, 110)]
    err = (torch.cat(got) - want).abs().max().item() / want.abs().max().item()
    assert err < TOL, f"{err:.2e}"


def _engine(loaded, blocks: int, chunk: int = 16) -> LLMEngine:
    cfg = loaded.config
    layers_per_block = cfg.kv_layout(hybrid=True).layers_per_block  # a block spans one group's layers
    per_block = kv_bytes_per_token(layers_per_block, *cfg.kv_slot_shape, 4) * 8
    config = EngineConfig(
        block_size=8,
        max_num_batched_tokens=chunk,
        kv_cache_memory=blocks * per_block,
        max_model_len=256,
        log_stats_interval=0,
    )
    return LLMEngine(config, loaded)


PROMPTS = [_tokens(24, 3) + _tokens(46, 4), _tokens(24, 3) + _tokens(50, 5), _tokens(66, 6)]
# Prompts of 132, 138 and 220 tokens, whose prefill crosses the ends of 64-token chunks (at 64, 128 and 192); the
# first two share 72 tokens (9 blocks of 8: a prefix hit), the last grows chunk by chunk beside the others' decodes
LONG_PROMPTS = [_tokens(72, 3) + _tokens(60, 4), _tokens(72, 3) + _tokens(66, 5), _tokens(220, 6)]
# A KV budget (blocks of 8) in which, in chunks of 16 and of 64, the second prompt hits the first's blocks and the
# three then overflow the cache (measured: both from 68 to 76 blocks)
LONG_BLOCKS = 72


@pytest.mark.parametrize("chunk", [16, 64])
def test_greedy_tokens_match_transformers_with_caching_chunks_and_preemption(ckpt, loaded, chunk):
    """32 greedy tokens per prompt of 130+ tokens (LONG_PROMPTS) in one engine with prefix caching, chunked prefill
    (16 or 64 tokens a step: the sliding and full layers' KV crosses chunk ends) and a KV cache small enough to
    preempt: transformers' tokens, every block back at the end."""
    tokens = greedy_cached_chunked_preempted(_engine(loaded, LONG_BLOCKS, chunk), LONG_PROMPTS)
    for i, (p, t) in enumerate(zip(LONG_PROMPTS, tokens)):
        assert _hf_greedy_agrees(ckpt[1], p, t), f"prompt {i}"


def test_the_fused_step_computes_what_the_torch_path_does(tmp_path):
    """int8 weights of a Gemma 4 whose sliding layers (4 KV heads of 16) and full layers (2 of 32, keys equal to
    values, v_norm) store KV rows of one size: its per-layer head sizes, the shared layers reading earlier layers'
    KV, the double-wide MLPs, the per-layer inputs (of 32) and layer scalars on the fused C step against the torch
    path on the same weights: a prompt in two chunks, 8 greedy decodes: the same tokens, logits within the
    tolerance; then the engine with prefix caching, chunked prefill and preemption: the same answers; then the
    checkpoint's own two KV row sizes (one cache slot for both) on a float32 and an int8 KV cache."""
    from model_helpers import fused_and_torch

    make_gemma4(str(tmp_path), hidden_size_per_layer_input=32, num_key_value_heads=4)
    loaded = load_model(str(tmp_path), "float32", verbose=False, quantization="int8", quantized_activations="none")
    got = fused_and_torch(loaded, _tokens(70, 1), 29, 8)
    (fused, fused_tokens), (want, want_tokens) = got[True], got[False]
    assert fused_tokens == want_tokens
    assert (fused - want).abs().max().item() < TOL * want.abs().max().item()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    answers = {}
    for path in ("fused", "torch"):
        engine = _engine(loaded, 40)
        assert engine.runner.fused is not None
        if path == "torch":
            engine.runner.fused = None
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), p, params)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        stats = engine.stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
        answers[path] = [list(done[str(i)].outputs[0].token_ids) for i in range(len(PROMPTS))]
    assert answers["fused"] == answers["torch"]
    # KV rows of two sizes (2 KV heads of 16 beside 2 of 32) sharing the cache slots, the smaller at the front of
    # each token's row (runner.layer_view), on a float32 and a quantized cache
    make_gemma4(str(tmp_path / "rows"), hidden_size_per_layer_input=32)
    two = load_model(
        str(tmp_path / "rows"), "float32", verbose=False, quantization="int8", quantized_activations="none"
    )
    for kv_dtype in (None, torch.int8):
        got = fused_and_torch(two, _tokens(70, 2), 29, 8, kv_dtype)
        (fused, fused_tokens), (want, want_tokens) = got[True], got[False]
        assert fused_tokens == want_tokens
        assert (fused - want).abs().max().item() < TOL * want.abs().max().item()


TARGETS = [t for t in ("native", "x86-64-v3", "x86-64") if t in cpu_kernel.runnable_targets()]
DOT_TOL = 2e-3  # the dot route's bound against the exact path (test_model_families.py's)


MOE_FOLDER = dict(hidden_size_per_layer_input=32, num_key_value_heads=4)  # moe_folder's, besides MOE


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory) -> str:
    """A Gemma 4 whose every layer has the sparse block beside its dense MLP, with per-layer inputs, double-wide
    MLPs in the two layers that read shared KV, and keys equal to values: each piece of the family at once."""
    folder = str(tmp_path_factory.mktemp("gemma4-moe"))
    make_gemma4(folder, **MOE_FOLDER, **MOE)
    return folder


I8_ROWS = 8  # --quantized-activations int8's row count, set (the loader's comes from a timing)
# The int8 route between the two paths: an input that the paths compute a rounding apart can round to codes a step
# (1/254 of its group's largest) apart; 4.6e-3 measured here (dense matmuls alone: 6.9e-3)
I8_TOL = 2e-2


def _with_i8_rows(loaded, experts: bool):
    """Every quantized weight on the int8 route from I8_ROWS rows on, as the loader sets them, or (`experts`
    False) every one but the experts'."""
    routed = {id(lin.quant) for layer in loaded.model.decoder_layers if layer.moe for lin in layer.moe.linears()}
    for w in loaded.model.quant_weights():
        w.i8_min_rows = I8_ROWS if experts or id(w) not in routed else 0
    return loaded


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("activations", ["none", "int16", "int8"])
def test_the_moe_block_on_the_fused_step_of_every_cpu_class(moe_folder, activations, target, caplog):
    """The sparse block beside the dense MLP in the one C call (the MLP, the experts' and the router's own norms of
    the stream, the per-expert scales, both outputs normed and summed) against the torch path on the same int8
    weights, with float32 activations, the dot route's, and the int8 route's from 8 rows of a matmul on (an
    expert's: its routed rows; the prompt's chunks have more, the decode steps fewer), on this CPU's build, the
    AVX2 one and the portable one: no line saying the steps run on the torch path, the same greedy tokens, logits
    within each route's bound, and the same expert load counted. On the int8 route the experts take it in the
    fused step too: a chunk's logits are not those of the experts on the dot route."""
    from model_helpers import cpu_target, fused_and_torch

    loaded = load_model(moe_folder, "float32", verbose=False, quantization="int8", quantized_activations=activations)
    ids = _tokens(70, 14)
    with cpu_target(target), caplog.at_level(logging.WARNING, logger="pagedllm"):
        if activations == "int8":
            dense_only = _prefill(_with_i8_rows(loaded, False), ids)
            assert not torch.equal(_prefill(_with_i8_rows(loaded, True), ids), dense_only)
        got = fused_and_torch(loaded, ids, 29, 8)
        counted = {fused: _expert_load_of_a_step(loaded, ids, fused) for fused in (True, False)}
    assert "not the fused C step" not in caplog.text
    (fused, fused_tokens), (want, want_tokens) = got[True], got[False]
    assert fused_tokens == want_tokens, f"{activations} {target}"
    err = (fused - want).abs().max().item() / want.abs().max().item()
    assert err < {"none": TOL, "int16": DOT_TOL, "int8": I8_TOL}[activations], f"{activations} {target}: {err:.2e}"
    (tokens, reads), (want_load, want_reads) = counted[True], counted[False]
    assert torch.equal(tokens, want_load) and reads == want_reads > 0
    assert (tokens.sum(1) == len(ids) * MOE["top_k_experts"]).all()


def _prefill(loaded, ids: list[int]) -> torch.Tensor:
    """The fused step's logits of `ids` prefilled in one chunk."""
    runner = ModelRunner(loaded, num_blocks=16, block_size=8)
    assert runner.fused is not None
    return all_logits(runner, [SeqChunk(ids, 0, list(range(16)))])[0]


def _expert_load_of_a_step(loaded, ids: list[int], fused: bool) -> tuple[torch.Tensor, int]:
    """What one prefill step of `ids` adds to the model's expert counters: tokens per expert, experts read."""
    runner = ModelRunner(loaded, num_blocks=16, block_size=8, fused=fused)
    assert (runner.fused is not None) == fused
    load = loaded.model.expert_load
    tokens, reads = load.tokens.clone(), load.reads[0]
    runner.execute([SeqChunk(ids, 0, list(range(16)))])
    return load.tokens - tokens, load.reads[0] - reads


def test_llm_generate_answers_transformers(ckpt):
    """The offline API from the folder: the same greedy tokens as transformers."""
    llm = LLM(ckpt[0], dtype="float32", kv_cache_memory=2**20, max_model_len=256, log_stats_interval=0)
    out = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    tokens = list(out[0].outputs[0].token_ids)
    assert len(tokens) == 12 and _hf_greedy_agrees(ckpt[1], PROMPTS[2], tokens)


def _peak_layer_blocks(folder: str, prompt: list[int]) -> tuple[int, int]:
    """(blocks x layers per block at the engine's peak, KV layers) for one request of `prompt` from `folder`."""
    engine = LLMEngine(
        EngineConfig(
            model=folder,
            dtype="float32",
            block_size=8,
            max_model_len=256,
            kv_cache_memory=2**20,
            max_num_batched_tokens=256,
            log_stats_interval=0,
            enable_prefix_caching=False,
        )  # fmt: skip
    )
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    layout = engine.kv_layout
    return engine.kv.peak_used_blocks * layout.layers_per_block, layout.num_kv_layers


def test_shared_layers_hold_no_kv_blocks(ckpt, tmp_path):
    """The pool's peak for one request against a twin whose every layer stores its own KV. The peak is the prompt's
    one step (before a sliding group gives a block back), where each layer that stores KV holds all 13 blocks of
    its 100 tokens: 4 layers' worth in the model, 6 in the twin; the shared layers hold none."""
    twin = str(tmp_path / "twin")
    make_gemma4(twin, num_kv_shared_layers=0)
    prompt = _tokens(100, 7)
    shared, shared_layers = _peak_layer_blocks(ckpt[0], prompt)
    own, own_layers = _peak_layer_blocks(twin, prompt)
    assert (shared_layers, own_layers) == (4, 6)
    assert (shared, own) == (4 * 13, 6 * 13)


def test_kv_calc_counts_the_shared_layers_out(ckpt):
    from pagedllm.entrypoints.cli import main

    out = io.StringIO()
    args = ["kv-calc", "--max-len", "256", "--block-size", "8", "--used", "100", "--model", ckpt[0]]
    with contextlib.redirect_stdout(out):
        assert main([*args, "--kv-cache-dtype", "float32"]) == 0
    text = out.getvalue()
    # 4 layers store KV, each row a cache slot's (2 heads x 32 dims): 2 x 4 x 2 x 32 x 4 bytes
    assert "KV bytes per token: 2,048" in text
    assert "2 layers read an earlier layer's KV (shared KV): no blocks of their own" in text
    assert load_model_config(ckpt[0]).kv_layout(hybrid=True).num_kv_layers == 4


def test_a_multimodal_checkpoint_runs_its_text_model(tmp_path):
    """What Google ships is Gemma4ForConditionalGeneration: config.json nests the text model's config, its tensors
    sit under model.language_model. beside a vision tower's. The text model loads alone and answers as
    transformers' whole model does on text."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4VisionConfig

    text = {k: v for k, v in CONFIG.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")}
    vision = Gemma4VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        head_dim=16,
    )  # fmt: skip
    ids = dict(image_token_id=250, boi_token_id=251, eoi_token_id=252, video_token_id=249, boa_token_id=248)
    cfg = Gemma4Config(text_config=text, vision_config=vision, eoa_token_index=247, audio_token_id=246, **ids)
    torch.manual_seed(0)
    hf = Gemma4ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    save_tokenizer(str(tmp_path))
    hf = Gemma4ForConditionalGeneration.from_pretrained(str(tmp_path), dtype=torch.float32).eval()  # as saved
    prompt = [t % 240 for t in _tokens(40, 9)]  # below the image / audio tokens, which the whole model treats apart
    with torch.inference_mode():
        want = hf(torch.tensor([prompt])).logits[0].float()
    loaded = load_model(str(tmp_path), dtype="float32", verbose=False)
    assert loaded.config.architecture == "Gemma4ForConditionalGeneration" and loaded.config.num_kv_shared_layers == 2
    runner = ModelRunner(loaded, num_blocks=32, block_size=8)
    got = all_logits(runner, [SeqChunk(prompt, 0, list(range(1, 8)))])[0]
    assert (got - want).abs().max().item() / want.abs().max().item() < TOL


def _greedy_logits(runner, ids: list[int], split: int, steps: int, table: list[int]) -> tuple[torch.Tensor, list[int]]:
    """The logits of `ids` prefilled in two chunks (at `split`), then of `steps` greedy decode tokens, and those
    tokens."""
    rows = all_logits(runner, [SeqChunk(ids[:split], 0, table)])
    rows += all_logits(runner, [SeqChunk(ids[split:], split, table)])
    tokens: list[int] = []
    for _ in range(steps):
        tokens.append(int(rows[-1][-1].argmax()))
        rows.append(runner.execute([SeqChunk(tokens[-1:], len(ids) + len(tokens) - 1, table)]))
    return torch.cat(rows), tokens


def _agrees_with(hf: torch.nn.Module, ids: list[int], got: torch.Tensor, tokens: list[int]) -> float:
    """transformers' greedy tokens after `ids` are `tokens` (asserted); the largest logit error of `got` (a row per
    token of ids + tokens) relative to its largest logit."""
    with torch.inference_mode():
        want = hf(torch.tensor([ids + tokens])).logits[0].float()
    assert want[len(ids) - 1 : -1].argmax(-1).tolist() == tokens
    return (got - want).abs().max().item() / want.abs().max().item()


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_the_moe_block_matches_transformers(tmp_path, quantization):
    """The 26B-A4B's shape in small: every layer's sparse block (4 experts, 2 routed) beside its dense MLP, the
    router's scale and per-expert scales drawn away from 1. 104 tokens in two chunks, then 6 greedy decodes:
    transformers' tokens, every logit within float32 accuracy of its. In float32 on the torch path; with int8
    weights (drawn on int8's grid, so transformers runs the same weights) on the fused C step."""
    from pagedllm.model.params import param_count

    folder = str(tmp_path)
    hf = make_gemma4(folder, quantization == "int8", hidden_size_per_layer_input=0, num_kv_shared_layers=0, **MOE)
    loaded = load_model(folder, "float32", verbose=False, quantization=quantization, quantized_activations="none")
    assert loaded.config.num_experts == 4 and loaded.config.moe_beside_mlp
    total, active = param_count(loaded.config)
    assert total == sum(p.numel() for p in hf.parameters())
    assert total - active == 6 * 2 * 3 * 64 * 32  # 2 experts of 4 not read, in each of 6 layers
    ids = _tokens(104, 11)
    runner = ModelRunner(loaded, num_blocks=32, block_size=8)
    assert (runner.fused is not None) == (quantization == "int8")
    got, tokens = _greedy_logits(runner, ids, 50, 6, random.Random(3).sample(range(1, 32), 14))
    err = _agrees_with(hf, ids, got, tokens)
    assert err < TOL, f"{err:.2e}"


@pytest.mark.parametrize("fmt", ["f32", "q8_0", "q4_0"])
def test_a_gguf_as_llama_cpp_writes_it_matches_transformers(ckpt, tmp_path, fmt):
    """llama.cpp's gemma4 names and keys: the same config as the folder's; on the values the file holds (Q8_0 and
    Q4_0 matrices run as stored), logits within float32 accuracy of transformers, and transformers' 32 greedy tokens
    per prompt through the engine with prefix caching (two prompts share 24 tokens: a hit), chunked prefill and
    forced preemption."""
    import copy

    folder, hf = ckpt
    path = str(tmp_path / f"tiny-gemma4.{fmt}.gguf")
    ref = copy.deepcopy(hf)
    missing, unexpected = ref.load_state_dict(write_gguf(folder, fmt, path), strict=False)
    assert not unexpected and all(name == "lm_head.weight" for name in missing), (missing, unexpected)
    a, b = load_model_config(folder), load_model_config(path)
    keys = ["num_kv_heads", "head_dim", "global_head_dim", "attention_k_eq_v", "v_norm"]
    keys += ["num_kv_shared_layers", "double_wide_shared_mlp", "hidden_size_per_layer_input", "intermediate_size"]
    keys += ["layer_types", "sliding_window", "rope_theta", "rope_local_theta", "attn_scale", "layer_scalar"]
    keys += ["vocab_size_per_layer_input", "final_logit_softcapping", "norm_offset", "partial_rotary_factor"]
    assert {k: getattr(a, k) for k in keys} == {k: getattr(b, k) for k in keys}
    assert [a.layer_kv_heads(i) for i in range(6)] == [b.layer_kv_heads(i) for i in range(6)]
    assert a.rope_scaling and b.rope_scaling and a.rope_scaling["partial_rotary_factor"] == 0.25
    assert b.rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    loaded = load_model(path, dtype="float32", verbose=False, quantized_activations="none")
    assert (fmt == "f32") == all(lin.quant is None for lin in loaded.model.linears())
    ids = _tokens(104, 12)
    with torch.inference_mode():
        want = ref.eval()(torch.tensor([ids])).logits[0].float()
    runner = ModelRunner(loaded, num_blocks=64, block_size=8, layout=loaded.config.kv_layout(hybrid=True))
    groups = len(runner.layout.groups)
    free = random.Random(4).sample(range(1, 64), 13 * groups)
    tables = [free[g * 13 : (g + 1) * 13] for g in range(groups)]
    got = all_logits(runner, [SeqChunk(ids[:100], 0, tables[0], group_tables=tables)])
    got += [runner.execute([SeqChunk(ids[p : p + 1], p, tables[0], group_tables=tables)]) for p in range(100, 104)]
    err = (torch.cat(got) - want).abs().max().item() / want.abs().max().item()
    assert err < TOL, f"{fmt}: {err:.2e}"
    tokens = greedy_cached_chunked_preempted(_engine(loaded, 40), PROMPTS)
    for i, (p, t) in enumerate(zip(PROMPTS, tokens)):
        assert _hf_greedy_agrees(ref, p, t), f"{fmt} prompt {i}"


def test_the_server_answers_and_shows_each_kv_group(ckpt, loaded):
    """`pagedllm serve`'s app over the tiny Gemma 4: a completion of token ids answers transformers' greedy tokens,
    and /v1/kv/blocks lists each KV-cache group with the layers that store KV (the shared layers 4 and 5 in none)."""
    from server_helpers import assert_pool_whole, running_server

    from pagedllm.engine.async_engine import AsyncLLMEngine

    config = EngineConfig(dtype="float32", max_model_len=256, kv_cache_memory=2**20, log_stats_interval=0)
    with running_server(AsyncLLMEngine(LLMEngine(config, loaded=loaded)), served_model_name=["g4"]) as s:
        body = {"model": "g4", "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0}
        r = s.http.post("/v1/completions", json=body | {"logprobs": 0})
        assert r.status_code == 200, r.text
        tokens = s.engine.tokenizer.hf.convert_tokens_to_ids(r.json()["choices"][0]["logprobs"]["tokens"])
        assert len(tokens) == 8 and _hf_greedy_agrees(ckpt[1], PROMPTS[1], tokens)
        assert_pool_whole(s)
        groups = s.http.get("/v1/kv/blocks").json()["kv_groups"]
        assert [(g["window"], g["layers"]) for g in groups] == [(None, [2]), (8, [0]), (8, [1]), (8, [3])]


@pytest.mark.parametrize("fmt", ["f32", "q8_0"])
def test_the_moe_block_from_a_gguf_as_llama_cpp_writes_it(tmp_path, fmt):
    """The sparse block as llama.cpp stores it (gate and up of every expert in one ffn_gate_up_exps, the router's
    and the experts' scales beside them): the folder's config, and transformers' greedy tokens and logits within
    float32 accuracy of its on the values the file holds; in Q8_0 the experts kept quantized and every step on the
    fused C step."""
    import copy

    folder = str(tmp_path / "hf")
    shape = dict(hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False, **MOE)
    hf = make_gemma4(folder, **shape)
    path = str(tmp_path / f"tiny-gemma4-moe.{fmt}.gguf")
    ref = copy.deepcopy(hf)
    missing, unexpected = ref.load_state_dict(write_gguf(folder, fmt, path, **shape), strict=False)
    assert not unexpected and all(name == "lm_head.weight" for name in missing), (missing, unexpected)
    a, b = load_model_config(folder), load_model_config(path)
    keys = ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "moe_beside_mlp", "intermediate_size"]
    assert {k: getattr(a, k) for k in keys} == {k: getattr(b, k) for k in keys}
    loaded = load_model(path, dtype="float32", verbose=False, quantized_activations="none")
    if fmt == "q8_0":
        assert all(
            layer.moe is not None and layer.moe.experts_kernel() is not None for layer in loaded.model.decoder_layers
        )
    runner = ModelRunner(loaded, num_blocks=32, block_size=8)
    assert (runner.fused is not None) == (fmt == "q8_0")  # every matrix quantized: the fused C step
    ids = _tokens(100, 13)
    got, tokens = _greedy_logits(runner, ids, 60, 4, random.Random(5).sample(range(1, 32), 13))
    err = _agrees_with(ref.eval(), ids, got, tokens)
    assert err < TOL, f"{fmt}: {err:.2e}"


@pytest.mark.parametrize("source", ["folder", "q8_0"])
def test_the_moe_block_through_the_engine_matches_transformers(moe_folder, tmp_path, source):
    """The sparse block beside every dense MLP (moe_folder: per-layer inputs, shared KV and double-wide MLPs too)
    through the engine, from the folder (float32, the torch path) and from a Q8_0 GGUF as llama.cpp writes it (the
    experts kept quantized, the fused C step): transformers' 32 greedy tokens per prompt of 130+ tokens (on the
    values the file holds) with prefix caching (two prompts share 72 tokens: a hit), chunked prefill in chunks of
    64 (the KV crosses chunk ends) and a KV cache small enough to preempt; every block back at the end, and every
    expert of every layer routed tokens."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(moe_folder, dtype=torch.float32).eval()
    path = moe_folder
    if source != "folder":
        path = str(tmp_path / f"tiny-gemma4-moe.{source}.gguf")
        missing, unexpected = hf.load_state_dict(write_gguf(moe_folder, source, path, **MOE_FOLDER, **MOE), False)
        assert not unexpected and all(name == "lm_head.weight" for name in missing), (missing, unexpected)
    loaded = load_model(path, dtype="float32", verbose=False, quantized_activations="none")
    assert loaded.config.moe_beside_mlp and all(layer.moe is not None for layer in loaded.model.decoder_layers)
    engine = _engine(loaded, LONG_BLOCKS, 64)
    assert (engine.runner.fused is not None) == (source == "q8_0")
    tokens = greedy_cached_chunked_preempted(engine, LONG_PROMPTS)
    for i, (p, t) in enumerate(zip(LONG_PROMPTS, tokens)):
        assert _hf_greedy_agrees(hf, p, t), f"{source} prompt {i}"
    assert (loaded.model.expert_load.tokens > 0).all(), loaded.model.expert_load.tokens
