"""Every sparse (mixture-of-experts) family against transformers in float32, on tiny random checkpoints
(tests/moe_helpers.py): from the folder `save_pretrained` writes, from transformers 5's 3-D expert layout, and
from GGUF files written as llama.cpp's converter writes MoE models (F32, Q8_0, Q4_0, experts kept quantized as
stored). The reference of a GGUF is the transformers model holding the file's dequantized values.
"""

from __future__ import annotations

import copy
import os
import random

import pytest
import torch
from model_helpers import all_logits, cpu_target, fused_and_torch
from moe_helpers import FAMILIES, make_moe, save_fused, write_gguf

from pagedllm import SamplingParams
from pagedllm.engine import EngineConfig, LLMEngine
from pagedllm.errors import ModelLoadError
from pagedllm.kv import kv_bytes_per_token
from pagedllm.model import ModelRunner, SeqChunk, load_model, load_model_config
from pagedllm.model.kernels import cpu_kernel

FORMATS = ["hf", "hf3d", "f32", "q8_0", "q4_0"]
TOL = 1e-4  # of the largest logit
DOT_TOL = 2e-3  # the dot route's bound against the exact path (test_model_families.py's)
TARGETS = [t for t in ("native", "x86-64-v3") if t in cpu_kernel.runnable_targets()]


def _kept(fmt: str) -> str | None:
    """A quantized file's weights kept as stored whatever the kernel choice measured (--quantization auto follows
    a timing, and a test never rests on the machine's speed)."""
    return "gguf" if fmt in ("q8_0", "q4_0") else None


class Checkpoints:
    """One family's folder and, made on first use, its other layouts, each with its reference and loaded model."""

    def __init__(self, family: str, folder: str) -> None:
        self.family, self.folder = family, folder
        self.hf = make_moe(family, folder)
        self._made: dict[str, tuple[str, torch.nn.Module]] = {"hf": (folder, self.hf)}
        self._loaded: dict[str, object] = {}

    def get(self, fmt: str) -> tuple[str, torch.nn.Module]:
        if fmt not in self._made:
            if fmt == "hf3d":
                save_fused(self.hf, self.folder + "-3d", self.folder)
                self._made[fmt] = (self.folder + "-3d", self.hf)
            else:
                os.makedirs(self.folder + "-gguf", exist_ok=True)
                path = os.path.join(self.folder + "-gguf", f"tiny-{self.family}.{fmt}.gguf")
                ref = copy.deepcopy(self.hf)
                ref.load_state_dict(write_gguf(self.hf, self.folder, self.family, fmt, path), strict=True)
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
    """100 tokens prefilled in two chunks over shuffled blocks, then one decoded: every position's logits within
    float32 accuracy of transformers; every expert of every sparse layer served some of the tokens (routing
    differs between tokens, so a wrong router or expert shows), and a quantized file's experts stay quantized."""
    path, ref = ckpt.get(fmt)
    loaded = ckpt.loaded(fmt)
    gguf_file = fmt not in ("hf", "hf3d")
    assert loaded.config.family == ("granitemoe" if ckpt.family == "granitemoeshared" and gguf_file else ckpt.family)
    ids = _tokens(100, 1)
    want = _hf_logits(ref, ids)
    runner = ModelRunner(loaded, num_blocks=32, block_size=8)
    table = random.Random(2).sample(range(32), 16)
    before = loaded.model.expert_load.tokens.clone()
    first = all_logits(runner, [SeqChunk(ids[:37], 0, table)])[0]
    rest = all_logits(runner, [SeqChunk(ids[37:-1], 37, table)])[0]
    last = runner.execute([SeqChunk(ids[-1:], len(ids) - 1, table)])
    got = torch.cat([first, rest, last])
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err < TOL, f"{ckpt.family} {fmt}: {err:.2e}"
    served = loaded.model.expert_load.tokens - before
    cfg = loaded.config
    assert served.shape[0] == sum(map(cfg.is_moe_layer, range(cfg.num_layers))) >= 2
    assert (served > 0).all() and (served.sum(1) == len(ids) * cfg.num_experts_per_tok).all()
    experts = [e for layer in loaded.model.decoder_layers if layer.moe for e in layer.moe.experts]
    assert all((e.gate_up.quant is not None) == fmt.startswith("q") for e in experts)
    blocks = [layer.moe for layer in loaded.model.decoder_layers if layer.moe]
    assert all((b.kernel is not None) == fmt.startswith("q") for b in blocks)  # quantized: csrc/moe.c ran them


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("activations", ["none", "int16"])
def test_the_fused_step_computes_what_the_torch_path_does(ckpt, fmt, activations, target):
    """The sparse block in the one C call (its router, the routed experts through moe.c's phases, the shared
    expert and its gate, dense layers among sparse ones) against the torch path on the same quantized weights,
    float32 activations and the dot route's alike, on this CPU's build and the AVX2 one: the same greedy
    tokens, logits within the bound of each; the fused step counts the expert load as the torch path does."""
    path, _ = ckpt.get(fmt)
    loaded = (
        ckpt.loaded(fmt)
        if activations == "none"
        else load_model(path, dtype="float32", verbose=False, quantization="gguf", quantized_activations=activations)
    )
    ids = _tokens(60, 9)
    with cpu_target(target):
        got = fused_and_torch(loaded, ids, 29, 8)
        counted = {fused: _expert_load_of_a_step(loaded, ids, fused) for fused in (True, False)}
    (fused, fused_tokens), (want, want_tokens) = got[True], got[False]
    assert fused_tokens == want_tokens, f"{ckpt.family} {fmt} {activations} {target}"
    err = (fused - want).abs().max().item() / want.abs().max().item()
    assert err < (TOL if activations == "none" else DOT_TOL), f"{ckpt.family} {fmt} {activations}: {err:.2e}"
    (tokens, reads), (want_load, want_reads) = counted[True], counted[False]
    assert torch.equal(tokens, want_load) and reads == want_reads > 0
    assert (tokens.sum(1) == len(ids) * loaded.config.num_experts_per_tok).all()


