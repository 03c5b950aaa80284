"""`bench sweep` logic against a fake engine (the real one is exercised by running the command)."""

import argparse
import json
import types

import pytest

import pagedllm.engine as engine_api
from pagedllm.bench import sweep
from pagedllm.engine.stats import EngineStats

PER_TOKEN = 100  # bytes of KV per token in the fake model


class _Out:
    def __init__(self, rid, ids, finished):
        self.request_id = rid
        self.outputs = [type("C", (), {"token_ids": ids})()]
        self.finished = finished


class FakeEngine:
    """Admits waiting requests while their blocks fit (max_model_len each if contiguous), one token per step."""

    def __init__(self, cfg, loaded=None):
        self.cfg = cfg
        self.bs = cfg.block_size
        self.num_blocks = cfg.kv_cache_memory // (PER_TOKEN * self.bs)
        self.waiting, self.running = [], {}
        self.peak = 0
        self.steps = 0
        self.queries = self.hits = 0

    def _blocks(self, prompt, max_tokens):
        n = self.cfg.max_model_len if self.cfg.kv_allocation == "contiguous" else len(prompt) + max_tokens
        return -(-n // self.bs)

    def add_request(self, rid, prompt, params):
        self.waiting.append((rid, prompt, params.max_tokens))
        self.queries += len(prompt)
        if self.cfg.enable_prefix_caching:
            self.hits += len(prompt) // 2

    def has_unfinished_requests(self):
        return bool(self.waiting or self.running)

    def _used(self):
        return sum(r["blocks"] for r in self.running.values())

    def step(self):
        self.steps += 1
        while self.waiting:
            rid, prompt, mt = self.waiting[0]
            need = self._blocks(prompt, mt)
            if self._used() + need > self.num_blocks:
                break
            self.waiting.pop(0)
            self.running[rid] = {"prompt": len(prompt), "out": [], "mt": mt, "blocks": need}
        self.peak = max(self.peak, len(self.running))
        outs = []
        for rid, r in list(self.running.items()):
            r["out"].append(1)
            done = len(r["out"]) >= r["mt"]
            outs.append(_Out(rid, list(r["out"]), done))
        self._last_stored = sum(r["prompt"] + len(r["out"]) for r in self.running.values())
        self._last_used = self._used()
        for o in outs:
            if o.finished:
                del self.running[o.request_id]
        return outs

    def stats(self):
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_blocks=self.num_blocks,
            num_free_blocks=self.num_blocks - self._used(),
            num_cached_blocks=0,
            block_size=self.bs,
            kv_usage=0.0,
            num_stored_tokens=sum(r["prompt"] + len(r["out"]) for r in self.running.values()),
            prefix_cache_queries=self.queries,
            prefix_cache_hits=self.hits,
            num_preemptions=0,
            prompt_tokens=0,
            generation_tokens=0,
            peak_running=self.peak,
            num_steps=self.steps,
        )


@pytest.fixture(autouse=True)
def no_collection_between_rows(monkeypatch):
    """The sweep collects garbage after each row to free the real engine's weights and cache; the fake engine holds
    neither, and in the whole suite's heap (every model the tests loaded) those collections were most of this
    file's time."""
    monkeypatch.setattr(sweep, "gc", types.SimpleNamespace(collect=lambda: 0))


class WordTok:
    vocab_size = 500
    special_ids = frozenset({0})

    def encode(self, text):
        return [int(w[1:]) for w in text.split()]

    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)


def test_run_engine_contiguous_vs_paged():
    from pagedllm.engine import EngineConfig

    prompts = [[1] * n for n in (30, 50, 20, 200, 40, 60)]
    res = {}
    for alloc in ("contiguous", "paged"):
        cfg = EngineConfig(
            block_size=16,
            max_model_len=256,
            kv_allocation=alloc,
            kv_cache_memory=2 * 256 * PER_TOKEN,
            enable_prefix_caching=False,
        )
        res[alloc] = sweep.run_engine(FakeEngine(cfg), prompts, 4, [0.0] * 6)
    c, p = res["contiguous"], res["paged"]
    assert c["peak_running"] == 2 and p["peak_running"] >= 4
    assert c["completed"] == p["completed"] == 6
    assert c["output_tokens"] == p["output_tokens"] == 24
    assert len(c["ttfts"]) == 6
    assert 0 < c["used_share"] < p["used_share"] <= 1
    assert c["kv_slots_allocated"] == pytest.approx(2 * 256, rel=0.3)
    assert c["prefix_cache_hit_rate"] == 0 and c["preemptions"] == 0


