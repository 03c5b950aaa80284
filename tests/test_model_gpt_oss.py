"""gpt-oss (issue 34) against transformers float32 on a tiny random checkpoint: 4 layers alternating sliding (a
window of 8, shorter than every prompt) and full attention, sinks, q/k/v/o biases, gpt-oss's YaRN (its
correction range not rounded, truncate false, which changes two of the eight frequencies), 4 experts of which 2
route, with biases and the clamped SwiGLU. From the HF folder (transformers 5's 3-D, interleaved experts) and
from GGUF files written as llama.cpp's converter writes gpt-oss (attn_sinks, ffn_gate_inp + bias,
ffn_{gate,up,down}_exps + biases) in F32, Q8_0, Q4_0 and MXFP4.

The window and the sinks are each shown to matter: transformers with one of them off picks other greedy tokens
than the ones the engine (and transformers with both) picks, so the parity checks see both."""

from __future__ import annotations

import copy
import json
import os
import random

import numpy as np
import pytest
import torch
from model_helpers import all_logits, cpu_target, fused_and_torch

from devkit.family_helpers import _decode, _encode, _metadata, _randomize, _tokenizer_metadata, save_tokenizer
from pagedllm import SamplingParams
from pagedllm.engine import EngineConfig, LLMEngine
from pagedllm.kv import kv_bytes_per_token
from pagedllm.model import ModelRunner, SeqChunk, load_model, load_model_config
from pagedllm.model.kernels import cpu_kernel

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TOL = 1e-4  # of the largest logit
DOT_TOL = 2e-3  # the dot route's bound against the exact path (test_model_families.py's)
TARGETS = [t for t in ("native", "x86-64-v3") if t in cpu_kernel.runnable_targets()]
WINDOW = 8
CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=WINDOW,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,  # gpt-oss's: the correction range falls between whole dims
        "rope_theta": 150000.0,
    },
)


