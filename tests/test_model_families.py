"""Every supported family, from its HF folder and from GGUF files written as llama.cpp's converter writes them (F32,
F16, Q8_0, Q4_0), against transformers in float32 on tiny random checkpoints (devkit/family_helpers.py).

The reference of a GGUF is the same transformers model holding the file's (dequantized) values, so each format
is held to float32 accuracy. Sequences run past the original context of the scaled RoPE types (64 tokens
here); the sliding windows (256) are longer than every sequence until the paged cache masks windows.
"""

from __future__ import annotations

import copy
import json
import os
import random

import pytest
import torch
from model_helpers import all_logits, fused_and_torch

from devkit.family_helpers import CHAT_TEMPLATE, FAMILIES, ORIG_CTX, SPECS, make_family, write_gguf
from devkit.tiny_tokenizer import save_tiny_tokenizer
from pagedllm import SamplingParams
from pagedllm.engine import EngineConfig, LLMEngine
from pagedllm.errors import ModelLoadError
from pagedllm.kv import kv_bytes_per_token
from pagedllm.model import ModelRunner, SeqChunk, load_model, load_model_config, load_tokenizer

FORMATS = ["hf", "f32", "f16", "q8_0", "q4_0"]
QUANTIZED = ("q8_0", "q4_0")  # the formats kept quantized, so run by the fused C step
TOL = 1e-4  # of the largest logit
DOT_TOL = 2e-3  # the dot route's bound (test_the_dot_route_is_within_its_bound_of_the_exact_path)


def _kept(fmt: str) -> str | None:
    """A GGUF's weights kept as stored whatever the kernel choice measured (--quantization auto follows a timing,
    and a test never rests on the machine's speed): what auto gives where the choice is the quantized kernel."""
    return None if fmt == "hf" else "gguf"


class Checkpoints:
    """One family's HF folder and, made on first use, its GGUF files, each with its reference and pagedllm model."""

    def __init__(self, family: str, folder: str) -> None:
        self.family, self.folder = family, folder
        self.hf = make_family(family, folder)
        self._made: dict[str, tuple[str, torch.nn.Module]] = {}
        self._loaded: dict[str, object] = {}

    def get(self, fmt: str) -> tuple[str, torch.nn.Module]:
        """(path, transformers reference) of `fmt`."""
        if fmt == "hf":
            return self.folder, self.hf
        if fmt not in self._made:
            os.makedirs(self.folder + "-gguf", exist_ok=True)  # apart: transformers reads a tokenizer_config beside it
            path = os.path.join(self.folder + "-gguf", f"tiny-{self.family}.{fmt}.gguf")
            ref = copy.deepcopy(self.hf)
            ref.load_state_dict(write_gguf(self.folder, self.family, fmt, path), strict=False)
            self._made[fmt] = (path, ref.eval())
        return self._made[fmt]

    def loaded(self, fmt: str):
        if fmt not in self._loaded:
            self._loaded[fmt] = load_model(
                self.get(fmt)[0], dtype="float32", verbose=False, quantization=_kept(fmt), quantized_activations="none"
            )
        return self._loaded[fmt]


pytestmark = pytest.mark.usefixtures("one_thread", "private_tokenizer_cache")  # tests/conftest.py


@pytest.fixture(scope="module", params=FAMILIES)
def ckpt(request, tmp_path_factory) -> Checkpoints:
    return Checkpoints(request.param, str(tmp_path_factory.mktemp(request.param)))


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, 256) for _ in range(n)]