def fake_snapshot(engine):
    """The fake engine's running requests laid end to end, as the block-map pictures need them."""
    from pagedllm.bench.block_map_plot import lengths_snapshot

    lengths = [r["prompt"] + len(r["out"]) for r in engine.running.values()]
    return lengths_snapshot(lengths, engine.bs, engine.cfg.kv_allocation, engine.cfg.max_model_len)


def test_run_sweep_with_fake_engine(monkeypatch, tmp_path):
    import pagedllm.bench.tokenizer as bt
    import pagedllm.engine as eng

    monkeypatch.setattr(eng, "LLMEngine", FakeEngine)
    monkeypatch.setattr(engine_api, "take_snapshot", fake_snapshot)
    monkeypatch.setattr(sweep, "kv_bytes_per_token", lambda model, kv_cache_dtype, dtype="auto": PER_TOKEN)
    monkeypatch.setattr(bt, "load_bench_tokenizer", lambda path=None: WordTok())
    monkeypatch.setattr(sweep, "_row_model", lambda args, s: None)  # the window rows' own model: the fake's
    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    sweep.add_sweep_parser(sub)
    out = tmp_path / "s.json"
    args = p.parse_args(
        [
            "sweep",
            "--max-model-len",
            "256",
            "--num-prompts",
            "8",
            "--median-len",
            "40",
            "--output-len",
            "3",
            "--prefix-num-prompts",
            "6",
            "--prefix-len",
            "32",
            "--suffix-len",
            "8",
            "--prefix-output-len",
            "2",
            "--save-result",
            str(out),
            "--plot",
            str(tmp_path / "s.png"),
            "--no-reuse-weights",
            "--markdown",
        ]
    )
    assert args.func(args) == 0
    data = json.loads(out.read_text())
    rows = {r["setting"]: r for r in data["rows"]}
    assert list(rows) == [
        "contiguous b16",
        "paged b16",
        "paged b8",
        "paged b32",
        "paged b128",
        "prefix-rep, caching off",
        "prefix-rep, caching on",
        "paged b16, KV float32",
        "paged b16, KV bfloat16",
        "paged b16, KV int8",
        "paged b16, KV fp8",
        "prefix-rep, small pool",
        "prefix-rep, small pool + disk tier",
        "paged b16, full attention",
        "paged b16, sliding window 256",
    ]
    assert data["kv_budget_tokens"] == 4 * 256
    assert rows["contiguous b16"]["peak_running"] == 4 < rows["paged b16"]["peak_running"]
    assert rows["prefix-rep, caching on"]["prefix_cache_hit_rate"] > 0
    assert rows["prefix-rep, caching off"]["prefix_cache_hit_rate"] == 0
    assert (tmp_path / "s.png").stat().st_size > 10_000
    assert (tmp_path / "s_blocks.png").stat().st_size > 10_000  # the allocation rows' block maps at peak
    with pytest.raises(Exception, match="--rows"):
        sweep.run_sweep(p.parse_args(["sweep", "--rows", "nope"]))


def test_table_markdown():
    rows = [
        {
            "setting": "paged b16",
            "workload": "long-tail",
            "peak_running": 8,
            "kv_slots_allocated": 1000.0,
            "kv_tokens_stored": 900.0,
            "used_share": 0.9,
            "output_throughput": 12.5,
            "median_ttft_ms": 100.0,
            "p99_ttft_ms": 900.0,
            "prefix_cache_hit_rate": None,
            "preemptions": 0,
        }
    ]
    t = sweep.format_table(rows, markdown=True).splitlines()
    assert t[0].startswith("| setting | workload | peak running")
    assert t[2] == "| paged b16 | long-tail | 8 | 1,000 | 900 | 90.0% | 12.5 | 100 | 900 | - | 0 |"


def _sweep_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    sweep.add_sweep_parser(p.add_subparsers())
    return p


