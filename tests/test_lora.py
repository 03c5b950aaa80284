"""LoRA adapters (issue 37): a tiny random Llama with three random PEFT adapters of different ranks and targets.
Greedy tokens equal transformers' with each adapter merged into the weights (PEFT's merge_and_unload), with the
three adapters and base requests in the same steps; base requests equal an engine without LoRA; the same from a
GGUF adapter as llama.cpp's converter writes it; the prefix cache keyed by adapter; bad adapters refused by name."""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest
import torch
from engine_helpers import GREEDY, make_engine
from lora_helpers import PROMPTS, greedy, make_tiny_loras

from pagedllm.errors import UserError
from pagedllm.kv import TokenRequest
from pagedllm.lora_request import LoRARequest
from pagedllm.model.kernels.cpu_kernel import runnable_targets
from pagedllm.model.loader import load_model
from pagedllm.model.lora import LoRAError

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The base folder, the adapters' LoRARequests, and the transformers reference tokens per adapter (None: base)."""
    root = tmp_path_factory.mktemp("lora")
    base, loras, want, hf = make_tiny_loras(str(root))
    return base, loras, want, hf, root


def _engine(base: str, quantization: str | None = None, **kw):
    kw = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory": 2**20, **kw}
    return make_engine(load_model(base, "float32", "cpu", False, quantization), **kw)


def _lora_engine(base: str, **kw):
    return _engine(base, **{"enable_lora": True, "max_loras": 3, "max_lora_rank": 8, **kw})


def _run_mixed(engine, jobs: list[tuple[list[int], LoRARequest | None]]) -> list[list[int]]:
    """Every job queued before the first step, so adapters and the base share steps."""
    for i, (prompt, lora) in enumerate(jobs):
        engine.add_request(str(i), prompt, GREEDY, lora_request=lora)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[str(i)] for i in range(len(jobs))]


def _jobs(loras):
    return [(p, loras.get(name) if name else None) for name in [None, "qv", "all", "mlp"] for p in PROMPTS]


def test_adapters_and_base_in_one_step_match_merged_transformers(tiny):
    base, loras, want, _, _ = tiny
    engine = _lora_engine(base)
    steps = []
    real = engine.runner.execute
    engine.runner.execute = lambda chunks: steps.append({c.lora_int_id for c in chunks}) or real(chunks)
    got = _run_mixed(engine, _jobs(loras))
    assert got == [t for name in [None, "qv", "all", "mlp"] for t in want[name]]
    assert {0, 1, 2, 3} in steps, "the three adapters and the base ran in one step"
    assert engine.loras is not None and not engine.loras.holds
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_base_requests_bit_for_bit_as_without_lora(tiny):
    base, _, _, _, _ = tiny
    params = GREEDY.__class__(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    outs = []
    for engine in (_lora_engine(base), _engine(base)):
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), p, params)
        done = {}
        while engine.has_unfinished_requests():
            done |= {o.request_id: o.outputs[0] for o in engine.step() if o.finished}
        outs.append([(done[str(i)].token_ids, done[str(i)].logprobs) for i in range(len(PROMPTS))])
    assert outs[0] == outs[1]