def make_gpt_oss(folder: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, GptOssConfig

    cfg = GptOssConfig(**CONFIG)
    cfg.architectures = ["GptOssForCausalLM"]
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    _randomize(hf, "gpt_oss")  # weights, biases and sinks all drawn large enough to matter
    hf.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(folder)
    return hf


def _converted(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """llama.cpp's GptOssModel.modify_tensors for one HF tensor: sinks get `.weight`, the 3-D experts are
    transposed back to [experts, out, in] and gate / up split from their interleaved columns."""
    if name.endswith("sinks"):
        return [(name + ".weight", t)]
    if name.endswith("gate_up_proj_bias"):
        base = name.removesuffix("gate_up_proj_bias")
        return [(base + "gate_proj.bias", t[..., ::2]), (base + "up_proj.bias", t[..., 1::2])]
    if name.endswith("gate_up_proj"):
        w = t.transpose(-1, -2)
        base = name.removesuffix("gate_up_proj")
        return [(base + "gate_proj.weight", w[:, ::2]), (base + "up_proj.weight", w[:, 1::2])]
    if name.endswith("down_proj_bias"):
        return [(name.removesuffix("_bias") + ".bias", t)]
    if name.endswith("down_proj"):
        return [(name + ".weight", t.transpose(-1, -2))]
    return [(name, t)]


def _interleaved(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Gate and up ([experts, ffn, ...]) back into transformers' alternating rows (gate the even ones)."""
    both = torch.stack([gate, up], dim=2)  # [experts, ffn, 2, ...]
    return both.reshape(gate.shape[0], 2 * gate.shape[1], *gate.shape[2:])


def _reference(pieces: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """The file's values in transformers' layout (experts merged back): the state dict the file stands for."""
    t = {name: torch.from_numpy(arr.copy()) for name, arr in pieces.items()}
    out: dict[str, torch.Tensor] = {}
    for name, value in t.items():
        base = name.split(".experts.")[0] + ".experts."
        if name.endswith("experts.gate_proj.weight"):
            out[base + "gate_up_proj"] = _interleaved(value, t[base + "up_proj.weight"]).transpose(-1, -2)
        elif name.endswith("experts.gate_proj.bias"):
            out[base + "gate_up_proj_bias"] = _interleaved(value, t[base + "up_proj.bias"])
        elif name.endswith("experts.down_proj.weight"):
            out[base + "down_proj"] = value.transpose(-1, -2)
        elif name.endswith("experts.down_proj.bias"):
            out[base + "down_proj_bias"] = value
        elif name.endswith("sinks.weight"):
            out[name.removesuffix(".weight")] = value
        elif ".experts.up_proj." not in name:
            out[name] = value
    return {name: value.contiguous() for name, value in out.items()}


def write_gguf(folder: str, fmt: str, path: str) -> dict[str, torch.Tensor]:
    """The HF checkpoint as llama.cpp writes a gpt-oss GGUF (norms, biases, sinks and the router in F32); returns
    the HF-named state dict of the file's values."""
    import gguf
    from safetensors import safe_open

    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, cfg["num_hidden_layers"])
    target = gguf.GGMLQuantizationType[fmt.upper()]
    w = gguf.GGUFWriter(path, "gpt-oss")
    w.add_name("tiny-gpt-oss")
    _metadata(w, "gpt_oss", cfg)
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    _tokenizer_metadata(w, [])
    pieces: dict[str, np.ndarray] = {}
    with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as st:
        for hf_name in st.keys():
            for name, t in _converted(hf_name, st.get_tensor(hf_name).float()):
                new = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
                assert new is not None, name
                keep = name.endswith(("norm.weight", ".bias", "sinks.weight")) or ".router." in name
                qtype = gguf.GGMLQuantizationType.F32 if keep else target
                data = _encode(t.contiguous().numpy(), qtype)
                w.add_tensor(new, data, raw_dtype=qtype)
                pieces[name] = _decode(data, qtype, tuple(t.shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return _reference(pieces)


def _kept(fmt: str) -> str | None:
    """A quantized file's weights kept as stored whatever the kernel choice measured (--quantization auto follows
    a timing, and a test never rests on the machine's speed)."""
    return "gguf" if fmt in ("q8_0", "q4_0", "mxfp4") else None


class Checkpoints:
    """The HF folder and, made on first use, its GGUF files, each with its reference and pagedllm model."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.hf = make_gpt_oss(folder)
        self._made: dict[str, tuple[str, torch.nn.Module]] = {}
        self._loaded: dict[str, object] = {}
        self._greedy: dict[str, list[list[int]]] = {}

    def get(self, fmt: str) -> tuple[str, torch.nn.Module]:
        if fmt == "hf":
            return self.folder, self.hf
        if fmt not in self._made:
            os.makedirs(self.folder + "-gguf", exist_ok=True)  # apart: transformers reads a tokenizer_config beside it
            path = os.path.join(self.folder + "-gguf", f"tiny-gpt-oss.{fmt}.gguf")
            ref = copy.deepcopy(self.hf)
            missing, unexpected = ref.load_state_dict(write_gguf(self.folder, fmt, path), strict=False)
            assert not missing and not unexpected, (missing, unexpected)
            self._made[fmt] = (path, ref.eval())
        return self._made[fmt]

    def loaded(self, fmt: str):
        if fmt not in self._loaded:
            self._loaded[fmt] = load_model(
                self.get(fmt)[0], dtype="float32", verbose=False, quantization=_kept(fmt), quantized_activations="none"
            )
        return self._loaded[fmt]

    def greedy(self, fmt: str) -> list[list[int]]:
        """The engine's greedy tokens for PROMPTS from `fmt`."""
        if fmt not in self._greedy:
            self._greedy[fmt] = _engine_greedy(self.loaded(fmt), PROMPTS)
        return self._greedy[fmt]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Checkpoints:
    return Checkpoints(str(tmp_path_factory.mktemp("gpt_oss")))


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, 256) for _ in range(n)]


@torch.inference_mode()
def _hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


def _hf_greedy_agrees(model: torch.nn.Module, prompt: list[int], generated: list[int]) -> bool:
    """Whether transformers' greedy decoding of `prompt` gives `generated` (one pass over the whole sequence)."""
    logits = _hf_logits(model, prompt + generated)[len(prompt) - 1 : -1]
    return logits.argmax(-1).tolist() == generated


FORMATS = ["hf", "f32", "q8_0", "q4_0", "mxfp4"]  # MXFP4: how gpt-oss ships its experts


@pytest.mark.parametrize("fmt", FORMATS)
def test_logits_match_transformers(ckpt, fmt):
    """~100 tokens prefilled in two chunks over shuffled blocks, then one decoded (the C kernel's sinks and
    window): every position's logits within float32 accuracy of transformers on the same values."""
    _, ref = ckpt.get(fmt)
    loaded = ckpt.loaded(fmt)
    assert loaded.config.family == "gpt_oss" and loaded.config.attention_sinks
    ids = _tokens(100, 1)
    want = _hf_logits(ref, ids)
    runner = ModelRunner(loaded, num_blocks=32, block_size=8)
    table = random.Random(2).sample(range(32), 16)
    first = all_logits(runner, [SeqChunk(ids[:37], 0, table)])[0]
    rest = all_logits(runner, [SeqChunk(ids[37:-1], 37, table)])[0]
    last = runner.execute([SeqChunk(ids[-1:], len(ids) - 1, table)])
    got = torch.cat([first, rest, last])
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err < TOL, f"{fmt}: {err:.2e}"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "mxfp4"])
@pytest.mark.parametrize("activations", ["none", "int16"])
def test_the_fused_step_computes_what_the_torch_path_does(ckpt, fmt, activations, target):
    """gpt-oss's layer in the one C call (sinks in prefill tiles and decode, the window on every other layer,
    YaRN, q/k/v/o biases, the router's bias and top-k softmax, expert biases and the clamped SwiGLU) against
    the torch path on the same quantized weights, on this CPU's build and the AVX2 one: the same greedy tokens
    past the window, logits within the bound of each."""
    path, _ = ckpt.get(fmt)
    loaded = (
        ckpt.loaded(fmt)
        if activations == "none"
        else load_model(path, dtype="float32", verbose=False, quantization="gguf", quantized_activations=activations)
    )
    with cpu_target(target):
        got = fused_and_torch(loaded, _tokens(60, 9), 29, 8)
    (fused, fused_tokens), (want, want_tokens) = got[True], got[False]
    assert fused_tokens == want_tokens, f"{fmt} {activations} {target}"
    err = (fused - want).abs().max().item() / want.abs().max().item()
    assert err < (TOL if activations == "none" else DOT_TOL), f"{fmt} {activations} {target}: {err:.2e}"


def _engine_greedy(loaded, prompts: list[list[int]]) -> list[list[int]]:
    """32 greedy tokens per prompt in one engine with prefix caching, chunked prefill (16 tokens a step) and a
    KV cache small enough to preempt."""
    cfg = loaded.config
    layers_per_block = cfg.kv_layout(hybrid=True).layers_per_block  # a block spans one group's layers
    per_block = kv_bytes_per_token(layers_per_block, cfg.num_kv_heads, cfg.head_dim, 4) * 8
    engine = LLMEngine(
        EngineConfig(
            block_size=8,
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
    return [list(done[str(i)].outputs[0].token_ids) for i in range(len(prompts))]


PROMPTS = [_tokens(24, 3) + _tokens(46, 4), _tokens(24, 3) + _tokens(50, 5), _tokens(66, 6)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_tokens_match_transformers(ckpt, fmt):
    _, ref = ckpt.get(fmt)
    for i, (p, tokens) in enumerate(zip(PROMPTS, ckpt.greedy(fmt))):
        assert len(tokens) == 32 and _hf_greedy_agrees(ref, p, tokens), f"{fmt} prompt {i}"


def test_the_window_and_the_sinks_each_change_transformers_tokens(ckpt):
    """transformers without the sinks (each -inf: no weight) or without the window (every layer full) would
    not pick the tokens the engine picks, so the parity tests above see both."""
    _, ref = ckpt.get("hf")
    tokens = ckpt.greedy("hf")[0]
    assert _hf_greedy_agrees(ref, PROMPTS[0], tokens)
    no_sinks = copy.deepcopy(ref)
    for layer in no_sinks.model.layers:
        layer.self_attn.sinks.data.fill_(float("-inf"))
    no_window = copy.deepcopy(ref)
    no_window.config.layer_types = ["full_attention"] * len(no_window.model.layers)
    assert not _hf_greedy_agrees(no_sinks, PROMPTS[0], tokens)
    assert not _hf_greedy_agrees(no_window, PROMPTS[0], tokens)


def test_the_gguf_describes_the_same_model(ckpt):
    a, b = load_model_config(ckpt.folder), load_model_config(ckpt.get("f32")[0])
    keys = ["num_layers", "num_heads", "num_kv_heads", "head_dim", "attention_bias", "o_proj_bias", "attention_sinks"]
    keys += ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "moe_router", "router_bias"]
    keys += ["expert_bias", "moe_activation", "swiglu_alpha", "swiglu_limit", "rope_theta", "max_position_embeddings"]
    assert {k: getattr(a, k) for k in keys} == {k: getattr(b, k) for k in keys}
    assert {k: v for k, v in (a.rope_scaling or {}).items() if k != "rope_theta"} == b.rope_scaling
    assert [a.layer_window(i) for i in range(4)] == [b.layer_window(i) for i in range(4)] == [WINDOW, None] * 2


def test_a_harmony_vocabulary_stops_on_return_and_call_not_end():
    """A GGUF names one EOS; a gpt-oss answer ends with <|return|> or <|call|>, and its <|end|> (Phi-3's end of
    turn) only ends a message inside it."""
    from types import SimpleNamespace

    from pagedllm.model.tokenizer import end_of_generation_ids

    harmony = {"<|end|>": 7, "<|return|>": 2, "<|call|>": 12, "<|start|>": 6}
    assert end_of_generation_ids(SimpleNamespace(get_vocab=lambda: harmony)) == [2, 12]
    phi3 = {"<|end|>": 7, "<|endoftext|>": 0}
    assert end_of_generation_ids(SimpleNamespace(get_vocab=lambda: phi3)) == [7]


def test_an_mxfp4_hf_folder_is_refused_by_name(ckpt, tmp_path):
    """OpenAI's upload keeps the experts as MXFP4 blocks and scales, which the HF loader does not read: a clear
    error up front, not a list of unknown tensors."""
    from pagedllm.errors import ModelLoadError

    with open(os.path.join(ckpt.folder, "config.json")) as f:
        cfg = json.load(f) | {"quantization_config": {"quant_method": "mxfp4"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="MXFP4"):
        load_model_config(str(tmp_path))