def test_sweep_flags_are_generated_from_the_engine_and_sweep_settings():
    from pagedllm.engine import EngineConfig

    sub = next(a for a in _sweep_parser()._actions if isinstance(a, argparse._SubParsersAction))
    actions = {a.dest: a for a in sub.choices["sweep"]._actions}
    engine = EngineConfig.__pydantic_fields__
    for name in sweep.ENGINE_FLAGS:  # the engine's own declaration: its help, default and choices
        assert actions[name].help == engine[name].description and actions[name].default == engine[name].default
    assert actions["dtype"].choices == ["auto", "float32", "bfloat16"]  # once a bare --dtype without choices
    assert actions["max_model_len"].default is None  # the model's, as everywhere (once 4096 here alone)
    for name, info in sweep.SweepConfig.__pydantic_fields__.items():
        assert actions[name].help == info.description and info.description, name
        assert actions[name].default == info.default, name


@pytest.mark.parametrize(
    "flags, flag", [(["--num-prompts", "0"], "--num-prompts"), (["--burstiness", "-1"], "--burstiness")]
)
def test_a_bad_sweep_value_is_a_user_error_naming_the_flag(flags, flag):
    from pagedllm.errors import UserError

    with pytest.raises(UserError, match=f"^{flag}: "):
        sweep.run_sweep(_sweep_parser().parse_args(["sweep", *flags]))


class DtypeFakeEngine(FakeEngine):
    """The fake engine whose blocks cost what the cache's dtype costs (float32 twice bfloat16, int8 half)."""

    configs: list = []

    def __init__(self, cfg, loaded=None):
        super().__init__(cfg, loaded)
        scale = {"auto": 1, "float32": 2, "bfloat16": 1, "int8": 0.5, "fp8": 0.5}[cfg.kv_cache_dtype]
        self.num_blocks = int(cfg.kv_cache_memory // (PER_TOKEN * scale * self.bs))
        DtypeFakeEngine.configs.append(self)


def _run_fake_sweep(monkeypatch, flags):
    import pagedllm.bench.tokenizer as bt
    import pagedllm.engine as eng

    DtypeFakeEngine.configs = []
    monkeypatch.setattr(eng, "LLMEngine", DtypeFakeEngine)
    monkeypatch.setattr(sweep, "kv_bytes_per_token", lambda model, kv_cache_dtype, dtype="auto": PER_TOKEN)
    monkeypatch.setattr(sweep, "model_max_len", lambda model: 1024)  # the model's context, --max-model-len unset
    monkeypatch.setattr(bt, "load_bench_tokenizer", lambda path=None: WordTok())
    args = _sweep_parser().parse_args(["sweep", "--no-reuse-weights", "--median-len", "40", *flags])
    assert args.func(args) == 0
    return DtypeFakeEngine.configs


def test_sweep_rows_never_make_the_engine_warn_about_a_max_model_len_nobody_set(monkeypatch, capsys):
    flags = ["--rows", "allocation,disk,dtype", "--prefix-len", "32", "--suffix-len", "8", "--prefix-output-len", "2"]
    engines = _run_fake_sweep(monkeypatch, flags)
    assert [e.cfg.max_model_len for e in engines if e.cfg.kv_allocation == "contiguous"] == [1024]  # the model's
    assert {e.cfg.kv_cache_dtype for e in engines} >= {"float32", "int8"}
    for e in engines:  # the engine warns when its cache holds fewer tokens than max-model-len
        assert e.num_blocks * e.bs >= e.cfg.max_model_len, e.cfg
    assert "max-model-len 1024" in capsys.readouterr().err


def test_sweep_dtype_rows_run_more_requests_at_once_with_a_narrower_cache(monkeypatch, tmp_path):
    _run_fake_sweep(monkeypatch, ["--rows", "dtype", "--save-result", str(tmp_path / "s.json")])
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    peak = {r["kv_cache_dtype"]: r["peak_running"] for r in rows}
    assert peak["float32"] < peak["bfloat16"] < peak["int8"] == peak["fp8"]


def test_kv_bytes_per_token_prices_the_cache_dtype():
    """The sweep's budget in bytes is the engine's count for the cache's dtype (kv/sizing), not the model's: the
    default model's 30 layers x 3 KV heads x 64 dims, K and V, at 4, 2 and 1 byte(s) a value (+ a 2-byte scale
    per head for int8 and fp8)."""
    assert sweep.kv_bytes_per_token(None, "auto", "float32") == sweep.kv_bytes_per_token(None, "float32") == 46_080
    assert sweep.kv_bytes_per_token(None, "bfloat16", "float32") == 23_040
    assert sweep.kv_bytes_per_token(None, "int8") == sweep.kv_bytes_per_token(None, "fp8_e5m2") == 30 * 3 * 2 * 66