def test_max_loras_holds_back_a_third_adapter(tiny):
    base, loras, want, _, _ = tiny
    engine = _lora_engine(base, max_loras=2)
    steps = []
    real = engine.runner.execute
    engine.runner.execute = lambda chunks: steps.append({c.lora_int_id for c in chunks} - {0}) or real(chunks)
    got = _run_mixed(engine, [(PROMPTS[0], loras[n]) for n in ("qv", "all", "mlp")])
    assert got == [want[n][0] for n in ("qv", "all", "mlp")]
    assert max(len(s) for s in steps) == 2


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order (LlamaModel.permute), as convert_lora_to_gguf.py applies to lora_b."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_adapter(peft_folder: str, path: str, heads: int, kv_heads: int) -> None:
    """A PEFT folder written as convert_lora_to_gguf.py writes it: lora_a [r, in], lora_b [out, r] (Q/K rows
    permuted), adapter.lora.alpha; the rslora scale cannot be carried, so use a plain adapter."""
    import gguf
    from safetensors.torch import load_file

    with open(os.path.join(peft_folder, "adapter_config.json")) as f:
        cfg = json.load(f)
    assert not cfg.get("use_rslora")
    tensors = load_file(os.path.join(peft_folder, "adapter_model.safetensors"))
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    w = gguf.GGUFWriter(path, "llama")
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(cfg["lora_alpha"]))
    for key, t in sorted(tensors.items()):
        module = key.removeprefix("base_model.model.").split(".lora_")[0]
        name = tmap.get_name(module + ".weight", try_suffixes=(".weight",))
        arr = t.float().numpy()
        if ".lora_B." in key and module.endswith(("q_proj", "k_proj")):
            arr = _permute(arr, heads if module.endswith("q_proj") else kv_heads)
        w.add_tensor(name + (".lora_a" if ".lora_A." in key else ".lora_b"), np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_adapter_matches_peft(tiny):
    base, loras, want, hf, root = tiny
    path = str(root / "qv.gguf")
    _gguf_adapter(loras["qv"].lora_path, path, hf.config.num_attention_heads, hf.config.num_key_value_heads)
    path_mlp = str(root / "mlp.gguf")
    _gguf_adapter(loras["mlp"].lora_path, path_mlp, hf.config.num_attention_heads, hf.config.num_key_value_heads)
    engine = _lora_engine(base)
    got = _run_mixed(
        engine,
        [(p, LoRARequest("qv-gguf", 7, path)) for p in PROMPTS] + [(PROMPTS[0], LoRARequest("mlp-gguf", 8, path_mlp))],
    )
    assert got == want["qv"] + [want["mlp"][0]]


def _quantized_reference(hf, loras) -> dict[str | None, list[list[int]]]:
    """transformers' greedy tokens over the weights --quantization int8 holds (each matmul, the embedding and the
    LM head rounded as quantize_rtn rounds them, then dequantized), with each PEFT adapter merged into them."""
    from peft import PeftModel

    from pagedllm.model.kernels.quant_linear import quantize_rtn

    deq = copy.deepcopy(hf)
    with torch.no_grad():
        for mod in deq.modules():
            if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)):
                mod.weight.copy_(quantize_rtn(mod.weight, 8).dequantize())
    want: dict[str | None, list[list[int]]] = {None: [greedy(deq, p, GREEDY.max_tokens) for p in PROMPTS]}
    for name, lora in loras.items():
        merged = PeftModel.from_pretrained(copy.deepcopy(deq), lora.lora_path).merge_and_unload().eval()
        want[name] = [greedy(merged, p, GREEDY.max_tokens) for p in PROMPTS]
    return want


def _outputs(engine, jobs: list[tuple[list[int], LoRARequest | None]]) -> list[tuple[list[int], object]]:
    """_run_mixed's, with each request's logprobs."""
    params = GREEDY.__class__(temperature=0, max_tokens=GREEDY.max_tokens, ignore_eos=True, logprobs=3)
    for i, (prompt, lora) in enumerate(jobs):
        engine.add_request(str(i), prompt, params, lora_request=lora)
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o.outputs[0] for o in engine.step() if o.finished}
    return [(done[str(i)].token_ids, done[str(i)].logprobs) for i in range(len(jobs))]


def test_quantized_base_runs_lora_steps_in_the_fused_step(tiny):
    """int8 weights: every step, the three adapters' and the base's tokens in one, runs the fused C step (where
    the kernels are built); each adapter's tokens equal transformers' with it merged into the int8 weights (and
    the torch path's), the base requests' tokens and logprobs an engine's without LoRA, bit for bit."""
    from pagedllm.model.kernels import cpu_kernel

    if cpu_kernel.load() is None:
        pytest.skip("the C kernels are not built here")
    base, loras, _, hf, _ = tiny
    q = _lora_engine(base, quantization="int8")
    fused = q.runner.fused
    assert fused is not None
    steps, runs = [], []
    real_execute, real_run = q.runner.execute, fused.run
    q.runner.execute = lambda chunks: steps.append({c.lora_int_id for c in chunks}) or real_execute(chunks)
    fused.run = lambda *a, **k: runs.append(1) or real_run(*a, **k)
    jobs = _jobs(loras)
    got = _outputs(q, jobs)
    assert len(runs) == len(steps) and {0, 1, 2, 3} in steps, "every step, mixed ones too, ran the fused step"
    want = _quantized_reference(hf, loras)
    assert [t for t, _ in got] == [t for name in [None, "qv", "all", "mlp"] for t in want[name]]
    torch_path = _lora_engine(base, quantization="int8")
    torch_path.runner.fused = None
    assert _run_mixed(torch_path, jobs) == [t for t, _ in got]
    base_only = _outputs(_engine(base, "int8"), [(p, None) for p in PROMPTS])
    assert got[: len(PROMPTS)] == base_only


