"""`pagedllm kv-calc` reproduces the chapter (its figures, and its Korean lines character for character)."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest

from pagedllm.entrypoints.cli import main

ARGS = ["kv-calc", "--max-len", "4096", "--block-size", "16", "--used", "180,650,90,1200,300,75,420,260"]


def chapter_lines() -> list[str]:
    """The chapter's own code, run as printed in the book."""
    max_len, page = 4096, 16
    used = [180, 650, 90, 1200, 300, 75, 420, 260]
    whole = max_len * len(used)
    paged = sum(math.ceil(u / page) * page for u in used)
    return [f"실제로 쓴 토큰: {sum(used)}",
            f"통째로 잡은 자리: {whole:,} (쓴 몫 {sum(used) / whole:.1%})",
            f"쪽으로 잡은 자리: {paged:,} (쓴 몫 {sum(used) / paged:.1%})"]


def test_korean_lines_match_the_chapter(capsys):
    assert main(ARGS + ["--lang", "ko"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == chapter_lines()
    assert out == ["실제로 쓴 토큰: 3175", "통째로 잡은 자리: 32,768 (쓴 몫 9.7%)", "쪽으로 잡은 자리: 3,232 (쓴 몫 98.2%)"]


def test_english_figures_and_rows(capsys):
    assert main(ARGS) == 0
    out = capsys.readouterr().out
    assert "3,175 tokens used" in out
    assert "whole: 32,768 slots (9.7% used)" in out
    assert "paged: 3,232 slots (98.2% used)" in out
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert len(rows) == 8
    assert rows[0] == ["1", "180", "12", "192", "12"]  # 180 tokens -> 12 blocks, 192 slots, 12 empty
    assert rows[3] == ["4", "1,200", "75", "1,200", "0"]


def test_chapter_small_example(capsys):
    assert main(["kv-calc", "--used", "1,16,17,35"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[1:] for r in rows if len(r) == 5] == [["1", "1", "16", "15"], ["16", "1", "16", "0"],
                                                   ["17", "2", "32", "15"], ["35", "3", "48", "13"]]


@pytest.mark.parametrize("flags, flag", [
    (["--used", ""], "--used"), (["--used", "1,-5"], "--used"), (["--used", "1,abc"], "--used"),
    (["--block-size", "0"], "--block-size"), (["--max-len", "x"], "--max-len"),
    (["--model", "--memory", "lots"], "--memory"),
])
def test_bad_input_is_one_line_naming_the_flag_and_exit_2(flags, flag):
    proc = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "kv-calc", *flags],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and "Traceback" not in proc.stderr


def test_model_and_memory_report_what_fits(capsys):
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x 2 (K, V) x 2 bytes = 23,040 bytes per token.
    assert main(ARGS + ["--model", "--memory", "4GiB"]) == 0
    out = capsys.readouterr().out
    assert "KV bytes per token: 23,040" in out and "KV bytes per block of 16: 368,640" in out
    blocks = 4 * 2**30 // 368_640
    assert f"{blocks:,} blocks = {blocks * 16:,} tokens" in out
    assert f"contiguous: {blocks * 16 // 4096:,} requests" in out  # one 4,096-token locker each
    paged = int(out.split("paged: ")[-1].split()[0].replace(",", ""))
    assert paged > 9 * (blocks * 16 // 4096)  # the chapter: about ten times as many
