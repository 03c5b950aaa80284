"""The state-space and convolution hybrids against transformers in float32, on tiny random checkpoints that
`save_pretrained` writes: Granite 4.0-H (granitemoehybrid: Mamba2 and attention layers, its MoE block beside the
shared MLP, RoPE; and a dense one without RoPE, its config.json in the legacy "mamba" / "attention" names), LFM2
(short-conv and attention layers) and Nemotron-H (single-block layers: Mamba2, attention or an ungated relu2 MLP,
its config.json with the older `hybrid_override_pattern`). Logits over 100+ tokens in uneven chunks and decodes;
32 greedy tokens through the engine with chunked prefill (the state crosses chunk ends), a prefix-cache hit (a state
checkpoint restored), forced preemption (the state slot returned and rebuilt from zeros) and several requests in a
step, from the folders and from LFM2 GGUF files; LLM.generate and the server; kv-calc's state bytes."""

from __future__ import annotations

import json
import os
import random
import re

import pytest
import torch
from engine_helpers import greedy_cached_chunked_preempted, hybrid_engine, shared_prefix_prompts
from model_helpers import VOCAB, all_logits, assert_state_round_trip, chunked_logits_error

from devkit.lfm2_gguf import make_lfm2, write_lfm2_gguf
from devkit.tiny_tokenizer import save_tiny_tokenizer
from pagedllm import SamplingParams
from pagedllm.engine import EngineConfig, LLMEngine
from pagedllm.engine.memory import state_bytes
from pagedllm.model import ModelRunner, SeqChunk, load_model, load_model_config
from pagedllm.model.kernels import cpu_kernel
from pagedllm.model.runner import bytes_per_block

pytestmark = pytest.mark.usefixtures("one_thread", "private_tokenizer_cache")  # tests/conftest.py

FAMILIES = ["granitemoehybrid", "granitemoehybrid_dense", "lfm2", "nemotron_h"]
LINEAR_LAYERS = {"lfm2": [0, 2, 3], "nemotron_h": [0, 4]}  # else Granite's [0, 2]
TOL = 1e-4  # of the largest logit
# Granite's layers, in the released checkpoints' legacy names: two attention layers so that the KV blocks, not the
# state slots (at most half the budget), run out first in the preemption test
GRANITE_LAYERS = ["mamba", "attention", "mamba", "attention"]


def make_hybrid(kind: str, folder: str, shared: int = 48) -> torch.nn.Module:
    """A tiny random checkpoint of `kind` in `folder` (float32, a word-level tokenizer); its transformers model.
    `shared`: Granite's shared MLP size (48: its down projection runs dense, 64: every matmul can be quantized)."""
    from transformers import AutoModelForCausalLM, GraniteMoeHybridConfig, NemotronHConfig

    if kind == "lfm2":  # devkit/lfm2_gguf.py's (the parity benchmark's too)
        return make_lfm2(folder)

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if kind == "nemotron_h":  # Mamba2, MLP, attention, MLP, Mamba2, attention (devkit/hybrid_gguf.py's shape)
        from devkit.hybrid_gguf import CONFIGS

        cfg = NemotronHConfig(**common | CONFIGS["nemotron_h"][1] | {"time_step_min": 0.5})
    else:
        moe = kind == "granitemoehybrid"
        cfg = GraniteMoeHybridConfig(
            **common,
            intermediate_size=32,
            shared_intermediate_size=shared,
            num_local_experts=4 if moe else 0,
            num_experts_per_tok=2,
            layer_types=GRANITE_LAYERS,
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_d_state=16,
            mamba_n_groups=2,
            mamba_d_conv=4,
            mamba_expand=2,
            rms_norm_eps=1e-5,
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
            logits_scaling=3.0,
            position_embedding_type="rope" if moe else None,
        )
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # norms, decays, skips and conv biases off their neutral init, so each one matters
        for name, p in hf.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                p.uniform_(0.5, 1.5)
            elif name.endswith(("A_log", "dt_bias", "D", "conv1d.bias")):
                p.uniform_(-1, 1)
    hf.save_pretrained(folder, safe_serialization=True)
    save_tiny_tokenizer(folder, VOCAB)
    if kind == "granitemoehybrid_dense":  # the released checkpoints' legacy layer names
        path = os.path.join(folder, "config.json")
        raw = json.load(open(path))
        raw.pop("layers_block_type", None)
        raw["layer_types"] = GRANITE_LAYERS
        json.dump(raw, open(path, "w"))
    if kind == "nemotron_h":  # the released checkpoints' pattern string in place of the list
        path = os.path.join(folder, "config.json")
        raw = json.load(open(path))
        raw["hybrid_override_pattern"] = "M-*-M*"
        raw.pop("layers_block_type")
        json.dump(raw, open(path, "w"))
    return hf


