"""benchmarks/serving/real_sizes.py's `w1` (issue 35: "64 prompts vs vLLM-CPU"): both systems on one HF folder,
the order swapped each round, the ratio taken within each round; vLLM's extra flags and its own PYTHONPATH reach
its command line and nothing else. The systems themselves are stubbed: what is checked is the pairing, which a
wrong loop or a swapped division would break silently (a ratio still prints)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess

import pytest

from benchmarks import common
from benchmarks.serving import compare_throughput, real_sizes


def _args(**kw) -> argparse.Namespace:
    base = dict(hf="/x/folder", hybrid=None, random_hf=None, dir="/x", rounds=3, skip="", w1_prompts=64, input_len=256)
    base |= dict(output_len=128, seed=0, vllm_args="--enforce-eager", pagedllm_args="")
    return argparse.Namespace(**(base | kw))


def test_w1_pair_swaps_order_and_pairs_ratios(monkeypatch):
    calls: list[tuple[str, str]] = []
    speed = {"pagedllm": iter([30.0, 40.0, 50.0]), "vllm": iter([10.0, 20.0, 100.0])}

    def fake_w1(folder, a, tmp):
        calls.append(("pagedllm", folder))
        return next(speed["pagedllm"])

    def fake_vllm(a, tmp, folder=None):
        calls.append(("vllm", folder))
        return next(speed["vllm"])

    monkeypatch.setattr(real_sizes, "w1", fake_w1)
    monkeypatch.setattr(real_sizes, "w1_vllm", fake_vllm)
    res = real_sizes.w1_pair(_args())
    assert [c[0] for c in calls] == ["pagedllm", "vllm", "vllm", "pagedllm", "pagedllm", "vllm"]
    assert {c[1] for c in calls} == {"/x/folder"}  # the same weights on both sides
    # the order of the calls differs per round; each round's pair stays paired
    assert res["pagedllm"] == [30.0, 40.0, 50.0] and res["vllm"] == [10.0, 20.0, 100.0]
    assert res["ratios"] == pytest.approx([3.0, 2.0, 0.5])


def test_w1_pair_skips_a_system(monkeypatch):
    monkeypatch.setattr(real_sizes, "w1", lambda folder, a, tmp: 1.0)
    monkeypatch.setattr(real_sizes, "w1_vllm", lambda a, tmp, folder=None: pytest.fail("vLLM was skipped"))
    res = real_sizes.w1_pair(_args(skip="vllm", rounds=2))
    assert res == {"pagedllm": [1.0, 1.0]}


def test_pagedllm_w1_appends_its_flags(monkeypatch, tmp_path):
    seen = []

    def fake_run(cmd, check):
        seen.append(cmd)
        with open(cmd[cmd.index("--output-json") + 1], "w") as f:
            json.dump({"output_tokens_per_s": 12.5}, f)

    monkeypatch.setattr(real_sizes.subprocess, "run", fake_run)
    assert real_sizes.w1("/x/folder", _args(pagedllm_args="--quantization int8"), str(tmp_path)) == 12.5
    assert seen[0][-2:] == ["--quantization", "int8"] and "/x/folder" in seen[0]


def test_vllm_throughput_appends_flags_and_checks_workload(monkeypatch, tmp_path):
    seen = []

    def fake_run(cmd, check):
        seen.append(cmd[-1])
        path = cmd[-1].split("--output-json ")[1].split()[0]
        with open(path, "w") as f:
            json.dump({"total_num_tokens": 2 * (16 + 8), "elapsed_time": 4.0}, f)

    monkeypatch.setenv("ANCHORS", str(tmp_path))
    monkeypatch.setattr(compare_throughput.subprocess, "run", fake_run)
    out = compare_throughput.vllm_throughput("/m", "bfloat16", 2, 16, 8, 0, str(tmp_path / "v.json"), "--enforce-eager")
    assert seen[0].endswith("--enforce-eager")
    assert out == pytest.approx(2 * 8 / 4.0)
    with pytest.raises(SystemExit, match="different workload"):
        compare_throughput.vllm_throughput("/m", "bfloat16", 3, 16, 8, 0, str(tmp_path / "v.json"))


@pytest.mark.skipif(not os.path.isfile(os.path.join(common.ANCHOR_SCRIPTS, "vllm-env.sh")), reason="no anchors")
def test_vllm_env_gives_vllm_its_own_pythonpath(monkeypatch, tmp_path):
    monkeypatch.setenv("ANCHORS", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", "/the/project")
    monkeypatch.setenv("VLLM_PYTHONPATH", "/only/vllm")
    got = subprocess.run(common.vllm_env('echo "$PYTHONPATH"'), capture_output=True, text=True, check=True)
    assert got.stdout.strip() == "/only/vllm"
    monkeypatch.delenv("VLLM_PYTHONPATH")
    got = subprocess.run(common.vllm_env('echo "$PYTHONPATH"'), capture_output=True, text=True, check=True)
    assert got.stdout.strip() == "/the/project"  # unchanged without it
