"""The prefix cache's disk tier (--kv-offload-dir): it serves what it holds, also to a restarted engine, and never a
block that is torn, truncated, corrupted or from another engine; a disk that refuses writes never fails a request.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import zlib
from functools import partial

import pytest
from engine_helpers import assert_all_blocks_free, assert_disk_tier_round_trip

from pagedllm import SamplingParams
from pagedllm.engine import EngineConfig, LLMEngine
from pagedllm.engine.config import add_engine_args
from pagedllm.engine.disk_tier import _file_digest
from pagedllm.errors import UserError
from pagedllm.kv.offload import HEADER, DiskKVTier
from pagedllm.model.formats.cache import cache_dir_for

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
FP_A, FP_B = bytes(32), bytes([1] * 32)
PAYLOAD = 4096


def payload(block_hash: bytes) -> bytes:
    return (block_hash * (PAYLOAD // 32))[:PAYLOAD]


def key(i: int) -> bytes:
    return i.to_bytes(2, "little") * 16


# ---- the tier alone ------------------------------------------------------------------------------------------
def test_tier_reopens_its_blocks_and_ignores_another_fingerprints(tmp_path):
    tier = DiskKVTier(str(tmp_path), 2**20, FP_A, PAYLOAD)
    for i in range(3):
        assert tier.put(key(i), lambda i=i: payload(key(i)))
    assert not tier.put(key(0), lambda: payload(key(0)))  # queued or written already: not twice
    tier.flush()
    assert tier.stats.writes == 3
    again = DiskKVTier(str(tmp_path), 2**20, FP_A, PAYLOAD)
    assert [again.load(key(i)) for i in range(3)] == [payload(key(i)) for i in range(3)]
    other = DiskKVTier(str(tmp_path), 2**20, FP_B, PAYLOAD)
    assert not other.contains(key(0)) and other.load(key(0)) is None


def test_tier_stays_within_its_size_evicting_the_least_recently_used(tmp_path):
    tier = DiskKVTier(str(tmp_path), 3 * (HEADER.size + PAYLOAD), FP_A, PAYLOAD)
    for i in range(3):
        tier.put(key(i), lambda i=i: payload(key(i)))
    tier.flush()
    assert tier.load(key(0)) == payload(key(0))  # 0 is now more recent than 1
    tier.put(key(3), lambda: payload(key(3)))
    tier.flush()
    assert [tier.contains(key(i)) for i in range(4)] == [True, False, True, True]
    assert tier.stats.bytes <= tier.max_bytes and len(os.listdir(tier.dir)) == 3


def test_bad_files_are_never_served_and_are_deleted(tmp_path):
    tier = DiskKVTier(str(tmp_path), 2**20, FP_A, PAYLOAD)
    for i in range(5):
        tier.put(key(i), lambda i=i: payload(key(i)))
    tier.flush()
    files = [tier._path(key(i)) for i in range(5)]
    with open(files[0], "r+b") as f:  # truncated
        f.truncate(HEADER.size + PAYLOAD // 2)
    with open(files[1], "r+b") as f:  # one payload byte flipped
        f.seek(HEADER.size + 100)
        byte = f.read(1)
        f.seek(HEADER.size + 100)
        f.write(bytes([byte[0] ^ 1]))
    for i, fp, stored, data in ((2, FP_B, key(2), payload(key(2))), (3, FP_A, key(4), payload(key(4)))):
        with open(files[i], "wb") as f:  # another engine's block; another block under this one's name
            f.write(HEADER.pack(b"PLKVBLK1", fp, stored, len(data), zlib.crc32(data)) + data)
    with open(files[4], "wb") as f:  # torn inside the header
        f.write(b"PLKV")
    reopened = DiskKVTier(str(tmp_path), 2**20, FP_A, PAYLOAD)
    assert [reopened.load(key(i)) for i in range(5)] == [None] * 5
    assert reopened.stats.bad_files == 5 and reopened.stats.loads == 0 and os.listdir(reopened.dir) == []


def test_a_disk_that_refuses_writes_stops_the_writing_not_the_caller(tmp_path):
    tiny = DiskKVTier(str(tmp_path / "tiny"), 100, FP_A, PAYLOAD)  # no block fits
    assert tiny.put(key(0), lambda: payload(key(0)))
    tiny.flush()
    assert not tiny.writable and not tiny.contains(key(0)) and os.listdir(tiny.dir) == []
    blocked = tmp_path / "blocked"  # a path that cannot be a folder (the tests run as root: chmod does not stop them)
    blocked.write_text("")
    unusable = DiskKVTier(str(blocked), 2**20, FP_A, PAYLOAD)
    assert not unusable.writable and not unusable.put(key(0), lambda: payload(key(0))) and unusable.load(key(0)) is None


KILLED_WRITER = textwrap.dedent("""
    import sys
    from pagedllm.kv.offload import DiskKVTier
    def key(i):
        return i.to_bytes(2, "little") * 16
    def payload(block_hash):
        return (block_hash * 128)[:4096]
    tier = DiskKVTier(sys.argv[1], 2**30, bytes(32), 4096)
    for i in range(40):
        tier.put(key(i), lambda i=i: payload(key(i)))
    tier.flush()
    print("acked", flush=True)
    i = 40
    while True:  # keep writing until killed
        tier.put(key(i % 60000), lambda i=i: payload(key(i % 60000)))
        i += 1
