"""Engine settings are declared once (EngineConfig: type, default, constraint, docstring) and every command's
flags, help and checks come from that declaration."""
from __future__ import annotations

import argparse

import pytest

from pagedllm.engine.config import CLI_ONLY_IN_PYTHON, EngineConfig, add_engine_args
from pagedllm.entrypoints.cli import build_parser
from pagedllm.errors import UserError
from pagedllm.settings import flag_name


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


@pytest.mark.parametrize("flag, value, words", [
    ("--block-size", "0", "greater than or equal to 1"),
    ("--max-num-seqs", "0", "greater than or equal to 1"),
    ("--max-model-len", "0", "greater than or equal to 1"),
    ("--kv-cache-memory", "0", "greater than 0"),
    ("--kv-cache-memory", "lots", "could not parse"),
    ("--gpu-memory-utilization", "1.5", "less than or equal to 1"),
])
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
