"""Every bench metric against hand-computed values on synthetic timings (no server, no model)."""

import math

import numpy as np
import pytest

from pagedllm.bench.arrivals import arrival_times
from pagedllm.bench.serve_metrics import (
    RequestResult,
    compute_metrics,
    parse_goodput,
    parse_percentiles,
    parse_prefix_cache_counters,
    per_second,
    prefix_cache_delta,
)
from pagedllm.errors import UserError


def _results():
    return [
        # 4 tokens: TTFT 100 ms, gaps 20/30/50 ms, E2E 200 ms -> TPOT (200-100)/3 ms
        RequestResult(True, "", 10, start_time=0.0, ttft=0.1, latency=0.2, itl=[0.02, 0.03, 0.05], output_tokens=4),
        # no usage: counted from the text (2 tokens); the server's prompt count (21) wins over the dataset's (20)
        RequestResult(
            True, "", 20, start_time=0.5, ttft=0.3, latency=0.4, itl=[0.1], generated_text="a b", prompt_tokens=21
        ),
        RequestResult(False, "HTTP 500: boom", 30, start_time=0.6),
        # one token: no TPOT sample, TPOT 0 for goodput
        RequestResult(True, "", 40, start_time=1.0, ttft=0.2, latency=0.2, itl=[], output_tokens=1),
    ]


def _m(**kw):
    return compute_metrics(_results(), 2.0, count_tokens=lambda t: len(t.split()), **kw)


def test_counts_and_throughput():
    m = _m()
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 10 + 21 + 40
    assert m["total_output_tokens"] == 4 + 2 + 1
    assert m["output_lens"] == [4, 2, 0, 1]
    assert m["input_lens"] == [10, 21, 30, 40]
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(3.5)
    assert m["total_token_throughput"] == pytest.approx(78 / 2)
    assert m["errors"] == ["", "", "HTTP 500: boom", ""]
    assert m["request_goodput"] is None


def test_ttft():
    m = _m()
    assert m["mean_ttft_ms"] == pytest.approx(200)
    assert m["median_ttft_ms"] == pytest.approx(200)
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt((100**2 + 100**2) / 3))
    assert m["p50_ttft_ms"] == pytest.approx(200)
    assert m["p90_ttft_ms"] == pytest.approx(280)  # sorted 100,200,300: rank 0.9*2 = 1.8
    assert m["p99_ttft_ms"] == pytest.approx(298)


def test_tpot():
    m = _m()
    # (200 - 100) / (4 - 1) and (400 - 300) / (2 - 1); the one-token request has none
    assert m["mean_tpot_ms"] == pytest.approx((100 / 3 + 100) / 2)
    assert m["median_tpot_ms"] == pytest.approx((100 / 3 + 100) / 2)
    assert m["p99_tpot_ms"] == pytest.approx(100 / 3 + 0.99 * (100 - 100 / 3))


def test_itl():
    m = _m()
    assert m["mean_itl_ms"] == pytest.approx(50)  # 20, 30, 50, 100
    assert m["median_itl_ms"] == pytest.approx(40)
    assert m["std_itl_ms"] == pytest.approx(math.sqrt((30**2 + 20**2 + 0 + 50**2) / 4))
    assert m["p99_itl_ms"] == pytest.approx(50 + 0.97 * 50)
    assert m["itls"][0] == [0.02, 0.03, 0.05]


def test_e2el():
    m = _m()
    assert m["mean_e2el_ms"] == pytest.approx(800 / 3)
    assert m["median_e2el_ms"] == pytest.approx(200)
    assert m["p90_e2el_ms"] == pytest.approx(200 + 0.8 * 200)


def test_custom_percentiles():
    m = _m(percentiles=parse_percentiles("25,99.9"))
    assert m["p25_ttft_ms"] == pytest.approx(150)
    assert m["p99.9_ttft_ms"] == pytest.approx(299.8)
    assert "p50_ttft_ms" not in m
    with pytest.raises(UserError):
        parse_percentiles("50,101")
    with pytest.raises(UserError):
        parse_percentiles("x")


def test_goodput():
    assert parse_goodput(["ttft:250", "tpot:50"]) == {"ttft": 250.0, "tpot": 50.0}
    assert parse_goodput(["ttft:250 e2el:1000"]) == {"ttft": 250.0, "e2el": 1000.0}
    # TTFTs 100, 300, 200 -> two meet 250 ms
    assert _m(goodput={"ttft": 250})["request_goodput"] == pytest.approx(2 / 2.0)
    # TPOTs 33.3, 100, 0 (one token) -> two meet 50 ms
    assert _m(goodput={"tpot": 50})["request_goodput"] == pytest.approx(1.0)
    # both: 1st (100, 33) and 4th (200, 0) -> 2
    assert _m(goodput={"ttft": 250, "tpot": 50})["request_goodput"] == pytest.approx(1.0)
    assert _m(goodput={"ttft": 250, "tpot": 30})["request_goodput"] == pytest.approx(0.5)
    assert _m(goodput={"e2el": 150})["request_goodput"] == 0.0
    assert _m(goodput={"e2el": 200})["request_goodput"] == pytest.approx(1.0)  # <= is good
    for bad in (["ttft"], ["foo:1"], ["ttft:-1"], ["ttft:abc"]):
        with pytest.raises(UserError):
            parse_goodput(bad)


