"""`pagedllm kv-calc` reproduces the book it follows (its figures, and its Korean lines character for character)."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest
from cli_helpers import finish, run_cli_here, start_cli

from pagedllm.entrypoints.cli import main

ARGS = ["kv-calc", "--max-len", "4096", "--block-size", "16", "--used", "180,650,90,1200,300,75,420,260"]


# The book's two programs, character for character as printed in the book (../shared/seed/).
BOOK_TOTALS = """import math

max_len, page = 4096, 16                       # 최대 길이와 쪽 하나의 토큰 수
used = [180, 650, 90, 1200, 300, 75, 420, 260]  # 요청 여덟 개가 실제로 쓴 토큰 수(예시)

whole = max_len * len(used)                                  # 통째로 잡으면
paged = sum(math.ceil(u / page) * page for u in used)        # 쪽으로 잡으면(쪽 단위로 올림)
print("실제로 쓴 토큰:", sum(used))
print(f"통째로 잡은 자리: {whole:,} (쓴 몫 {sum(used) / whole:.1%})")
print(f"쪽으로 잡은 자리: {paged:,} (쓴 몫 {sum(used) / paged:.1%})")
"""
BOOK_PER_REQUEST = """import math

page = 16                       # 쪽 하나에 토큰 16개
for used in [1, 16, 17, 35]:    # 요청 하나가 쓴 토큰 수(설명용 숫자)
    pages = math.ceil(used / page)
    print(f"{used:2d}토큰 → 쪽 {pages}개 = 자리 {pages * page}칸, 빈칸 {pages * page - used}")