def _expert_load_of_a_step(loaded, ids: list[int], fused: bool) -> tuple[torch.Tensor, int]:
    """What one prefill step of `ids` adds to the model's expert counters: tokens per expert, experts read."""
    runner = ModelRunner(loaded, num_blocks=16, block_size=8, fused=fused)
    assert (runner.fused is not None) == fused
    load = loaded.model.expert_load
    tokens, reads = load.tokens.clone(), load.reads[0]
    runner.execute([SeqChunk(ids, 0, list(range(16)))])
    return load.tokens - tokens, load.reads[0] - reads


def _hf_greedy_agrees(model: torch.nn.Module, prompt: list[int], generated: list[int]) -> bool:
    logits = _hf_logits(model, prompt + generated)[len(prompt) - 1 : -1]
    return logits.argmax(-1).tolist() == generated


@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_tokens_match_transformers(ckpt, fmt):
    """32 greedy tokens for three prompts in one engine with prefix caching (two prompts share 24 tokens),
    chunked prefill (16 tokens a step) and a KV cache small enough to preempt: transformers' tokens; the
    engine's expert counters grew by the routed tokens."""
    _, ref = ckpt.get(fmt)
    loaded = ckpt.loaded(fmt)
    cfg = loaded.config
    shared = _tokens(24, 3)
    prompts = [shared + _tokens(46, 4), shared + _tokens(50, 5), _tokens(66, 6)]
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
    before = engine.stats()
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    sparse = loaded.model.expert_load.tokens.shape[0]
    routed, reads = stats.moe_expert_tokens - before.moe_expert_tokens, stats.moe_expert_reads - before.moe_expert_reads
    assert routed > 0 and routed % (cfg.num_experts_per_tok * sparse) == 0
    assert stats.num_steps * sparse * cfg.num_experts_per_tok <= reads <= stats.num_steps * sparse * cfg.num_experts
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    for i, p in enumerate(prompts):
        tokens = list(done[str(i)].outputs[0].token_ids)
        assert len(tokens) == 32 and _hf_greedy_agrees(ref, p, tokens), f"{ckpt.family} {fmt} prompt {i}"


def test_gguf_config_describes_the_same_model(ckpt):
    """The GGUF header gives the sparse shape config.json gives (experts, routed, sizes, dense layers)."""
    a, b = load_model_config(ckpt.folder), load_model_config(ckpt.get("f32")[0])
    keys = ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"]
    keys += ["shared_expert_gate", "moe_router", "qk_norm", "hidden_size", "num_layers", "head_dim"]
    assert {k: getattr(a, k) for k in keys} == {k: getattr(b, k) for k in keys}
    assert [a.is_moe_layer(i) for i in range(a.num_layers)] == [b.is_moe_layer(i) for i in range(b.num_layers)]
    if a.moe_router == "softmax_topk":  # llama.cpp's qwen3moe and mixtral renormalise; qwen2moe and olmoe do not
        assert a.norm_topk_prob == b.norm_topk_prob


