"""The GGUF tokenizer's cached folder is checked against its manifest before it is used: whatever happened to
it since it was written (truncated, edited, extra or missing files, a link or a file in its place), it is built
again with one log line, and nothing it points to is touched."""

from __future__ import annotations

import json
import logging
import os

import pytest

from pagedllm.model.default_model import default_model_path
from pagedllm.model.formats.cache import MANIFEST, seal_folder, sealed_folder_problem
from pagedllm.model.tokenizer import gguf_tokenizer_folder

REQUIRED = ("a.json",)


def _sealed(tmp_path):
    folder = tmp_path / "entry"
    folder.mkdir()
    (folder / "a.json").write_text('{"x": 1}')
    (folder / "b.txt").write_text("merges")
    seal_folder(str(folder))
    return folder


def _truncate(f):
    (f / "a.json").write_text('{"x"')


def _edit_same_size(f):
    (f / "a.json").write_text('{"y": 1}')


def _extra_file(f):
    (f / "c.txt").write_text("stranger")


def _missing_file(f):
    os.unlink(f / "b.txt")


def _no_manifest(f):
    os.unlink(f / MANIFEST)


def _manifest_garbage(f):
    (f / MANIFEST).write_bytes(b"\xff[" * 100)


def _manifest_deep(f):
    (f / MANIFEST).write_text("[" * 30000)


def _manifest_wrong_shape(f):
    (f / MANIFEST).write_text(json.dumps({"files": ["a.json"]}))


def _manifest_escapes(f):
    (f / MANIFEST).write_text(json.dumps({"files": {"../a.json": {"size": 1, "sha256": "0"}}}))


def _file_is_link(f):
    outside = f.parent / "outside.json"
    outside.write_text('{"x": 1}')
    os.unlink(f / "a.json")
    os.symlink(outside, f / "a.json")


@pytest.mark.parametrize(
    "damage",
    [
        _truncate,
        _edit_same_size,
        _extra_file,
        _missing_file,
        _no_manifest,
        _manifest_garbage,
        _manifest_deep,
        _manifest_wrong_shape,
        _manifest_escapes,
        _file_is_link,
    ],
)
def test_a_damaged_cached_folder_is_refused(tmp_path, damage):
    folder = _sealed(tmp_path)
    assert sealed_folder_problem(str(folder), REQUIRED) is None
    damage(folder)
    assert sealed_folder_problem(str(folder), REQUIRED) is not None


def test_a_link_or_a_file_in_the_folders_place_is_refused(tmp_path):
    folder = _sealed(tmp_path)
    link = tmp_path / "link"
    os.symlink(folder, link)
    assert sealed_folder_problem(str(link), REQUIRED) is not None
    (tmp_path / "plain").write_text("x")
    assert sealed_folder_problem(str(tmp_path / "plain"), REQUIRED) is not None


def test_a_required_file_missing_from_the_manifest_is_refused(tmp_path):
    folder = _sealed(tmp_path)
    assert sealed_folder_problem(str(folder), ("a.json", "tokenizer.json")) is not None


@pytest.mark.slow
def test_a_corrupted_cached_tokenizer_is_built_again(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))
    gguf = default_model_path()
    target = gguf_tokenizer_folder(gguf)
    good = open(os.path.join(target, "tokenizer.json"), "rb").read()
    with open(os.path.join(target, "tokenizer.json"), "wb") as f:
        f.write(good[: len(good) // 2])
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    with caplog.at_level(logging.WARNING, logger="pagedllm.model.tokenizer"):
        assert gguf_tokenizer_folder(gguf) == target
        os.rename(target, str(tmp_path / "moved"))
        os.symlink(outside, target)  # a link in the cache's place: unlinked, never followed
        assert gguf_tokenizer_folder(gguf) == target
    assert open(os.path.join(target, "tokenizer.json"), "rb").read() == good
    assert sealed_folder_problem(target, ("tokenizer.json",)) is None
    assert (outside / "keep.txt").read_text() == "mine" and os.listdir(outside) == ["keep.txt"]
    warnings = [r for r in caplog.records if "building it again" in r.getMessage()]
    assert len(warnings) == 2
    assert not [n for n in os.listdir(os.path.dirname(target)) if n.startswith(".tmp-")]