class Checkpoint:
    def __init__(self, kind: str, folder: str) -> None:
        self.kind, self.folder = kind, folder
        self.hf = make_hybrid(kind, folder)
        self.loaded = load_model(folder, dtype="float32", verbose=False, quantized_activations="none")


@pytest.fixture(scope="module", params=FAMILIES)
def ckpt(request, tmp_path_factory) -> Checkpoint:
    return Checkpoint(request.param, str(tmp_path_factory.mktemp(request.param)))


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, VOCAB) for _ in range(n)]


@torch.inference_mode()
def _hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


def test_logits_match_transformers(ckpt):
    """110 tokens: prefilled in chunks of 37 and 70 (one crossing a scan chunk) over shuffled blocks, then three
    decoded: every position's logits within float32 accuracy of transformers."""
    cfg = ckpt.loaded.config
    assert cfg.linear_layers == LINEAR_LAYERS.get(ckpt.kind, [0, 2]) and cfg.recurrent_mixer == (
        "short_conv" if ckpt.kind == "lfm2" else "mamba2"
    )
    ids = _tokens(110, 1)
    want = _hf_logits(ckpt.hf, ids)
    err = chunked_logits_error(ckpt.loaded, ids, want)
    assert err < TOL, f"{ckpt.kind}: {err:.2e}"


def test_parameter_count_matches_transformers(ckpt):
    """kv-calc's parameter count (model/params.py) counts each Mamba2 / short-conv mixer as transformers holds it."""
    from pagedllm.model.params import param_count

    total, active = param_count(ckpt.loaded.config)
    assert total == sum(p.numel() for p in ckpt.hf.parameters())
    assert active <= total


def test_a_state_goes_through_the_blocks_bytes_unchanged(ckpt):
    """A prefix-cache checkpoint's round trip (runner.state_to_blocks, then blocks_to_state into another row) gives
    every layer's state back: Mamba2's conv and SSM states, and every short-conv layer's conv state past the empty
    recurrent state of the one before it (the copy once stopped at the first empty one: LFM2 restored its first
    conv layer's state only)."""
    assert_state_round_trip(ModelRunner(ckpt.loaded, num_blocks=16, block_size=8, num_state_slots=2))


def _hf_greedy_agrees(model: torch.nn.Module, prompt: list[int], generated: list[int]) -> bool:
    logits = _hf_logits(model, prompt + generated)[len(prompt) - 1 : -1]
    return logits.argmax(-1).tolist() == generated


def test_greedy_tokens_match_transformers(ckpt):
    """32 greedy tokens for three prompts run together, two sharing 256 tokens (the second starts from the first's
    Mamba2 / short-conv state checkpoint), with chunked prefill (64 tokens a step: each state crosses chunk ends)
    and a KV cache small enough to preempt (the state slot goes back and the request restarts from zeros):
    transformers' tokens, and every block and state slot back at the end."""
    prompts = shared_prefix_prompts(_tokens)
    tokens = greedy_cached_chunked_preempted(hybrid_engine(ckpt.loaded, 16), prompts)
    for i, (p, t) in enumerate(zip(prompts, tokens)):
        assert _hf_greedy_agrees(ckpt.hf, p, t), f"{ckpt.kind} prompt {i}"