@torch.inference_mode()
def _hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("fmt", FORMATS)
def test_logits_match_transformers(ckpt, fmt):
    """A prompt past the original context, prefilled in two chunks over shuffled blocks, then decoded: every
    position's logits within float32 accuracy of transformers on the same values."""
    path, ref = ckpt.get(fmt)
    loaded = ckpt.loaded(fmt)
    family = {"llama3": "llama", "qwen2-yarn": "qwen2"}.get(ckpt.family, ckpt.family)
    assert loaded.config.family == ("llama" if family == "mistral" and fmt != "hf" else family)  # GGUF says llama
    ids = _tokens(ORIG_CTX + 40, 1)
    want = _hf_logits(ref, ids)
    runner = ModelRunner(loaded, num_blocks=32, block_size=8)
    table = random.Random(2).sample(range(32), 16)
    first = all_logits(runner, [SeqChunk(ids[:37], 0, table)])[0]
    rest = all_logits(runner, [SeqChunk(ids[37:-1], 37, table)])[0]
    last = runner.execute([SeqChunk(ids[-1:], len(ids) - 1, table)])
    got = torch.cat([first, rest, last])
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err < TOL, f"{ckpt.family} {fmt}: {err:.2e}"
    if fmt in QUANTIZED:
        assert runner.fused is not None  # every family runs the fused C step (F16 too where it stays F16)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_the_dot_route_is_within_its_bound_of_the_exact_path(ckpt, fmt):
    """16-bit activations (the default on a CPU with vector kernels, --quantized-activations int16) give the
    exact path's logits within 2e-3 of the largest, prefill and decode alike: the rounding of each input to
    1/65534 of its group's largest, through every layer. And like the exact path in the fused C step, a
    token's logits there do not depend on how its prompt was chunked."""
    if fmt not in FORMATS:
        pytest.skip(f"{fmt} is not written for this family")
    path, _ = ckpt.get(fmt)
    exact = ckpt.loaded(fmt)
    dot = load_model(path, dtype="float32", verbose=False, quantization="gguf", quantized_activations="int16")
    assert all(w.dot for w in dot.model.quant_weights())
    ids = _tokens(48, 3)
    logits = []
    for loaded in (exact, dot):
        runner = ModelRunner(loaded, num_blocks=16, block_size=8)
        table = list(range(16))
        prefill = all_logits(runner, [SeqChunk(ids[:40], 0, table)])[0]
        steps = [runner.execute([SeqChunk([t], 40 + i, table)]) for i, t in enumerate(ids[40:])]
        logits.append(torch.cat([prefill, *steps]))
    want, got = logits
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert 0 < err < 2e-3, f"{ckpt.family} {fmt}: {err:.2e}"  # 0: the route did not run
    runner = ModelRunner(dot, num_blocks=16, block_size=8)
    if runner.fused is None:
        return  # the torch path's attention differs with the chunk, whatever the matmuls
    table = list(range(16))
    halves = [
        all_logits(runner, [SeqChunk(ids[:17], 0, table)])[0],
        all_logits(runner, [SeqChunk(ids[17:40], 17, table)])[0],
    ]
    assert torch.equal(torch.cat(halves), got[:40])


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("activations", ["none", "int16"])
def test_the_fused_step_computes_what_the_torch_path_does(ckpt, fmt, activations):
    """Every family's layer (q/k norms, (1 + w) and post norms, GeGLU, soft-caps, multipliers, partial rotary,
    NoPE and two-base RoPE layers) in the one C call, against the torch path on the same quantized weights,
    float32 activations and the dot route's alike: the same greedy tokens, logits within the bound of each."""
    path, _ = ckpt.get(fmt)
    loaded = (
        ckpt.loaded(fmt)
        if activations == "none"
        else load_model(path, dtype="float32", verbose=False, quantization="gguf", quantized_activations=activations)
    )
    ids = _tokens(ORIG_CTX + 6, 9)  # past the original context of the scaled RoPE types
    got = fused_and_torch(loaded, ids, 29, 8)
    (fused, fused_tokens), (want, want_tokens) = got[True], got[False]
    assert fused_tokens == want_tokens, f"{ckpt.family} {fmt} {activations}"
    err = (fused - want).abs().max().item() / want.abs().max().item()
    assert err < (TOL if activations == "none" else DOT_TOL), f"{ckpt.family} {fmt} {activations}: {err:.2e}"