""")


def test_killing_the_writer_loses_nothing_acknowledged(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"acked"
        proc.stdout.close()
        deadline = time.monotonic() + 60
        while len(os.listdir(tmp_path / FP_A.hex()[:16])) < 60 and time.monotonic() < deadline:
            time.sleep(0.001)  # then killed while it writes
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    tier = DiskKVTier(str(tmp_path), 2**30, FP_A, PAYLOAD)
    assert [tier.load(key(i)) for i in range(40)] == [payload(key(i)) for i in range(40)]
    assert tier.stats.blocks >= 40 and tier.stats.bad_files == 0
    assert all(name.endswith(".kv") for name in os.listdir(tier.dir))  # torn writes' temporary files are gone


# ---- a folder someone else can write in: nothing outside DIR is touched, one odd entry stops nothing --------
def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "pagedllm" and r.levelno >= logging.WARNING]


def test_a_planted_temporary_link_is_never_written_through(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"precious")
    tier = DiskKVTier(str(tmp_path / "kv"), 2**20, FP_A, PAYLOAD)
    os.symlink(outside, f"{tier._path(key(0))}.{os.getpid()}.tmp")  # the temporary name the hash and PID predict
    assert tier.put(key(0), lambda: payload(key(0)))
    tier.flush()
    assert outside.read_bytes() == b"precious"
    assert tier.load(key(0)) == payload(key(0)) and not os.path.islink(tier._path(key(0)))
    reopened = DiskKVTier(str(tmp_path / "kv"), 2**20, FP_A, PAYLOAD)  # a restart's clean-up follows no link either
    assert reopened.load(key(0)) == payload(key(0)) and outside.read_bytes() == b"precious"


def test_a_link_under_a_blocks_name_is_never_read_through(tmp_path):
    elsewhere = DiskKVTier(str(tmp_path / "elsewhere"), 2**20, FP_A, PAYLOAD)  # a valid block, outside DIR
    elsewhere.put(key(0), lambda: payload(key(0)))
    elsewhere.flush()
    before = open(elsewhere._path(key(0)), "rb").read()
    folder = tmp_path / "kv" / FP_A.hex()[:16]
    folder.mkdir(parents=True)
    os.symlink(elsewhere._path(key(0)), folder / (key(0).hex() + ".kv"))
    tier = DiskKVTier(str(tmp_path / "kv"), 2**20, FP_A, PAYLOAD)
    assert not tier.contains(key(0)) and tier.load(key(0)) is None and tier.stats.skipped == 1
    assert tier.put(key(0), lambda: payload(key(0)))  # written over the link, not through it
    tier.flush()
    assert tier.load(key(0)) == payload(key(0)) and not os.path.islink(tier._path(key(0)))
    assert open(elsewhere._path(key(0)), "rb").read() == before
    os.unlink(tier._path(key(0)))
    os.link(elsewhere._path(key(0)), tier._path(key(0)))  # a hard link to the file outside: not read either
    again = DiskKVTier(str(tmp_path / "kv"), 2**20, FP_A, PAYLOAD)
    assert again.load(key(0)) is None and open(elsewhere._path(key(0)), "rb").read() == before


def test_a_symlinked_folder_is_refused_and_whatever_it_points_to_survives(tmp_path, caplog):
    for link in ("dir", "fingerprint folder"):
        victim = tmp_path / link / "victim"
        victim.mkdir(parents=True)
        (victim / "notes.txt").write_text("mine")
        root = tmp_path / link / "kv"
        if link == "dir":
            os.symlink(victim, root)
        else:
            root.mkdir()
            os.symlink(victim, root / FP_A.hex()[:16])
        caplog.clear()
        tier = DiskKVTier(str(root), 2**20, FP_A, PAYLOAD)
        assert not tier.writable and not tier.put(key(0), lambda: payload(key(0))) and tier.load(key(0)) is None
        tier.flush()
        assert os.listdir(victim) == ["notes.txt"] and (victim / "notes.txt").read_text() == "mine"
        assert len(warnings(caplog)) == 1 and "is a symlink" in warnings(caplog)[0]


def test_one_odd_entry_is_skipped_and_writing_goes_on(tmp_path, caplog):
    folder = tmp_path / FP_A.hex()[:16]
    folder.mkdir()
    (folder / (key(0).hex() + ".kv")).mkdir()  # a folder under a block's name: that block cannot be written
    os.mkfifo(folder / (key(1).hex() + ".kv"))  # a FIFO: opening it to read would wait forever
    (folder / "notes.txt").write_text("mine")  # a stranger's file: not ours to delete
    tier = DiskKVTier(str(tmp_path), 2**20, FP_A, PAYLOAD)
    assert not tier.contains(key(0)) and not tier.contains(key(1)) and tier.stats.skipped == 3
    caplog.clear()
    for i in range(4):
        assert tier.put(key(i), lambda i=i: payload(key(i)))
    tier.flush()
    assert tier.writable and [tier.load(key(i)) for i in range(4)] == [None] + [payload(key(i)) for i in (1, 2, 3)]
    assert not tier.put(key(0), lambda: payload(key(0)))  # skipped from now on, not rewritten at every eviction
    assert len(warnings(caplog)) == 1 and key(0).hex() in warnings(caplog)[0]
    names = sorted(os.listdir(folder))  # no temporary file left behind, the stranger's file and the folder kept
    assert names == sorted([key(i).hex() + ".kv" for i in range(4)] + ["notes.txt"])
    assert (folder / (key(0).hex() + ".kv")).is_dir() and (folder / "notes.txt").read_text() == "mine"


def test_a_corrupted_checkpoint_hash_memo_is_hashed_again(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))
    weights = tmp_path / "model.gguf"
    weights.write_bytes(bytes(range(256)) * 1000)
    true = hashlib.sha256(weights.read_bytes()).digest()
    assert _file_digest(str(weights)) == true
    memo_dir = cache_dir_for(str(weights), "digest")
    memo = os.path.join(memo_dir, "sha256")
    st = os.stat(weights)
    fields = {"sha256": true.hex(), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    outside = tmp_path / "outside"
    outside.write_bytes(bytes(32))
    bad: list[bytes | str] = [
        bytes(32),  # a wrong digest as the bare bytes memos used to be
        b"",
        b"[1, 2]",
        b"[" * 4000,  # deeper than Python's recursion limit, within the memo's 4 KiB
        b"[" * 200_000,
        b" " * 2**20 + json.dumps(fields).encode(),
        json.dumps({**fields, "sha256": "zz" * 32}).encode(),
        json.dumps({**fields, "sha256": "00" * 32, "size": str(st.st_size)}).encode(),
        json.dumps({**fields, "sha256": "00" * 32, "size": float("inf")}).encode(),  # Infinity
        json.dumps({**fields, "sha256": "00" * 32, "mtime_ns": st.st_mtime_ns + 1}).encode(),
        json.dumps({**fields, "sha256": "00" * 32, "extra": 1}).encode(),
        "a folder",
        "a link",
    ]
    for content in bad:
        os.rmdir(memo) if os.path.isdir(memo) and not os.path.islink(memo) else os.unlink(memo)
        if content == "a folder":
            os.mkdir(memo)
        elif content == "a link":
            os.symlink(outside, memo)
        else:
            with open(memo, "wb") as f:
                f.write(content)
        caplog.clear()
        assert _file_digest(str(weights)) == true, content
        assert len(warnings(caplog)) == 1 and "hashing the file again" in warnings(caplog)[0], content
        assert os.listdir(memo_dir) == ["sha256"] and outside.read_bytes() == bytes(32), content
    assert not os.path.islink(memo) and json.loads(open(memo, "rb").read()) == fields  # the link replaced, not followed
    caplog.clear()
    assert _file_digest(str(weights)) == true and warnings(caplog) == []  # a good memo is taken silently


# ---- in the engine -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prompts(model_fp32):
    rng = random.Random(20)
    vocab = model_fp32.config.vocab_size
    return [[rng.randrange(300, vocab) for _ in range(100)] for _ in range(4)]


def small_engine(model, **kw) -> LLMEngine:
    """A RAM pool of 20 blocks: the four 7-block prompts do not fit in it together."""
    kw.setdefault("kv_cache_memory", 20 * 737_280)
    return LLMEngine(EngineConfig(max_model_len=256, log_stats_interval=0, speculative_config=None, **kw), model)


def run(engine: LLMEngine, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens and cached prompt tokens per prompt, one request after another."""
    tokens, cached = [], []
    for i, p in enumerate(prompts):
        engine.add_request(f"r{engine.num_steps}-{i}", p, GREEDY)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens.append(out.outputs[0].token_ids)
                    cached.append(out.num_cached_tokens)
    assert_all_blocks_free(engine)
    return tokens, cached