def _engine(loaded, caching: bool, mode: str = "align") -> LLMEngine:
    cfg = loaded.config
    per_block = bytes_per_block(cfg, 16, "float32", cfg.kv_layout(hybrid=True))
    budget = 64 * per_block + 4 * 2 * state_bytes(cfg, torch.float32)
    args = dict(max_num_batched_tokens=64, max_num_seqs=4, kv_cache_memory=budget, max_model_len=256)
    config = EngineConfig(**args, enable_prefix_caching=caching, log_stats_interval=0, mamba_cache_mode=mode)
    return LLMEngine(config, loaded)


def test_prefix_caching_hits_at_state_checkpoints_and_keeps_every_answer(ckpt):
    """Prompts sharing 64 tokens, one after the other, 64 tokens a step: the later ones start from the Mamba2 /
    short-conv state kept at 64 (and the continuation from the first prompt's last boundary, 80); every answer
    equals caching off and transformers'."""
    shared = _tokens(64, 7)
    first = shared + _tokens(30, 8)
    prompts = [first, shared + _tokens(20, 9), first + _tokens(20, 16)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    on, off = _engine(ckpt.loaded, True), _engine(ckpt.loaded, False)
    got = [[list(o.outputs[0].token_ids) for o in run_engine(e, [p], params)] for p in prompts for e in (on, off)]
    assert got[0::2] == got[1::2]
    assert all(_hf_greedy_agrees(ckpt.hf, p, g[0]) for p, g in zip(prompts, got[0::2]))
    assert on.stats().prefix_cache_hits == 64 + 80 and off.stats().prefix_cache_hits == 0
    assert on.kv.num_free_blocks == on.kv.num_blocks


def test_mamba_cache_mode_all_hits_the_second_prompt_at_the_shared_prefix_end(ckpt):
    """--mamba-cache-mode all, 64 tokens a step: the first prompt leaves its Mamba2 / short-conv state at every
    block boundary inside its chunks, so the second prompt on its 100-token system prompt hits at 96 (align: not
    before the third); answers equal caching off and transformers'; every block and checkpoint row comes back."""
    system = _tokens(100, 20)
    prompts = [system + _tokens(30 + i, 21 + i) for i in range(2)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    on, off = _engine(ckpt.loaded, True, "all"), _engine(ckpt.loaded, False)
    got = [[list(o.outputs[0].token_ids) for o in run_engine(e, [p], params)] for p in prompts for e in (on, off)]
    assert got[0::2] == got[1::2]
    assert all(_hf_greedy_agrees(ckpt.hf, p, g[0]) for p, g in zip(prompts, got[0::2]))
    assert on.stats().prefix_cache_hits == 96
    ck = on.kv.recurrent.checkpoints
    assert ck is not None and not ck.holds and not ck.unwritten and ck.counts()[0] > 0
    assert on.kv.num_free_blocks == on.kv.num_blocks


@pytest.mark.parametrize("kind", FAMILIES)
def test_the_fused_step_computes_what_the_torch_path_does(kind, tmp_path):
    """int8 weights (a shared MLP of 64: every matmul quantized), the fused C step (the causal conv, Mamba2's SSM
    and gated group norm, the short conv's gates, token by token on the state slots) against the torch path
    (its chunked scan, conv1d): a prompt in two chunks over shuffled blocks, 8 greedy decode tokens: the same
    tokens, logits within the tolerance; then prompts sharing 64 tokens through the engine with prefix caching
    (hits start from state checkpoints): the same answers on both paths."""
    from model_helpers import fused_and_torch

    from pagedllm.model.fused_step import _model_blockers

    make_hybrid(kind, str(tmp_path), shared=64)
    loaded = load_model(str(tmp_path), "float32", "cpu", False, "int8", quantized_activations="none")
    assert not _model_blockers(loaded.config)
    got = fused_and_torch(loaded, _tokens(70, 1), 29, 8)
    (fused, fused_tokens), (want, want_tokens) = got[True], got[False]
    assert fused_tokens == want_tokens
    assert (fused - want).abs().max().item() < TOL * want.abs().max().item()
    shared = _tokens(64, 7)
    prompts = [shared + _tokens(30, 8), shared + _tokens(20, 9)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    answers = {}
    for path in ("fused", "torch"):
        engine = _engine(loaded, True)
        assert engine.runner.fused is not None
        if path == "torch":
            engine.runner.fused = None
        answers[path] = [list(run_engine(engine, [p], params)[0].outputs[0].token_ids) for p in prompts]
        assert engine.stats().prefix_cache_hits == 64
    assert answers["fused"] == answers["torch"]


@pytest.mark.parametrize("kind", FAMILIES)
def test_the_fused_step_writes_the_states_at_marks_as_the_torch_path(kind, tmp_path):
    """Prompt chunks with prefix-cache checkpoints inside them (state marks, --mamba-cache-mode all) beside another
    sequence's marked chunk, then beside its decode token, on the fused C step and on the torch path: the same
    logits, and every mark row and slot of every Mamba2 / short-conv layer (its conv state, and Mamba2's SSM
    state) the same within the tolerance."""
    from model_helpers import assert_marked_states_match, marks_fused_and_torch

    make_hybrid(kind, str(tmp_path), shared=64)
    loaded = load_model(str(tmp_path), "float32", "cpu", False, "int8", quantized_activations="none")
    assert_marked_states_match(marks_fused_and_torch(loaded, _tokens(70, 1), _tokens(9, 2)), TOL)


@pytest.mark.parametrize("kind", ["granitemoehybrid", "nemotron_h"])
@pytest.mark.parametrize("sizes", [(100, 50), (64, 64, 22)])
def test_long_marked_prompt_chunks_on_the_fused_step_match_the_torch_path(kind, sizes, tmp_path):
    """A 150-token prompt in chunks longer than the C step's 64-token scan chunk (100 + 50) and in chunked prefill
    of 64, marked at every block boundary (recurrent.c's chunked Mamba2 scan ends a chunk at each mark), then
    decode: the fused step's logits and every state row (slot and marks, conv and SSM) equal the torch path's."""
    from model_helpers import assert_long_marked_chunks_match

    make_hybrid(kind, str(tmp_path), shared=64)
    loaded = load_model(str(tmp_path), "float32", "cpu", False, "int8", quantized_activations="none")
    assert_long_marked_chunks_match(loaded, _tokens(150, 6), sizes, TOL)


@pytest.mark.parametrize("target", [t for t in ("x86-64-v3", "x86-64") if t in cpu_kernel.runnable_targets()])
def test_the_recurrent_kernels_of_every_cpu_class(target, tmp_path):
    """recurrent.c built for AVX2 and for the portable class: Granite 4.0-H's Mamba2 layers (the read-out's simd.h
    sums), LFM2's short conv and Nemotron-H's single-block layers on the fused step equal the torch path on the same
    int8 weights, their states at marks too."""
    from model_helpers import assert_marked_states_match, cpu_target, fused_and_torch, marks_fused_and_torch

    for kind in ("granitemoehybrid", "lfm2", "nemotron_h"):
        make_hybrid(kind, str(tmp_path / kind), shared=64)
        loaded = load_model(str(tmp_path / kind), "float32", "cpu", False, "int8", quantized_activations="none")
        with cpu_target(target):
            got = fused_and_torch(loaded, _tokens(70, 1), 29, 8)
            marked = marks_fused_and_torch(loaded, _tokens(70, 1), _tokens(9, 2))
        (fused, fused_tokens), (want, want_tokens) = got[True], got[False]
        assert fused_tokens == want_tokens, kind
        assert (fused - want).abs().max().item() < TOL * want.abs().max().item(), kind
        assert_marked_states_match(marked, TOL)


def run_engine(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[str(i)] for i in range(len(prompts))]


def test_llm_generate_and_server(tmp_path_factory):
    """LLM(folder).generate and /v1/completions on a Granite 4.0-H folder: the same greedy text, transformers'
    tokens; a kv_blend request a 400 saying why; the pool whole afterwards."""
    from server_helpers import assert_pool_whole, running_server

    from pagedllm import LLM
    from pagedllm.engine.async_engine import AsyncLLMEngine

    folder = str(tmp_path_factory.mktemp("granite-llm"))
    hf = make_hybrid("granitemoehybrid", folder)
    args = dict(dtype="float32", max_model_len=256, max_num_seqs=4, kv_cache_memory=32 * 2**20, log_stats_interval=0)
    llm = LLM(folder, **args)
    prompt = " ".join(f"t{i}" for i in range(7, 40))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = llm.generate([prompt, prompt + " t3"], params, use_tqdm=False)
    for o in out:
        assert len(o.prompt_token_ids) > 30 and _hf_greedy_agrees(
            hf, list(o.prompt_token_ids), list(o.outputs[0].token_ids)
        )
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=folder, **args)))
    with running_server(engine, served_model_name=["m"]) as s:
        r = s.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == out[0].outputs[0].text
        # kv_blend moves a segment's K/V to another position; a recurrent state cannot move: a 400 naming it
        blend = {"prompt": prompt, "max_tokens": 4, "kv_blend": {"segments": [[0, 16]]}}
        r = s.http.post("/v1/completions", json=blend)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "BadRequestError" and "kv_blend cannot run" in err["message"], err
        assert "its Mamba2 layers (layers 0, 2) keep a conv state and an SSM state" in err["message"], err
        assert_pool_whole(s)


