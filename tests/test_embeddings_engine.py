"""Pooling requests (embeddings) in the engine: a tiny random decoder's vectors equal transformers' hidden states
pooled the same way, through chunked prefill and next to generation requests, with every block back after."""

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import assert_all_blocks_free
from model_helpers import make_tiny_hf

from pagedllm import SamplingParams
from pagedllm.engine import EngineConfig, LLMEngine
from pagedllm.engine.pooling import PoolerConfig, read_pooler_config
from pagedllm.errors import UserError
from pagedllm.model import load_model
from pagedllm.sampling_params import PoolingParams

PROMPTS = [[5, 9, 33, 7, 100, 12, 3, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57], [8, 8, 9], [200]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("qwen2_embed"))
    hf = make_tiny_hf("qwen2_bias", folder)
    return folder, hf, load_model(folder, dtype="float32", verbose=False)


def _engine(loaded, **kw) -> LLMEngine:
    cfg = dict(kv_cache_memory=2**20, max_model_len=256, log_stats_interval=0, block_size=4)
    return LLMEngine(EngineConfig(**{**cfg, **kw}), loaded)


@torch.inference_mode()
def _reference(hf, ids: list[int], kind: str, normalize: bool, dims: int | None = None) -> torch.Tensor:
    h = hf.model(torch.tensor([ids])).last_hidden_state[0].float()
    vec = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[kind][:dims]
    return torch.nn.functional.normalize(vec, dim=0) if normalize else vec


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], object]]) -> dict:
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.mark.parametrize(("kind", "normalize"), [("LAST", True), ("MEAN", True), ("MEAN", False), ("CLS", False)])
def test_pooled_vectors_equal_transformers_hidden_states(tiny, kind, normalize):
    _, hf, loaded = tiny
    engine = _engine(loaded, max_num_batched_tokens=8)  # the 21-token prompt is computed in three chunks
    params = PoolingParams(kind, normalize)
    done = _run(engine, {str(i): (ids, params) for i, ids in enumerate(PROMPTS)})
    for i, ids in enumerate(PROMPTS):
        out = done[str(i)]
        assert out.outputs[0].token_ids == [] and out.embedding is not None
        torch.testing.assert_close(torch.tensor(out.embedding), _reference(hf, ids, kind, normalize), atol=1e-5, rtol=0)
    assert_all_blocks_free(engine)


def test_pooling_next_to_generation_leaves_generation_as_alone(tiny):
    _, hf, loaded = tiny
    gen = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = _run(_engine(loaded, max_num_batched_tokens=16), {"g": (PROMPTS[0], gen)})["g"].outputs[0].token_ids
    engine = _engine(loaded, max_num_batched_tokens=16)
    reqs = {"g": (PROMPTS[0], gen), "e0": (PROMPTS[0], PoolingParams("MEAN")), "e1": (PROMPTS[1], PoolingParams())}
    done = _run(engine, reqs)
    assert done["g"].outputs[0].token_ids == alone
    torch.testing.assert_close(torch.tensor(done["e0"].embedding), _reference(hf, PROMPTS[0], "MEAN", True))
    torch.testing.assert_close(torch.tensor(done["e1"].embedding), _reference(hf, PROMPTS[1], "LAST", True))
    # the second pooling of a prompt whose blocks are cached computes it all again (the pool needs every row)
    again = _run(engine, {"e2": (PROMPTS[0], PoolingParams("MEAN"))})["e2"]
    assert again.embedding == pytest.approx(done["e0"].embedding, abs=1e-6)
    assert_all_blocks_free(engine)


def test_matryoshka_dimensions_cut_then_normalize(tiny):
    _, hf, loaded = tiny
    out = _run(_engine(loaded), {"e": (PROMPTS[0], PoolingParams("LAST", True, 16))})["e"]
    assert len(out.embedding) == 16
    torch.testing.assert_close(torch.tensor(out.embedding), _reference(hf, PROMPTS[0], "LAST", True, 16))


def test_aborted_pooling_requests_give_their_blocks_back(tiny):
    _, _, loaded = tiny
    engine = _engine(loaded, max_num_batched_tokens=4)
    for i, ids in enumerate(PROMPTS):
        engine.add_request(str(i), ids, PoolingParams("MEAN"))
    engine.step()  # the first prompt is part-computed, holding blocks
    assert engine.kv.num_free_blocks < engine.kv.num_blocks
    for i in range(len(PROMPTS)):
        engine.abort_request(str(i))
    assert_all_blocks_free(engine)


def test_bad_pooling_params_are_refused_naming_the_field():
    with pytest.raises(UserError, match="pooling_type"):
        PoolingParams("MAX")
    with pytest.raises(UserError, match="dimensions"):
        PoolingParams(dimensions=0)


def test_pooler_config_follows_sentence_transformers_files(tmp_path):
    assert read_pooler_config(str(tmp_path)) == PoolerConfig("LAST", True)  # vLLM's default for a decoder
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    assert read_pooler_config(str(tmp_path)) == PoolerConfig("MEAN", False)
    modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    (tmp_path / "config.json").write_text(json.dumps({"matryoshka_dimensions": [32, 64]}))
    cfg = read_pooler_config(str(tmp_path))
    assert cfg == PoolerConfig("LAST", True, True, [32, 64])
    cfg.check_dimensions(32, 64)
    with pytest.raises(UserError, match="dimensions"):
        cfg.check_dimensions(48, 64)
    with pytest.raises(UserError, match="dimensions"):
        PoolerConfig().check_dimensions(8, 64)


def test_offline_llm_embed_pools_by_the_checkpoint_rule(tiny):
    """`LLM.embed` (vLLM's): a folder without sentence-transformers files is pooled LAST + normalize."""
    from pagedllm import LLM

    _, hf, loaded = tiny
    llm = LLM(loaded=loaded, kv_cache_memory=2**20, max_model_len=256, log_stats_interval=0)
    outs = llm.embed(PROMPTS[:2], use_tqdm=False)
    for out, ids in zip(outs, PROMPTS):
        torch.testing.assert_close(torch.tensor(out.embedding), _reference(hf, ids, "LAST", True), atol=1e-5, rtol=0)
    mean = llm.embed(PROMPTS[0], PoolingParams("MEAN", False), use_tqdm=False)[0]
    torch.testing.assert_close(torch.tensor(mean.embedding), _reference(hf, PROMPTS[0], "MEAN", False))
    assert_all_blocks_free(llm.engine)