@pytest.fixture(scope="module")
def cold(model_fp32, prompts):
    return run(small_engine(model_fp32), prompts)[0]


def test_disk_tier_serves_evicted_prefixes_and_a_restarted_engine(model_fp32, prompts, cold, tmp_path):
    assert_disk_tier_round_trip(partial(small_engine, model_fp32), run, prompts, cold, str(tmp_path))


def test_prefixes_never_evicted_reach_the_disk_when_the_engine_goes_idle(model_fp32, prompts, cold, tmp_path):
    engine = small_engine(model_fp32, kv_offload_dir=str(tmp_path))
    run(engine, prompts[:1])  # a hot prefix: it fits in RAM and is never evicted
    engine.disk_tier.flush()
    restarted = small_engine(model_fp32, kv_offload_dir=str(tmp_path))
    assert run(restarted, prompts[:1]) == (cold[:1], [96])


def test_damaged_block_files_are_never_served_by_the_engine(model_fp32, prompts, cold, tmp_path):
    engine = small_engine(model_fp32, kv_offload_dir=str(tmp_path))
    run(engine, prompts)
    engine.disk_tier.flush()
    names = sorted(os.listdir(engine.disk_tier.dir))
    for n, name in enumerate(names):
        path = os.path.join(engine.disk_tier.dir, name)
        with open(path, "r+b") as f:
            if n % 3 == 0:
                f.truncate(os.path.getsize(path) - 1)
            elif n % 3 == 1:
                f.seek(-5, os.SEEK_END)
                f.write(b"\xff\x00\xff\x00\xff")
            else:  # intact payload, but written by another engine
                f.seek(8)
                f.write(FP_B)
    restarted = small_engine(model_fp32, kv_offload_dir=str(tmp_path))
    tokens, cached = run(restarted, prompts)
    assert tokens == cold and cached == [0] * 4
    assert restarted.stats().prefix_cache_disk_hits == 0 and restarted.disk_tier.stats.bad_files == 4


