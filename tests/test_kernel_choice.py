"""The kept kernel choice (model/kernels/kernel_choice.py) read back from disk: whatever is found in its place, the
server starts, measures again with one log line and leaves nothing behind.

Why: the file lives in a cache folder that other processes, other versions and a full disk also touch. Before,
`"amx_min_rows": Infinity` (OverflowError) or a deeply nested list (RecursionError) stopped start-up, a file of
the right shape with nonsense inside was used as a measurement, a directory in its place left a `.tmp` file,
and the temporary file was opened through whatever link sat at its predictable name.

The choices are kept beside a library name in a temporary folder (`library_path` is redirected there), so no
kernel is built again: the library already built for this machine is the one measured.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from kernel_helpers import random_parts

from pagedllm.model.kernels import cpu_kernel, kernel_choice
from pagedllm.model.kernels.quant_linear import pack

LAYER = [pack(random_parts("q4_1", 32, 64, 5))]


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """A measured, kept choice in tmp_path, and a counter of how often `choose` measures."""
    monkeypatch.setattr(cpu_kernel, "library_path", lambda: tmp_path / "pagedllm_kernels-test.so")
    calls: list[int] = []
    real = kernel_choice.measure
    monkeypatch.setattr(kernel_choice, "measure", lambda *a: calls.append(1) or real(*a))
    first = kernel_choice.choose(LAYER, torch.float32)
    (path,) = tmp_path.glob("*.choice-*.json")
    assert calls == [1]
    return path, first, calls


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _good(path) -> dict:
    return json.loads(path.read_text())


CORRUPT = {
    "infinite row count": lambda good: json.dumps({**good, "amx_min_rows": 1e999}),  # dumps writes Infinity
    "deep nesting": lambda good: "[" * 200_000,
    "deep nesting, a small file": lambda good: "[" * 60_000,  # RecursionError, not a size refusal
    "shallow nonsense": lambda good: json.dumps({**good, "quantized": False, "ms": {}}),
    "no build": lambda good: json.dumps({k: v for k, v in good.items() if k != "build"}),
    "another build": lambda good: json.dumps({**good, "build": "x86-64 build (portable)"}),
    "a NaN time": lambda good: json.dumps(
        {**good, "ms": {**good["ms"], "dense": {**good["ms"]["dense"], "1": 1e999 - 1e999}}}
    ),
    "a huge time": lambda good: json.dumps(good).replace(str(good["ms"]["dense"]["8"]), "1e400", 1),
    "a negative time": lambda good: json.dumps(
        {**good, "ms": {**good["ms"], "q-f32": {r: -1.0 for r in good["ms"]["q-f32"]}}}
    ),
    "a time that is text": lambda good: json.dumps(
        {**good, "ms": {**good["ms"], "q-f32": {r: "1" for r in good["ms"]["q-f32"]}}}
    ),
    "a row count missing": lambda good: json.dumps(
        {**good, "ms": {k: dict(list(v.items())[1:]) for k, v in good["ms"].items()}}
    ),
    "a candidate missing": lambda good: json.dumps({**good, "ms": {"q-f32": good["ms"]["q-f32"]}}),
    "the decision flipped": lambda good: json.dumps({**good, "quantized": not good["quantized"]}),
    "a row count that is true": lambda good: json.dumps({**good, "amx_min_rows": True}),
    "not UTF-8": lambda good: b"\xff\xfe\x00{",
    "a list": lambda good: "[1, 2]",
    "null": lambda good: "null",
    "empty": lambda good: "",
    "huge": lambda good: " " * (1 << 20) + json.dumps(good),
}


@pytest.mark.parametrize("case", CORRUPT)
def test_a_corrupted_choice_is_measured_again_with_one_line(kept, case, caplog):
    path, first, calls = kept
    bad = CORRUPT[case](_good(path))
    path.write_bytes(bad if isinstance(bad, bytes) else bad.encode())
    caplog.clear()
    again = kernel_choice.choose(LAYER, torch.float32)
    assert calls == [1, 1] and again.ms.keys() == first.ms.keys() and again.build == first.build
    (line,) = _warnings(caplog)
    assert "not usable" in line and "measured again" in line
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # rewritten, nothing else left
    assert kernel_choice.choose(LAYER, torch.float32) == again and calls == [1, 1]  # the new one is read back


def test_a_directory_in_its_place_leaves_nothing_behind(kept, caplog):
    path, first, calls = kept
    path.unlink()
    path.mkdir()
    (path / "theirs").write_text("x")
    caplog.clear()
    assert kernel_choice.choose(LAYER, torch.float32).ms.keys() == first.ms.keys() and calls == [1, 1]
    (line,) = _warnings(caplog)
    assert "could not keep" in line and "not usable" in line
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no .tmp file
    assert (path / "theirs").read_text() == "x"  # not ours: left alone


def test_a_link_in_its_place_is_not_read_and_only_the_link_is_replaced(kept, tmp_path_factory, caplog):
    path, first, calls = kept
    outside = tmp_path_factory.mktemp("outside") / "choice.json"
    outside.write_text(path.read_text())  # a valid choice, but reached through a link we did not make
    path.unlink()
    path.symlink_to(outside)
    caplog.clear()
    kernel_choice.choose(LAYER, torch.float32)
    assert calls == [1, 1] and len(_warnings(caplog)) == 1
    assert not path.is_symlink() and _good(path)["build"] == first.build
    assert outside.read_text() == json.dumps(_good(outside))  # untouched


def test_the_temporary_file_is_never_written_through_a_planted_link(kept, tmp_path_factory):
    """The old temporary name (`<choice>.<pid>.tmp`) is predictable: a link planted there must not be written
    through, nor any other name of the folder followed."""
    path, first, calls = kept
    outside = tmp_path_factory.mktemp("outside") / "victim"
    outside.write_text("theirs")
    path.with_suffix(f".{os.getpid()}.tmp").symlink_to(outside)
    path.unlink()
    kernel_choice.choose(LAYER, torch.float32)
    assert calls == [1, 1] and outside.read_text() == "theirs"
    assert _good(path)["build"] == first.build