def test_kv_blend_is_refused_naming_the_recurrent_layers(ckpt):
    """kv_blend moves a segment's K/V to another position, which a Mamba2 or short-conv state cannot follow: a
    UserError (HTTP 400) naming the layers by their kind and the state they keep, nothing held afterwards."""
    from pagedllm.errors import UserError

    layers = ", ".join(map(str, LINEAR_LAYERS.get(ckpt.kind, [0, 2])))
    kind = "short-convolution" if ckpt.kind == "lfm2" else "Mamba2"
    state = "a conv state (their last inputs)" if ckpt.kind == "lfm2" else "a conv state and an SSM state"
    engine = _engine(ckpt.loaded, True)
    with pytest.raises(UserError, match=re.escape(f"its {kind} layers (layers {layers}) keep {state} per request")):
        engine.add_request("x", _tokens(40, 12), SamplingParams(max_tokens=1), kv_segments=[[0, 32]])
    assert not engine.has_unfinished_requests() and engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("kind", ["granitemoehybrid", "lfm2", "nemotron_h"])
def test_kv_calc_shows_state_bytes(kind, tmp_path, capsys):
    """`pagedllm kv-calc --model` names each family's recurrent-state bytes per request: Mamba2's conv rows and
    float32 SSM state, the short conv's rows only, as the engine reserves them; Nemotron-H's KV of its two
    attention layers only, its MLP layers holding neither KV nor state."""
    from pagedllm.entrypoints.cli import main

    make_hybrid(kind, str(tmp_path))
    cfg = load_model_config(str(tmp_path))
    assert main(["kv-calc", "--model", str(tmp_path), "--dtype", "float32", "--kv-cache-dtype", "auto"]) == 0
    out = capsys.readouterr().out
    if kind == "lfm2":  # 3 conv layers x 64 channels x 2 kept inputs x 4 bytes
        want = 3 * 64 * 2 * 4
    else:  # 2 Mamba2 layers: conv (128 + 2 x 2 x 16 channels) x 3 inputs x 4, SSM 8 heads x 16 x 16 x 4
        want = 2 * ((128 + 64) * 3 * 4 + 8 * 16 * 16 * 4)
    assert state_bytes(cfg, torch.float32) == want
    assert f"recurrent state: {want:,} bytes per request" in out
    if kind == "nemotron_h":  # 2 attention layers x K and V x 2 heads x 16 x 4 bytes a token
        assert "full attention: 2 layers, 512 bytes per token" in out, out
        assert "2 MLP-only layers (no mixer): no KV, no state" in out
        assert "mamba2, layers 0, 4: no KV" in out