"""
# ... and the output the book prints for the second one.
BOOK_OUTPUT = [
    " 1토큰 → 쪽 1개 = 자리 16칸, 빈칸 15",
    "16토큰 → 쪽 1개 = 자리 16칸, 빈칸 0",
    "17토큰 → 쪽 2개 = 자리 32칸, 빈칸 15",
    "35토큰 → 쪽 3개 = 자리 48칸, 빈칸 13",
]


def run_book(used: list[int], max_len: int = 4096, page: int = 16) -> list[str]:
    """Both programs as printed, their numbers swapped for these (the code itself untouched), stdout lines."""
    totals = BOOK_TOTALS.replace("[180, 650, 90, 1200, 300, 75, 420, 260]", repr(used)).replace(
        "max_len, page = 4096, 16", f"max_len, page = {max_len}, {page}"
    )
    per_request = BOOK_PER_REQUEST.replace("[1, 16, 17, 35]", repr(used)).replace("page = 16 ", f"page = {page} ")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(totals, {})
        exec(per_request, {})
    return out.getvalue().splitlines()


def test_the_book_prints_what_its_code_prints():
    assert run_book([1, 16, 17, 35])[3:] == BOOK_OUTPUT


@pytest.mark.parametrize("used", [[1, 16, 17, 35], [180, 650, 90, 1200, 300, 75, 420, 260], [0, 5, 100, 4096]])
@pytest.mark.parametrize("page", [16, 32])
def test_korean_lines_match_the_book(capsys, used, page):
    flags = ["kv-calc", "--max-len", "4096", "--block-size", str(page), "--used", ",".join(map(str, used))]
    assert main(flags + ["--lang", "ko"]) == 0
    assert capsys.readouterr().out.splitlines() == run_book(used, page=page)


def test_korean_book_example_exactly(capsys):
    assert main(["kv-calc", "--max-len", "4096", "--block-size", "16", "--used", "1,16,17,35", "--lang", "ko"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[3:] == BOOK_OUTPUT and out[0] == "실제로 쓴 토큰: 69"
    assert main(ARGS + ["--lang", "ko"]) == 0
    assert capsys.readouterr().out.splitlines()[:3] == [
        "실제로 쓴 토큰: 3175",
        "통째로 잡은 자리: 32,768 (쓴 몫 9.7%)",
        "쪽으로 잡은 자리: 3,232 (쓴 몫 98.2%)",
    ]


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


def test_book_small_example(capsys):
    assert main(["kv-calc", "--used", "1,16,17,35"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[1:] for r in rows if len(r) == 5] == [
        ["1", "1", "16", "15"],
        ["16", "1", "16", "0"],
        ["17", "2", "32", "15"],
        ["35", "3", "48", "13"],
    ]


BAD_INPUT = [
    (["--used", ""], "--used"),
    (["--used", "1,-5"], "--used"),
    (["--used", "1,abc"], "--used"),
    (["--block-size", "0"], "--block-size"),
    (["--max-len", "x"], "--max-len"),
    (["--model", "--memory", "lots"], "--memory"),
]
DTYPE_ONLY_FOR_THE_CACHE = ["--model", "--dtype", "int8"]
NOT_A_CACHE_DTYPE = ["--model", "--kv-cache-dtype", "float16"]


@pytest.fixture(scope="module")
def cli_runs():
    """`pagedllm kv-calc FLAGS` for each set of flags the tests below give: the one that reads the model's config
    before it fails as a user runs it (a new process, so a fresh start prints only the error's line), the others
    through the same `main` in this process while that one starts (tests/cli_helpers.py)."""
    runs = [flags for flags, _ in BAD_INPUT] + [DTYPE_ONLY_FOR_THE_CACHE, NOT_A_CACHE_DTYPE]
    fresh = ["--model", "--memory", "lots"]
    proc = start_cli(["kv-calc", *fresh])
    done = {tuple(flags): run_cli_here(["kv-calc", *flags]) for flags in runs if flags != fresh}
    done[tuple(fresh)] = finish(proc)
    return done


@pytest.mark.parametrize("flags, flag", BAD_INPUT)
def test_bad_input_is_one_line_naming_the_flag_and_exit_2(cli_runs, flags, flag):
    proc = cli_runs[tuple(flags)]
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
    assert paged > 9 * (blocks * 16 // 4096)  # the book: about ten times as many
    # each --kv-cache-dtype: int8 and fp8 keep 64 one-byte values and one bfloat16 scale per head: 66 bytes, not 128
    rows = {
        line.split()[0]: line.split()[1:]
        for line in out.splitlines()
        if line.strip().startswith(("float32", "int8", "fp8"))
    }
    assert rows["float32"][:2] == ["46,080", "1.00x"] and rows["int8"][:2] == rows["fp8"][:2] == ["11,880", "3.88x"]
    assert int(rows["int8"][2].replace(",", "")) == 4 * 2**30 // (11_880 * 16) * 16


def test_plot_draws_whole_above_paged_with_the_totals(tmp_path, monkeypatch):
    from pagedllm.bench import block_map_plot

    drawn = []
    real = block_map_plot.draw_rows
    monkeypatch.setattr(block_map_plot, "draw_rows", lambda ax, m, **kw: drawn.append(m) or real(ax, m, **kw))
    assert main(ARGS + ["--plot", str(tmp_path / "kv.png")]) == 0
    assert (tmp_path / "kv.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    whole, paged = drawn
    assert whole.counters.slots_allocated == 32_768 and paged.counters.slots_allocated == 3_232
    assert [r.row[-1] for r in whole.requests][:2] == [["reserved", 1, 256 - 12], ["reserved", 1, 256 - 41]]
    assert paged.requests[0].row == [["used", 1, 11], ["tail", 1, 1]]  # 180 tokens: the 12th has 12 empty
    assert paged.requests[3].row == [["used", 1, 75]]  # 1,200 tokens fill 75 blocks exactly
    lines = block_map_plot.plot_kv_calc([180, 650, 90, 1200, 300, 75, 420, 260], 16, 4096, str(tmp_path / "b.png"))
    assert lines == [
        "3,175 tokens used",
        "whole: 32,768 slots (9.7% used), 4,096 reserved per request",
        "paged: 3,232 slots (98.2% used), blocks of 16",
    ]


def _bytes_per_token(out: str) -> int:
    return int(out.split("KV bytes per token: ")[1].split()[0].replace(",", ""))


def test_kv_cache_dtype_sets_the_cache_and_dtype_the_model(capsys):
    # --kv-cache-dtype is the cache's dtype, as in `pagedllm serve`: int8 keeps 64 bytes + a 2-byte scale per head
    assert main(ARGS + ["--model", "--kv-cache-dtype", "int8"]) == 0
    assert _bytes_per_token(capsys.readouterr().out) == 30 * 3 * 2 * 66
    # --dtype is the model's: the cache follows it only with --kv-cache-dtype auto
    assert main(ARGS + ["--model", "--kv-cache-dtype", "auto", "--dtype", "float32"]) == 0
    assert _bytes_per_token(capsys.readouterr().out) == 46_080
    assert main(ARGS + ["--model", "--dtype", "float32"]) == 0
    assert _bytes_per_token(capsys.readouterr().out) == 23_040  # the cache's default stays bfloat16


def test_dtype_is_the_models_so_a_cache_only_dtype_names_the_flag(cli_runs):
    proc = cli_runs[tuple(DTYPE_ONLY_FOR_THE_CACHE)]
    assert proc.returncode == 2 and "--dtype" in proc.stderr and "Traceback" not in proc.stderr


def test_model_groups_and_window_blocks(tmp_path):
    """kv-calc --model reports bytes per token per KV-cache group, and what a window frees."""
    import json

    folder = tmp_path / "m"
    folder.mkdir()
    cfg = dict(architectures=["MistralForCausalLM"], vocab_size=8, hidden_size=64, intermediate_size=64)
    cfg.update(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, sliding_window=256)
    (folder / "config.json").write_text(json.dumps(cfg))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*ARGS, "--model", str(folder), "--kv-cache-dtype", "float32"]) == 0
    text = out.getvalue()
    assert "sliding window 256: 4 layers, 1,024 bytes per token" in text  # (K, V) x 4 layers x 2 heads x 16 x 4 B
    # 4096 tokens: 256 blocks, of which (4096 - 256 + 1) // 16 = 240 went back
    assert "a request of 4,096 tokens holds 16 blocks (not 256)" in text


def _choices(parser: argparse.ArgumentParser, flag: str) -> list[str]:
    return next(list(a.choices) for a in parser._actions if flag in a.option_strings)


def test_kv_calc_offers_the_cache_dtypes_the_engine_takes(cli_runs):
    """One table of --kv-cache-dtype names (vLLM's): kv-calc offers what `pagedllm serve` takes, and a name the
    engine refuses (float16) is refused by both, naming the flag."""
    from pagedllm.engine.config import EngineConfig, add_engine_args
    from pagedllm.entrypoints import kv_calc
    from pagedllm.errors import UserError

    serve = argparse.ArgumentParser()
    add_engine_args(serve)
    engine = _choices(serve, "--kv-cache-dtype")
    assert engine == ["auto", "float32", "bfloat16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"]
    commands = argparse.ArgumentParser().add_subparsers()
    kv_calc.add_parser(commands)
    assert _choices(commands.choices["kv-calc"], "--kv-cache-dtype") == engine
    with pytest.raises(UserError, match="--kv-cache-dtype: input should be 'auto', 'float32', .* got 'float16'"):
        EngineConfig(kv_cache_dtype="float16")
    proc = cli_runs[tuple(NOT_A_CACHE_DTYPE)]
    assert proc.returncode == 2 and "--kv-cache-dtype" in proc.stderr and "Traceback" not in proc.stderr