@pytest.mark.parametrize("head_dim", [24, 256])
def test_the_fused_step_takes_any_head_size_and_an_output_bias(tmp_path, head_dim):
    """What no family above has: a head size no multiple of the vector width (24: the attention's scalar path)
    and Gemma 3's 256, with Llama's attention_bias (a bias on o_proj too), int8 weights from an HF folder:
    the fused step against the torch path."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=head_dim, attention_bias=True, rms_norm_eps=1e-5, tie_word_embeddings=True,
    )  # fmt: skip
    cfg.architectures = ["LlamaForCausalLM"]
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(("norm" in name) + 0.25 * torch.randn_like(p))
    hf.save_pretrained(str(tmp_path))
    save_tiny_tokenizer(str(tmp_path), 256)
    loaded = load_model(
        str(tmp_path), dtype="float32", quantization="int8", verbose=False, quantized_activations="none"
    )
    assert loaded.config.o_proj_bias and loaded.model.layers[0].o.bias is not None
    got = fused_and_torch(loaded, _tokens(40, 10), 23, 8)
    assert got[True][1] == got[False][1]
    want = got[False][0]
    assert (got[True][0] - want).abs().max().item() / want.abs().max().item() < TOL


def _hf_greedy_agrees(model: torch.nn.Module, prompt: list[int], generated: list[int]) -> bool:
    """Whether transformers' greedy decoding of `prompt` gives `generated`: each token is the argmax of its
    logits given the ones before (one forward pass over the whole sequence instead of one per token)."""
    logits = _hf_logits(model, prompt + generated)[len(prompt) - 1 : -1]
    return logits.argmax(-1).tolist() == generated


@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_tokens_match_transformers(ckpt, fmt):
    """32 greedy tokens for three prompts in one engine with prefix caching (two prompts share 24 tokens),
    chunked prefill (16 tokens a step) and a KV cache small enough to preempt: transformers' tokens."""
    _, ref = ckpt.get(fmt)
    loaded = ckpt.loaded(fmt)
    cfg = loaded.config
    shared = _tokens(24, 3)
    prompts = [shared + _tokens(46, 4), shared + _tokens(50, 5), _tokens(66, 6)]  # past the original context
    block = 8
    per_block = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4) * block
    engine = LLMEngine(
        EngineConfig(
            block_size=block,
            max_num_batched_tokens=16,
            kv_cache_memory=24 * per_block,
            max_model_len=128,
            log_stats_interval=0,
        ),
        loaded,
    )
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    for i, p in enumerate(prompts):
        tokens = list(done[str(i)].outputs[0].token_ids)
        assert len(tokens) == 32 and _hf_greedy_agrees(ref, p, tokens), f"{ckpt.family} {fmt} prompt {i}"


def test_stop_tokens_and_chat_template_come_from_each_file(ckpt):
    """HF folder: generation_config.json's EOS list; GGUF: its EOS and the end-of-turn tokens of its vocabulary
    (as llama.cpp stops on <|eot_id|>, <end_of_turn>, <|im_end|>); both: the file's own chat template."""
    hf_tok = load_tokenizer(ckpt.folder)
    assert hf_tok.eos_token_ids == [2, 3] and hf_tok.chat_template == CHAT_TEMPLATE
    gguf_tok = load_tokenizer(ckpt.get("f32")[0])
    stops = [gguf_tok.convert_ids_to_tokens(i) for i in gguf_tok.eos_token_ids]
    assert sorted(stops) == sorted(["</s>", "<|eot_id|>", "<end_of_turn>", "<|im_end|>"])
    assert gguf_tok.chat_template == CHAT_TEMPLATE


def test_gguf_config_describes_the_same_model(ckpt):
    """The GGUF header gives the shape the HF config.json gives (what kv-calc and the engine size from)."""
    a, b = load_model_config(ckpt.folder), load_model_config(ckpt.get("f32")[0])
    keys = ["vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "rotary_dim"]
    keys += ["tie_word_embeddings", "attention_bias", "qk_norm", "post_norms", "no_rope_layers", "rope_local_theta"]
    assert {k: getattr(a, k) for k in keys} == {k: getattr(b, k) for k in keys}
    if SPECS[ckpt.family][2] != "llama":  # llama.cpp's converter drops Mistral's window
        assert [a.layer_window(i) for i in range(a.num_layers)] == [b.layer_window(i) for i in range(b.num_layers)]


def test_dynamic_rope_matches_transformers_generation_past_the_context(tmp_path):
    """Dynamic NTK scaling changes with the sequence length in transformers; a cached key keeps its rotation, so
    each position rotates with the base transformers' cached generation uses for it: the same greedy tokens
    from a prompt inside the original context to well past it."""
    hf = make_family("llama-dynamic", str(tmp_path))
    loaded = load_model(str(tmp_path), dtype="float32", verbose=False)
    assert (
        loaded.config.rope_scaling["rope_type"] == "dynamic" and loaded.config.max_position_embeddings == 4 * ORIG_CTX
    )
    prompt, n = _tokens(40, 7), 60
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    want = out[0, len(prompt) :].tolist()
    runner = ModelRunner(loaded, num_blocks=16, block_size=8)
    table, got = list(range(16)), []
    logits = runner.execute([SeqChunk(prompt, 0, table)])
    for _ in range(n):
        got.append(int(logits[0].argmax()))
        logits = runner.execute([SeqChunk([got[-1]], len(prompt) + len(got) - 1, table)])
    assert got == want


def _config_dir(tmp_path, **over) -> str:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 16,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    } | over
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize(
    "over, named",
    [
        ({"rope_scaling": {"rope_type": "mrope", "factor": 2.0}}, "'mrope'"),
        ({"hidden_act": "relu"}, "'relu'"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"architectures": ["Gemma3ForConditionalGeneration"]}, "Gemma3ForConditionalGeneration"),
        ({"layer_types": ["chunked_attention"], "sliding_window": 8}, "chunked_attention"),
    ],
)
def test_what_pagedllm_cannot_compute_is_refused_by_name(tmp_path, over, named):
    with pytest.raises(ModelLoadError, match=named):
        load_model_config(_config_dir(tmp_path, **over))


