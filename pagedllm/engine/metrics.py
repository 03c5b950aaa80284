"""Prometheus metrics with vLLM's names: the async engine's stat logger (as vLLM's v1/metrics/loggers.py) and the
page the server's /metrics sends.

Gauges and the engine's own cumulative counters (prefix-cache queries / hits, preemptions) are read from the
engine's latest stats at scrape time; token counters and latency histograms are fed from the engine thread by
`PrometheusStatLogger.record_step`, which every `AsyncLLMEngine` has.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.stats import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
ITL_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]
E2E_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]


def _engine_families(st: EngineStats) -> list[Metric]:
    """The engine's gauges and its own cumulative counters, from one stats snapshot (read at scrape time)."""
    g, c = GaugeMetricFamily, CounterMetricFamily
    per_pos = c(
        "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.", labels=["position"]
    )
    for pos, n in enumerate(st.spec_decode_num_accepted_tokens_per_pos):
        per_pos.add_metric([str(pos)], float(n))
    return [
        g("vllm:num_requests_running", "Number of requests in model execution batches.", st.num_running),
        g("vllm:num_requests_waiting", "Number of requests waiting to be processed.", st.num_waiting),
        g("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", st.kv_usage),
        c(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            st.prefix_cache_queries,
        ),
        c("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", st.prefix_cache_hits),
        c(
            "pagedllm:prefix_cache_disk_hits",
            "Prefix cache hits read back from the disk tier "
            "(--kv-offload-dir), in tokens; part of vllm:prefix_cache_hits.",
            st.prefix_cache_disk_hits,
        ),
        c("vllm:num_preemptions", "Cumulative number of preemption from the engine.", st.num_preemptions),
        c(
            "pagedllm:moe_expert_tokens",
            "Tokens routed to experts of a mixture-of-experts model (once per expert per sparse layer).",
            st.moe_expert_tokens,
        ),
        c(
            "pagedllm:moe_expert_reads",
            "Expert weights read by a mixture-of-experts model: once per expert a step used, per sparse layer.",
            st.moe_expert_reads,
        ),
        c("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", st.spec_decode_num_drafts),
        c("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", st.spec_decode_num_draft_tokens),
        c("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", st.spec_decode_num_accepted_tokens),
        per_pos,
    ]


class Families(Collector):
    """Already collected families, for prometheus_client's writer (this page, and the cluster's merged one)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def write_page(families: list[Metric]) -> bytes:
    """One Prometheus text page of these families."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families(families))
    return generate_latest(registry)


# As vLLM: no "<counter>_created" series (they double the page and no dashboard uses them).
prometheus_client.disable_created_metrics()


@dataclass
class _Progress:
    tokens: int = 0  # generated tokens seen so far, all samples
    last_token_time: float | None = None


class PrometheusStatLogger:
    """The async engine's stat logger (vLLM's v1/metrics/loggers.py), called on the engine thread after every step
    and abort: token counters and latency histograms in a registry of its own (so tests can build several
    engines). `render` writes the Prometheus page with the engine's gauges read from a stats snapshot; the
    `model_name` label is the served name, which the server knows and the engine does not."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", registry=r)
        self.request_success = Counter(
            "vllm:request_success", "Count of successfully processed requests.", ["finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.prompt_tokens_hist = Histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", buckets=TOKEN_BUCKETS, registry=r
        )
        self.generation_tokens_hist = Histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self._lock = threading.Lock()
        self._seen: dict[str, _Progress] = {}  # requests in flight

    # ---- the AsyncLLMEngine's StatLogger (engine thread)
    def record_step(self, outputs: list[RequestOutput], now: float) -> None:
        """Each request's prompt counts once, at its first output (a preempted request's recompute and a
        max_tokens 0 scoring request alike); tokens count as they first appear."""
        with self._lock:
            for out in outputs:
                self._record(out, now)

    def _record(self, out: RequestOutput, now: float) -> None:
        arrival = out.metrics.arrival_time
        state = self._seen.get(out.request_id)
        if state is None:
            state = self._seen[out.request_id] = _Progress()
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            self.prompt_tokens_hist.observe(len(out.prompt_token_ids))
        ntok = sum(len(c.token_ids) for c in out.outputs)
        if ntok > state.tokens:
            self.generation_tokens.inc(ntok - state.tokens)
            if state.last_token_time is None:
                self.ttft.observe(max(0.0, (out.metrics.first_token_time or now) - arrival))
            else:
                self.itl.observe(max(0.0, now - state.last_token_time))
            state.tokens, state.last_token_time = ntok, now
        if out.finished:
            del self._seen[out.request_id]
            self.e2e.observe(max(0.0, (out.metrics.finished_time or now) - arrival))
            self.generation_tokens_hist.observe(ntok)
            reason = next((c.finish_reason for c in out.outputs if c.finish_reason), None) or "stop"
            self.request_success.labels(reason).inc()

    def record_abort(self, request_id: str) -> None:
        with self._lock:
            self._seen.pop(request_id, None)
        self.request_success.labels("abort").inc()

    def render(self, stats: EngineStats, model_name: str) -> bytes:
        """The page: every sample labelled `model_name`, the engine's gauges and counters from `stats` last."""
        families = [*self.registry.collect(), *_engine_families(stats)]
        for family in families:
            family.samples = [s._replace(labels={"model_name": model_name, **s.labels}) for s in family.samples]
        return write_page(families)