def test_peak_output_throughput():
    # chunk times: 0.1, 0.12, 0.15, 0.2 | 0.8, 0.9 | 1.2 -> buckets [6, 1, 0]
    tokens, running = per_second(_results())
    assert tokens.tolist() == [6, 1, 0]
    assert running.tolist() == [2, 1, 0]
    m = _m()
    assert m["max_output_tokens_per_s"] == 6
    assert m["max_concurrent_requests"] == 2


def test_peak_spread_over_seconds():
    rs = [RequestResult(True, "", 1, start_time=10.0, ttft=0.5, latency=3.4, itl=[0.7, 0.7, 0.7, 0.8], output_tokens=5)]
    tokens, running = per_second(rs)  # chunks at 0.5, 1.2, 1.9, 2.6, 3.4
    assert tokens.tolist() == [1, 2, 1, 1, 0]
    assert running.tolist() == [1, 1, 1, 1, 0]


def test_no_success():
    m = compute_metrics([RequestResult(False, "x", 5)], 1.0)
    assert m["completed"] == 0 and m["failed"] == 1 and m["total_output_tokens"] == 0
    assert m["mean_ttft_ms"] == 0 and m["max_output_tokens_per_s"] == 0


def test_arrivals_inf_and_validation():
    assert arrival_times(5, float("inf")).tolist() == [0.0] * 5
    for rate, b in ((0, 1), (-1, 1), (1, 0)):
        with pytest.raises(UserError):
            arrival_times(3, rate, b)


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrivals_gamma_statistics(burstiness):
    rate = 5.0
    t = arrival_times(20001, rate, burstiness, seed=0)
    assert t[0] == 0 and np.all(np.diff(t) >= 0)
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)  # mean gap 1 / rate whatever the burstiness
    cv = gaps.std() / gaps.mean()
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)  # CV of a gamma = 1 / sqrt(shape)
    np.testing.assert_array_equal(t, arrival_times(20001, rate, burstiness, seed=0))  # reproducible
    assert not np.array_equal(t, arrival_times(20001, rate, burstiness, seed=1))


def test_poisson_counts_per_window():
    # a Poisson process: counts per 1 s window have variance == mean == rate
    t = arrival_times(40001, 8.0, 1.0, seed=0)
    counts = np.bincount(t.astype(int))[:-1]
    assert counts.mean() == pytest.approx(8.0, rel=0.03)
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.1)


def test_arrivals_pinned_seed():
    # seed 0, rate 2, Poisson: first gaps are numpy's exponential draws scaled by 1/2
    t = arrival_times(4, 2.0, 1.0, seed=0)
    expect = np.concatenate([[0], np.cumsum(np.random.default_rng(0).gamma(1.0, 0.5, size=3))])
    np.testing.assert_allclose(t, expect)


METRICS_TEXT = """# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 500.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 250.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 50
vllm:num_requests_running{engine="0"} 3
"""


def test_prefix_cache_counters():
    before = parse_prefix_cache_counters(METRICS_TEXT)
    assert before == {"queries": 1500.0, "hits": 300.0}
    after = parse_prefix_cache_counters(METRICS_TEXT.replace("1000.0", "3000.0").replace("250.0", "1450.0"))
    d = prefix_cache_delta(before, after)
    assert d == {"prefix_cache_queries": 2000.0, "prefix_cache_hits": 1200.0, "prefix_cache_hit_rate": 0.6}
    # no _total suffix, another namespace
    assert parse_prefix_cache_counters("pagedllm:prefix_cache_queries 10\npagedllm:prefix_cache_hits 4\n") == {
        "queries": 10.0,
        "hits": 4.0,
    }
    assert parse_prefix_cache_counters("vllm:num_requests_running 1\n") is None
    assert parse_prefix_cache_counters("") is None
    assert prefix_cache_delta(None, after) is None
    assert prefix_cache_delta(before, before)["prefix_cache_hit_rate"] is None


def test_multi_token_chunks_count_as_vllm_counts_them():
    """Speculative decoding streams several tokens per chunk. As in vLLM's bench serve, ITL is one gap per chunk
    (so it exceeds TPOT), TPOT divides by the server's token count, and peak tokens/s counts chunks."""
    r = RequestResult(True, "", 10, start_time=0.0, ttft=0.1, latency=0.4, itl=[0.15, 0.15], output_tokens=9)
    m = compute_metrics([r], 1.0, percentiles=[50])
    assert m["mean_itl_ms"] == pytest.approx(150.0)
    assert m["mean_tpot_ms"] == pytest.approx((0.4 - 0.1) / 8 * 1000)
    assert m["output_throughput"] == pytest.approx(9.0) and m["max_output_tokens_per_s"] == 3.0