# (prompt, adapter id) per sequence of one step: 23 rows of adapter 2 across two chunks (groups of several rows
# read its matrices once: sgmv), one chunk each of adapters 1 and 3, base chunks between them
STEP = [(PROMPTS[0], 2), (PROMPTS[1], 0), (PROMPTS[2], 1), (PROMPTS[1], 2), (PROMPTS[2], 0), (PROMPTS[0], 3)]


def _step_logits(loaded, loras, fused: bool, ids: list[int], lora_dtype: str) -> torch.Tensor:
    """Every row's logits of STEP's prompts prefilled in one step under adapters `ids`, then of one decode token
    each (a row per sequence: bgmv), on a runner with the fused step or the torch path."""
    from pagedllm.model.runner import ModelRunner, SeqChunk

    runner = ModelRunner(loaded, num_blocks=4 * len(STEP), block_size=8, fused=fused)
    assert (runner.fused is not None) == fused
    manager = runner.enable_lora(8, len(loras), getattr(torch, lora_dtype))
    for lora in loras.values():
        manager.add(lora)
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(len(STEP))]
    chunks = [SeqChunk(p, 0, t, all_logits=True, lora_int_id=i) for (p, _), t, i in zip(STEP, tables, ids)]
    prefill = runner.execute(chunks)
    ends = np.cumsum([len(p) for p, _ in STEP]) - 1
    chunks = [
        SeqChunk([int(prefill[e].argmax())], len(p), t, lora_int_id=i)
        for (p, _), t, i, e in zip(STEP, tables, ids, ends)
    ]
    return torch.cat([prefill, runner.execute(chunks)])


CLASSES = [(t, "float32") for t in ("native", "x86-64-v3", "x86-64") if t in runnable_targets()]


@pytest.mark.parametrize(("target", "lora_dtype"), [*CLASSES, ("native", "bfloat16"), ("x86-64", "bfloat16")])
def test_fused_lora_term_matches_the_torch_path_on_each_cpu_class(tiny, target, lora_dtype):
    """One step of three adapters and the base, prefill and decode, with int8 weights on this CPU's build, the
    AVX2 one and the portable one, adapters in float32 and in bfloat16 (--lora-dtype; a bfloat16 model's
    default, which the fused step reads as such): the fused step's logits within rounding of the torch path's
    on the same values; its base rows bit for bit those of the same step with no adapter (the LoRA rows change
    nothing else), its adapter rows not."""
    from model_helpers import cpu_target

    base, loras, _, _, _ = tiny
    loaded = load_model(base, "float32", "cpu", False, "int8")
    ids = [i for _, i in STEP]
    with cpu_target(target):
        fused = _step_logits(loaded, loras, True, ids, lora_dtype)
        plain = _step_logits(loaded, loras, True, [0] * len(STEP), lora_dtype)
    want = _step_logits(loaded, loras, False, ids, lora_dtype)
    err = (fused - want).abs().max().item() / want.abs().max().item()
    assert err < 1e-4, f"{target} {lora_dtype}: {err:.2e}"
    lens = [len(p) for p, _ in STEP]
    owner = torch.tensor(np.repeat(ids, lens).tolist() + ids)
    assert torch.equal(fused[owner == 0], plain[owner == 0])
    assert all((fused[owner == i] - plain[owner == i]).abs().max() > 1e-3 for i in (1, 2, 3))


def test_prefix_cache_keyed_by_adapter_id(tiny):
    base, loras, _, _, _ = tiny
    engine = _lora_engine(base, max_loras=2)
    prompt = list(range(3, 3 + 40))
    _run_mixed(engine, [(prompt, loras["qv"])])
    kv = engine.kv

    def hit(lora_int_id: int) -> int:
        return kv.get_computed_blocks(TokenRequest(f"probe{lora_int_id}", prompt + [1], lora_int_id=lora_int_id))[1]

    assert hit(1) == 32  # the same adapter: its two full blocks of 16
    assert hit(2) == 0 and hit(0) == 0  # another adapter, the base: nothing shared