def test_checkpoint_errors_are_named(tmp_path):
    """A Mamba2 shape the mixer cannot run (groups that do not divide the heads) and a missing SSM tensor are a
    ModelLoadError naming them, not a crash at the first step."""
    import shutil

    from safetensors.torch import load_file, save_file

    from pagedllm.errors import ModelLoadError

    src = str(tmp_path / "ok")
    make_hybrid("granitemoehybrid_dense", src)
    bad = str(tmp_path / "groups")
    shutil.copytree(src, bad)
    path = os.path.join(bad, "config.json")
    raw = json.load(open(path))
    json.dump(raw | {"mamba_n_groups": 3}, open(path, "w"))
    with pytest.raises(ModelLoadError, match="3 Mamba2 groups do not divide 8 heads"):
        load_model_config(bad)
    missing = str(tmp_path / "missing")
    shutil.copytree(src, missing)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    tensors.pop("model.layers.2.mamba.A_log")
    save_file(tensors, os.path.join(missing, "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.2\.mamba\.A_log"):
        load_model(missing, dtype="float32", verbose=False)


@pytest.mark.parametrize("fmt", ["f32", "q8_0", "q4_0"])
def test_lfm2_gguf_matches_transformers(fmt, tmp_path):
    """An LFM2 GGUF with llama.cpp's tensor names (F32, Q8_0, Q4_0, the quantized ones run as stored): the config it
    reads is the folder's; its logits over 100 tokens in chunks and decodes are transformers' on the file's
    (dequantized) weights, and so are 32 greedy tokens of three prompts through the engine with a prefix-cache hit
    (a short-conv state checkpoint), chunked prefill and forced preemption."""
    import copy

    folder = str(tmp_path / "hf")
    hf = make_hybrid("lfm2", folder)
    path = str(tmp_path / f"tiny-lfm2.{fmt}.gguf")
    ref = copy.deepcopy(hf)
    ref.load_state_dict(write_lfm2_gguf(hf, folder, fmt, path), strict=True)
    ref.eval()
    a, b = load_model_config(folder), load_model_config(path)
    keys = ["layer_types", "recurrent_mixer", "linear_conv_kernel_dim", "num_kv_heads", "intermediate_size"]
    assert {k: getattr(a, k) for k in keys} == {k: getattr(b, k) for k in keys}
    loaded = load_model(path, dtype="float32", verbose=False, quantized_activations="none")
    assert (fmt == "f32") == all(lin.quant is None for lin in loaded.model.linears())
    ids = _tokens(100, 7)
    want = _hf_logits(ref, ids)
    runner = ModelRunner(loaded, num_blocks=16, block_size=8, num_state_slots=1)
    table = list(range(13))
    got = all_logits(runner, [SeqChunk(ids[:41], 0, table)]) + all_logits(runner, [SeqChunk(ids[41:98], 41, table)])
    got += [runner.execute([SeqChunk(ids[p : p + 1], p, table)]) for p in (98, 99)]
    err = (torch.cat(got) - want).abs().max().item() / want.abs().max().item()
    assert err < TOL, f"lfm2 {fmt}: {err:.2e}"
    prompts = shared_prefix_prompts(_tokens)
    tokens = greedy_cached_chunked_preempted(hybrid_engine(loaded, 16), prompts)
    assert all(_hf_greedy_agrees(ref, p, t) for p, t in zip(prompts, tokens)), fmt