def test_a_tensor_the_model_would_not_use_is_an_error(tmp_path):
    """A checkpoint with a weight the config does not describe (an o_proj bias here) would run as a different
    model if the tensor were skipped."""
    from safetensors.torch import load_file, save_file

    make_family("llama", str(tmp_path))
    path = str(tmp_path / "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(tensors, path)
    with pytest.raises(ModelLoadError, match="o_proj.bias"):
        load_model(str(tmp_path), dtype="float32", verbose=False)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_transformers_reads_our_gguf_as_we_do(family, tmp_path):
    """transformers' own GGUF loader as a second reference, where it reads the file completely: the same logits
    from the Q8_0 file. (It ignores llama.cpp's rope_freqs and yarn keys, and refuses Qwen3 / Phi-3 files, so
    the scaled types are checked against the HF folder above and against llama.cpp by
    benchmarks/serving/family_parity_llamacpp.py.)"""
    from transformers import AutoModelForCausalLM

    make_family(family, str(tmp_path / "hf"))
    os.makedirs(tmp_path / "gguf")
    path = str(tmp_path / "gguf" / "m.gguf")
    write_gguf(str(tmp_path / "hf"), family, "q8_0", path)
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path / "gguf"), gguf_file="m.gguf", dtype=torch.float32)
    ids = _tokens(80, 8)
    want = _hf_logits(theirs, ids)
    loaded = load_model(path, dtype="float32", verbose=False, quantized_activations="none")
    got = all_logits(ModelRunner(loaded, num_blocks=8, block_size=16), [SeqChunk(ids, 0, list(range(8)))])[0]
    assert (got - want).abs().max().item() / want.abs().max().item() < TOL


def _flagship_configs() -> list[tuple[str, str, dict, str]]:
    """(family, model_type, overrides, id): each supported family's transformers default config (its flagship's
    shape), Gemma 4 also as the 26B-A4B (the sparse block beside every dense MLP), and Nemotron-H as its dense
    models are (transformers' default is the MoE variant, refused by name: tests/test_model_nemotron_h.py)."""
    from pagedllm.model.families import FAMILIES as REGISTRY

    dense_h = {"hybrid_override_pattern": "M-M-M-M*-M-M-M-M*-", "num_hidden_layers": 18}
    out = [(f.name, f.model_types[0], dense_h if f.name == "nemotron_h" else {}, f.name) for f in REGISTRY]
    moe = {"enable_moe_block": True, "num_experts": 128, "top_k_experts": 8, "moe_intermediate_size": 704}
    return out + [("gemma4", "gemma4_text", moe, "gemma4-moe")]


@pytest.mark.parametrize("family, model_type, over, name", _flagship_configs(), ids=[c[3] for c in _flagship_configs()])
def test_no_supported_family_config_leaves_the_fused_step(tmp_path, family, model_type, over, name):
    """Nothing in any supported family's config is outside what the fused C step computes: no model reason for
    the "steps run on the torch path, not the fused C step" line (fused_step.unfused_reason), read from a
    config.json as the loader reads it."""
    from transformers import AutoConfig

    from pagedllm.model.families import by_architecture
    from pagedllm.model.fused_step import _model_blockers

    known = by_architecture(model_type)
    assert known is not None and known.name == family
    cfg = AutoConfig.for_model(model_type, **over)
    cfg.architectures = [known.architectures[0]]
    cfg.save_pretrained(str(tmp_path))
    loaded = load_model_config(str(tmp_path))
    assert loaded.family == family and loaded.moe_beside_mlp == name.endswith("-moe")
    assert _model_blockers(loaded) == []