def test_an_unwritable_or_tiny_tier_leaves_serving_unaffected(model_fp32, prompts, cold, tmp_path):
    tiny = small_engine(model_fp32, kv_offload_dir=str(tmp_path / "tiny"), kv_offload_size=1000)
    assert run(tiny, prompts)[0] == cold and not tiny.disk_tier.writable
    broken = small_engine(model_fp32, kv_offload_dir=str(tmp_path / "broken"))
    os.rmdir(broken.disk_tier.dir)  # the folder goes away under the running engine: every write fails
    open(broken.disk_tier.dir, "w").close()
    assert run(broken, prompts)[0] == cold
    broken.disk_tier.flush()
    assert broken.disk_tier.stats.write_errors == 1 and not broken.disk_tier.writable


def test_a_symlinked_fingerprint_folder_is_refused_and_serving_goes_on(model_fp32, prompts, cold, tmp_path):
    first = small_engine(model_fp32, kv_offload_dir=str(tmp_path / "kv"))
    assert first.disk_tier is not None and os.listdir(first.disk_tier.dir) == []
    os.rmdir(first.disk_tier.dir)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_text("mine")
    os.symlink(victim, first.disk_tier.dir)
    engine = small_engine(model_fp32, kv_offload_dir=str(tmp_path / "kv"))
    assert run(engine, prompts)[0] == cold and not engine.disk_tier.writable
    engine.disk_tier.flush()
    assert os.listdir(victim) == ["notes.txt"] and (victim / "notes.txt").read_text() == "mine"


def test_offload_flags_are_read_and_checked():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--kv-offload-dir", "/tmp/x", "--kv-offload-size", "2GiB"])
    config = EngineConfig.from_args(args)
    assert (config.kv_offload_dir, config.kv_offload_size) == ("/tmp/x", 2 * 2**30)
    with pytest.raises(UserError, match="--kv-offload-size"):
        EngineConfig.from_args(parser.parse_args(["--kv-offload-size", "lots"]))
    with pytest.raises(UserError, match="--kv-offload-dir"):
        EngineConfig(kv_offload_dir="/tmp/x", enable_prefix_caching=False)
