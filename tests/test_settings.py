"""Engine settings are declared once (EngineConfig: type, default, constraint, docstring) and every command's
flags, help and checks come from that declaration."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.engine.config import CLI_ONLY_IN_PYTHON, EngineConfig, add_engine_args
from pagedllm.entrypoints.cli import build_parser
from pagedllm.errors import UserError
from pagedllm.settings import cli_default, flag_name


def _engine_actions(command: list[str]) -> dict[str, argparse.Action]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in command:
        parser = sub.choices[name]
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), sub)
    return {a.dest: a for a in parser._actions}


@pytest.mark.parametrize("command", [["serve"], ["generate"], ["bench", "throughput"], ["rag", "ask"]])
def test_every_engine_setting_is_a_flag_with_its_docstring_as_help(command):
    actions = _engine_actions(command)
    fields = EngineConfig.__pydantic_fields__
    for name, info in fields.items():
        if name == "model" or name in CLI_ONLY_IN_PYTHON:
            continue
        action = actions[name]
        assert flag_name(name) in action.option_strings
        assert action.help == info.description and info.description, name
        if name != "speculative_config":  # the commands default to "auto", the Python API to off
            assert action.default == info.default, name
    assert actions["dtype"].choices == ["auto", "float32", "bfloat16"]  # once written by hand without choices


@pytest.mark.parametrize(
    "flag, value, words",
    [
        ("--block-size", "0", "greater than or equal to 1"),
        ("--max-num-seqs", "0", "greater than or equal to 1"),
        ("--max-model-len", "0", "greater than or equal to 1"),
        ("--kv-cache-memory", "0", "greater than 0"),
        ("--kv-cache-memory", "lots", "could not parse"),
        ("--gpu-memory-utilization", "1.5", "less than or equal to 1"),
    ],
)
def test_a_bad_value_is_one_error_naming_the_flag_from_the_cli_and_from_python(flag, value, words, capsys):
    from pagedllm.entrypoints.cli import main

    assert main(["generate", "hi", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pagedllm generate: error: {flag}: ") and words in err and len(err.splitlines()) == 1
    with pytest.raises(UserError, match=f"^{flag}: .*{words}"):
        EngineConfig(**{flag[2:].replace("-", "_"): value})


def test_memory_sizes_are_read_as_byte_sizes():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert EngineConfig.from_args(parser.parse_args(["--kv-cache-memory", "32MiB"])).kv_cache_memory == 32 * 2**20
    assert EngineConfig(kv_cache_memory="1.5 GB").kv_cache_memory == 1_500_000_000
    assert EngineConfig(kv_cache_memory=4096).kv_cache_memory == 4096


def _command_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every (sub)command's parser by its words: 'serve', 'bench sweep', 'rag ask', ..."""
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser, words: tuple[str, ...]) -> None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs and words:
            found[" ".join(words)] = parser
        for sub in subs:
            for name, child in sub.choices.items():
                walk(child, (*words, name))

    walk(build_parser(), ())
    return found


# the commands whose every flag says what it does and its default; --kv-cache-memory's help is being rewritten
DOCUMENTED = [
    "generate",
    "chat",
    "serve",
    "kv-calc",
    "bench serve",
    "bench throughput",
    "bench sweep",
    "rag ingest",
    "rag search",
    "rag ask",
    "rag bench",
]


@pytest.mark.parametrize("command", DOCUMENTED)
def test_every_flag_says_its_default_in_a_users_words_without_naming_a_source_file(command):
    import re

    for action in _command_parsers()[command]._actions:
        if not action.option_strings or action.dest in ("help", "kv_cache_memory"):
            continue
        assert action.help and "default" in action.help.lower(), (command, action.option_strings)
        assert not re.search(r"\w\.(py|c|h)\b", action.help), (command, action.option_strings)


@pytest.mark.parametrize(
    "command, classes",
    [
        ("serve", ["ServerConfig", "ClusterConfig"]),
        ("rag ask", ["RagAskConfig"]),
        ("rag bench", ["RagBenchConfig"]),
        ("bench serve", ["ServeBenchConfig"]),
    ],
)
def test_command_flags_are_generated_from_their_settings_classes(command, classes):
    from pagedllm.bench import serve_bench
    from pagedllm.entrypoints import rag, serve_args
    from pagedllm.rag import bench

    actions = {a.dest: a for a in _command_parsers()[command]._actions}
    modules = (serve_args, rag, bench, serve_bench)
    for cls in (getattr(m, c) for c in classes for m in modules if hasattr(m, c)):
        for name, info in cls.__pydantic_fields__.items():
            action = actions[name]
            assert flag_name(name) in action.option_strings and action.default == cli_default(info), name
            assert action.help == info.description and info.description, name


def test_one_list_of_layouts_and_of_routing_policies_behind_every_choice():
    from pagedllm.cluster.routing import POLICIES
    from pagedllm.rag import LAYOUTS

    parsers = _command_parsers()
    serve = {a.dest: a for a in parsers["serve"]._actions}
    ask = {a.dest: a for a in parsers["rag ask"]._actions}
    assert serve["rag_layout"].choices == ask["layout"].choices == list(LAYOUTS)
    assert sorted(serve["routing"].choices) == sorted(POLICIES)
    for layout in LAYOUTS:  # --layout says what each layout does
        assert f"{layout} (" in ask["layout"].help
    assert "power of two" not in serve["routing"].help.split("round-robin (")[1].split(")")[0].split(":")[0]


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["serve", "--port", "70000"], "--port"),
        (["serve", "--max-waiting-requests", "-1"], "--max-waiting-requests"),
        (["serve", "--rag-top-k", "0"], "--rag-top-k"),
        (["rag", "bench", "--num-questions", "0"], "--num-questions"),
        (["rag", "bench", "--layouts", "naive,nope"], "--layouts"),
        (["rag", "ask", "q", "--top-k", "0"], "--top-k"),
        (["bench", "serve", "--max-concurrency", "0"], "--max-concurrency"),
        (["bench", "serve", "--range-ratio", "1.5"], "--range-ratio"),
    ],
)
def test_a_bad_command_value_is_one_line_naming_the_flag(argv, flag, capsys):
    from pagedllm.entrypoints.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: {flag}: " in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_a_model_goes_by_one_name_its_files():
    from pagedllm.entrypoints.serve_args import DEFAULT_SERVED_NAME, served_names
    from pagedllm.model.config import load_model_config, model_name
    from pagedllm.model.default_model import DEFAULT_MODEL_FILE

    assert model_name(DEFAULT_MODEL_FILE) == DEFAULT_SERVED_NAME == "SmolLM2-135M-Instruct"
    assert load_model_config(None).name == DEFAULT_SERVED_NAME  # logs and /v1/kv: not GGUF general.name
    assert model_name("/models/llama-3-8b.Q4_K_M.gguf") == "llama-3-8b"
    assert model_name("/models/Qwen2-0.5B/") == model_name("/models/Qwen2-0.5B/config.json") == "Qwen2-0.5B"
    args = argparse.Namespace(served_model_name=None, model="/models/llama-3-8b.Q4_K_M.gguf")
    assert served_names(args) == ["llama-3-8b"]
    assert served_names(argparse.Namespace(served_model_name=["a", "b"], model="x.gguf")) == ["a", "b"]