def test_bad_adapters_are_named(tiny, tmp_path):
    base, loras, _, _, _ = tiny
    engine = _lora_engine(base, max_lora_rank=4)
    with pytest.raises(LoRAError, match=r"'all'.*rank 8, above --max-lora-rank 4"):
        engine.add_request("r", PROMPTS[0], GREEDY, lora_request=loras["all"])
    folder = tmp_path / "bad"
    folder.mkdir()
    src = loras["qv"].lora_path
    cfg = json.load(open(os.path.join(src, "adapter_config.json")))
    json.dump(cfg, open(folder / "adapter_config.json", "w"))
    from safetensors.torch import load_file, save_file

    t = load_file(os.path.join(src, "adapter_model.safetensors"))
    key = next(k for k in t if "q_proj.lora_B" in k)
    bad = dict(t)
    bad[key] = t[key][:-1]
    save_file(bad, folder / "adapter_model.safetensors")
    with pytest.raises(LoRAError, match=r"'shape'.*q_proj.*do not fit"):
        engine.add_request("r", PROMPTS[0], GREEDY, lora_request=LoRARequest("shape", 9, str(folder)))
    moved = {k.replace("q_proj", "x_proj"): v for k, v in t.items()}
    save_file(moved, folder / "adapter_model.safetensors")
    with pytest.raises(LoRAError, match=r"'missing'.*x_proj is not a matmul"):
        engine.add_request("r", PROMPTS[0], GREEDY, lora_request=LoRARequest("missing", 10, str(folder)))
    with pytest.raises(UserError, match="LoRA is not enabled"):
        _engine(base).add_request("r", PROMPTS[0], GREEDY, lora_request=loras["qv"])
    assert not engine.has_unfinished_requests() and engine.kv.num_free_blocks == engine.kv.num_blocks


def test_unloading_an_adapter_in_use_is_refused_until_its_requests_end(tiny):
    base, loras, want, _, _ = tiny
    engine = _lora_engine(base)
    engine.add_request("r", PROMPTS[0], GREEDY, lora_request=loras["qv"])
    engine.step()
    with pytest.raises(UserError, match=r"'qv' is in use by 1 running request"):
        engine.remove_lora(1)
    out = []
    while engine.has_unfinished_requests():
        out += [o.outputs[0].token_ids for o in engine.step() if o.finished]
    assert out == [want["qv"][0]]
    assert engine.remove_lora(1) and not engine.remove_lora(1)


def _server(base: str, mods: list[str], **kw):
    from server_helpers import running_server

    from pagedllm.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(_lora_engine(base))
    return running_server(engine, api_key=None, lora_modules=mods, served_model_name=["base"], **kw)