def test_dense_layers_among_sparse_ones(tmp_path):
    """decoder_sparse_step 2 and mlp_only_layers [3] of 4 layers: only layer 1 is sparse, the others run the
    dense MLP of intermediate_size; transformers' logits."""
    hf = make_moe("qwen2_moe_dense", str(tmp_path))
    loaded = load_model(str(tmp_path), dtype="float32", verbose=False)
    assert [layer.moe is not None for layer in loaded.model.decoder_layers] == [False, True, False, False]
    ids = _tokens(40, 9)
    got = all_logits(ModelRunner(loaded, num_blocks=8, block_size=8), [SeqChunk(ids, 0, list(range(8)))])[0]
    want = _hf_logits(hf, ids)
    assert (got - want).abs().max().item() / want.abs().max().item() < TOL


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> tuple[torch.nn.Module, str]:
    folder = str(tmp_path_factory.mktemp("qwen3-bad"))
    return make_moe("qwen3_moe", folder), folder


def _edited(src: str, dst: str, edit) -> str:
    """A copy of the folder `src` whose tensors went through `edit` (a dict -> None)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda t: t.pop("model.layers.1.mlp.gate.weight"), "model.layers.1.mlp.gate.weight"),  # no router
        (lambda t: t.update({"model.layers.0.mlp.experts.8.up_proj.weight": torch.zeros(32, 64)}), "experts.8"),
        (lambda t: t.pop("model.layers.2.mlp.experts.7.down_proj.weight"), "experts.7.down_proj"),
        (lambda t: t.update({"model.layers.0.mlp.experts.3.down_proj.weight": torch.zeros(64, 16)}), "experts.3.down"),
    ],
    ids=["router-missing", "expert-extra", "expert-missing", "expert-shape"],
)
def test_expert_tensors_that_disagree_with_the_config_are_named(qwen3, tmp_path, edit, named):
    folder = _edited(qwen3[1], str(tmp_path / "m"), edit)
    with pytest.raises(ModelLoadError, match=named):
        load_model(folder, dtype="float32", verbose=False)


def test_a_3d_expert_tensor_of_the_wrong_count_is_named(qwen3, tmp_path):
    src = str(tmp_path / "3d")
    save_fused(qwen3[0], src, qwen3[1])
    key = "model.layers.1.mlp.experts.gate_up_proj"
    folder = _edited(src, str(tmp_path / "m"), lambda t: t.update({key: t[key][:7].clone()}))
    with pytest.raises(ModelLoadError, match=f"{key} has shape \\(7, 64, 64\\), not one for each of 8 experts"):
        load_model(folder, dtype="float32", verbose=False)


@pytest.mark.parametrize(
    "extra, named",
    [
        (
            {"qwen3moe.expert_count": 9},
            "blk.0.ffn_gate_exps.weight has shape \\(8, 32, 64\\), not one matrix for each of 9",
        ),
        ({"qwen3moe.expert_gating_func": 2}, "MoE router 'sigmoid_topk' is not supported"),
    ],
    ids=["count", "sigmoid-router"],
)
def test_a_gguf_whose_experts_pagedllm_cannot_run_is_refused_by_name(qwen3, tmp_path, extra, named):
    path = str(tmp_path / "m.gguf")
    write_gguf(qwen3[0], qwen3[1], "qwen3_moe", "q8_0", path, extra)
    with pytest.raises(ModelLoadError, match=named):
        load_model(path, dtype="float32", verbose=False)


@pytest.mark.parametrize(
    "over, named",
    [({"hidden_act": "relu"}, "'relu'"), ({"architectures": ["OlmoeForCausalLM"], "clip_qkv": 8.0}, "clip_qkv")],
)
def test_an_activation_or_feature_it_does_not_compute_is_refused(qwen3, tmp_path, over, named):
    import json
    import shutil

    folder = str(tmp_path / "m")
    shutil.copytree(qwen3[1], folder)
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f) | over
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ModelLoadError, match=named):
        load_model_config(folder)


def test_kv_calc_counts_total_and_active_parameters_and_bytes_read(ckpt, capsys):
    """Parameters: transformers' count, and active = total less the experts a token is not routed to; a Q4_0
    file's bytes: the stored tensors' (gguf-py's reader), of which a decoded token reads k / experts of the
    expert tensors and one row of the (untied) embedding table. kv-calc --model prints both."""
    import gguf

    from pagedllm.entrypoints.cli import main
    from pagedllm.model.params import weight_count

    hf, cfg = ckpt.hf, load_model_config(ckpt.folder)
    k, n = cfg.num_experts_per_tok, cfg.num_experts
    total = sum(p.numel() for p in hf.parameters())
    blocks = [getattr(layer, "block_sparse_moe", None) or layer.mlp for layer in hf.model.layers]
    unrouted = sum(sum(p.numel() for p in b.experts.parameters()) * (n - k) // n for b in blocks)
    w = weight_count(cfg)
    assert (w.total_params, w.active_params, w.total_bytes) == (total, total - unrouted, 4 * total)
    path = ckpt.get("q4_0")[0]
    g = weight_count(load_model_config(path), path)
    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    experts = sum(b for name, b in tensors.items() if "_exps." in name)
    embed = tensors["token_embd.weight"]
    assert g.total_bytes == sum(tensors.values())
    assert g.read_bytes == sum(tensors.values()) - experts * (n - k) // n - embed + embed // cfg.vocab_size
    assert main(["kv-calc", "--model", path]) == 0
    out = capsys.readouterr().out
    assert f"parameters: {total:,} total, {total - unrouted:,} active per token ({k} of {n} experts routed)" in out
    assert f"read per decoded token: {g.read_bytes:,}" in out


def test_metrics_page_counts_expert_tokens_and_reads(qwen3):
    """/metrics carries the expert counters of the engine's stats (pagedllm:moe_expert_tokens / _reads)."""
    from pagedllm.engine.metrics import PrometheusStatLogger

    loaded = load_model(qwen3[1], dtype="float32", verbose=False)
    engine = LLMEngine(EngineConfig(block_size=8, max_model_len=64, log_stats_interval=0), loaded)
    engine.add_request("a", _tokens(20, 11), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    st = engine.stats()
    page = PrometheusStatLogger().render(st, "m").decode()
    assert f'pagedllm:moe_expert_tokens_total{{model_name="m"}} {float(st.moe_expert_tokens)}' in page
    assert f'pagedllm:moe_expert_reads_total{{model_name="m"}} {float(st.moe_expert_reads)}' in page
    assert st.moe_expert_reads > 0


def _bf16_error(folder: str, hf: torch.nn.Module) -> tuple[float, object]:
    """A bfloat16 load's teacher-forced logits against float32 transformers: largest error over the largest logit."""
    loaded = load_model(folder, dtype="bfloat16", verbose=False)
    ids = _tokens(40, 5)
    got = all_logits(ModelRunner(loaded, num_blocks=8, block_size=8), [SeqChunk(ids, 0, list(range(8)))])[0]
    want = _hf_logits(hf, ids)
    return (got.float() - want).abs().max().item() / want.abs().max().item(), loaded


def test_bfloat16_experts_run_on_the_bfloat16_route(qwen3, monkeypatch):
    """--dtype bfloat16 from a folder: where the CPU has vdpbf16ps, every expert is kept as bfloat16 tiles in one
    buffer per matmul (SparseMoE.keep_experts_bf16) and the layer's experts run as one moe.c call on its
    bfloat16 route (elsewhere they stay dense: the torch loop over experts, oneDNN's bfloat16 matmuls). Against
    float32 transformers no further off than the dense experts are (both round the stream to bfloat16, which is
    most of the error); on the route, the routed experts' output for a row the same alone as among 40, bit for
    bit."""
    from pagedllm.model.kernels.quant_linear import bf16_kernel

    hf, folder = qwen3
    err, loaded = _bf16_error(folder, hf)
    blocks = [layer.moe for layer in loaded.model.decoder_layers if layer.moe]
    experts = [e for b in blocks for e in b.experts]
    on = bf16_kernel() is not None
    assert all((e.gate_up.quant is not None) == on and (e.down.quant is not None) == on for e in experts)
    if not on:
        return
    assert {e.gate_up.quant.fmt for e in experts} == {"bf16"} and all(b.experts_kernel() for b in blocks)
    first = blocks[0].experts[0].gate_up.quant
    assert [e.gate_up.quant.tiles.data_ptr() for e in blocks[0].experts] == [
        first.tiles.data_ptr() + i * first.nbytes for i in range(len(blocks[0].experts))
    ]
    monkeypatch.setattr("pagedllm.model.layers.moe.bf16_kernel", lambda: None)  # the dense experts
    dense_err, dense = _bf16_error(folder, hf)
    assert all(e.gate_up.quant is None for layer in dense.model.decoder_layers if layer.moe for e in layer.moe.experts)
    assert err < 1.5 * dense_err + 1e-3, f"{err:.2e} against the dense experts' {dense_err:.2e}"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, loaded.config.hidden_size, generator=g).bfloat16()
    k = loaded.config.num_experts_per_tok
    routed = torch.stack([torch.randperm(loaded.config.num_experts, generator=g)[:k] for _ in range(40)])
    w = torch.softmax(torch.randn(40, k, generator=g), -1)
    kernel = blocks[0].experts_kernel()
    assert torch.equal(kernel.forward(x, routed, w)[7:8], kernel.forward(x[7:8], routed[7:8], w[7:8]))