def test_server_serves_adapters_by_model_name(tiny, monkeypatch):
    from server_helpers import assert_error

    base, loras, want, hf, _ = tiny
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    mods = [f"qv={loras['qv'].lora_path}", json.dumps({"name": "all", "path": loras["all"].lora_path})]
    with _server(base, mods) as s:
        tok = s.engine.tokenizer
        models = s.http.get("/v1/models").json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [("base", None), ("qv", "base"), ("all", "base")]

        def completion(model: str):
            body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            return s.http.post("/v1/completions", json=body | {"logprobs": 1})

        def tokens(model: str) -> list[str]:
            r = completion(model)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["logprobs"]["tokens"]

        def strs(ids: list[int]) -> list[str]:
            return [tok.decode([t], skip_special_tokens=False) for t in ids]

        for model, name in (("qv", "qv"), ("all", "all"), ("base", None)):
            assert tokens(model) == strs(want[name][0]), model
        assert_error(completion("nope"), 404, "model", ["The model `nope` does not exist."])

        load = {"lora_name": "mlp", "lora_path": loras["mlp"].lora_path}
        r = s.http.post("/v1/load_lora_adapter", json=load)
        assert r.status_code == 200 and "added successfully" in r.text, r.text
        assert tokens("mlp") == strs(want["mlp"][0])
        assert_error(s.http.post("/v1/load_lora_adapter", json=load), 400, "lora_name", ["already been loaded"])
        r = s.http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"})
        assert r.status_code == 200 and "removed successfully" in r.text, r.text
        assert_error(completion("mlp"), 404, "model")
        assert_error(s.http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"}), 404, "lora_name")
        bad = {"lora_name": "bad", "lora_path": base}  # a model folder, not an adapter
        assert s.http.post("/v1/load_lora_adapter", json=bad).status_code == 400


def test_runtime_lora_routes_need_vllm_s_env_var(tiny, monkeypatch):
    base, loras, _, _, _ = tiny
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    with _server(base, []) as s:
        r = s.http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": loras["qv"].lora_path})
        assert r.status_code == 404


def test_router_keys_are_the_engine_s_block_hashes_per_adapter(tiny):
    """The cluster router's prefix keys of a request carry its adapter id as the engine's block hashes do."""
    from pagedllm.cluster.routing import LORA_KW, PROMPT_KW, key, request_keys

    base, loras, _, _, _ = tiny
    engine = _lora_engine(base)
    prompt = list(range(3, 3 + 40))
    _run_mixed(engine, [(prompt, loras["all"])])
    held = {key(h) for h in engine.kv.pool.cached}  # the blocks the engine registered (and publishes)
    ours = request_keys({PROMPT_KW: prompt, LORA_KW: loras["all"]}, 16, 8)
    assert len(ours) == 2 and set(ours) <= held
    assert (
        request_keys({PROMPT_KW: prompt}, 16, 8)
        != ours
        != request_keys({PROMPT_KW: prompt, LORA_KW: loras["qv"]}, 16, 8)
    )


def test_disk_tier_keeps_adapters_apart_across_a_restart(tiny, tmp_path):
    """Blocks written to the disk tier under one adapter are read back by a restarted engine for that adapter's
    requests only, with the same tokens; another adapter's and the base's requests find none of them."""
    base, loras, _, _, _ = tiny
    prompt = list(range(3, 3 + 40))
    first = _lora_engine(base, kv_offload_dir=str(tmp_path))
    want = _run_mixed(first, [(prompt, loras["qv"])])
    assert first.disk_tier is not None
    first.disk_tier.flush()
    assert len(os.listdir(first.disk_tier.dir)) == 2  # the prompt's two full blocks

    def cached(lora: LoRARequest | None) -> int:
        engine = _lora_engine(base, kv_offload_dir=str(tmp_path))
        engine.add_request("r", prompt, GREEDY, lora_request=lora)
        done = []
        while engine.has_unfinished_requests():
            done += [o for o in engine.step() if o.finished]
        if lora is loras["qv"]:
            assert done[0].outputs[0].token_ids == want[0]
        return done[0].num_cached_tokens

    assert cached(loras["qv"]) == 32
    assert cached(loras["all"]) == 0 and cached(None) == 0


def test_generate_cli_answers_with_an_adapter(tiny, capsys):
    """`pagedllm generate --lora NAME=PATH` prints what the engine answers under that adapter (not the base's); a
    bad adapter is an error line naming it, before any prompt."""
    from pagedllm import SamplingParams
    from pagedllm.entrypoints.cli import main

    base, loras, _, _, _ = tiny
    prompt, params = "t5 t9 t17 t33 t4 t71", SamplingParams(temperature=0, max_tokens=8)

    def answer(lora: LoRARequest | None) -> str:
        engine = _lora_engine(base)
        engine.add_request("r", prompt, params, lora_request=lora)
        done = []
        while engine.has_unfinished_requests():
            done += [o.outputs[0].text for o in engine.step() if o.finished]
        return done[0]

    want = answer(loras["all"])
    assert want != answer(None)
    args = ["generate", prompt, "--model", base, "--dtype", "float32", "--max-tokens", "8", "--max-model-len", "256"]
    assert main([*args, "--lora", f"all={loras['all'].lora_path}"]) == 0
    assert capsys.readouterr().out == want + "\n"
    assert main([*args, "--lora", f"bad={base}"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "error: LoRA adapter 'bad'" in err.strip().splitlines()[-1]
