"""Prometheus metrics with vLLM's names, in a private registry per app (so tests can build several apps).

Gauges and the engine's own cumulative counters (prefix-cache queries / hits, preemptions) are read from the
engine's latest stats at scrape time; token counters and latency histograms are fed from the engine thread by
`ServerMetrics.record_step` (the AsyncLLMEngine's stat logger).
"""
from __future__ import annotations

import threading
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]


def stat(stats: Any, *names: str, default: float = 0.0) -> float:
    """The first of `names` that the stats object (a dataclass or a dict) has."""
    if stats is None:
        return default
    for name in names:
        value = stats.get(name) if isinstance(stats, dict) else getattr(stats, name, None)
        if value is not None:
            return value
    return default


def kv_usage(stats: Any) -> float:
    usage = stat(stats, "kv_usage", "kv_cache_usage", "kv_cache_usage_perc", default=-1.0)
    if usage >= 0:
        return float(usage)
    total = stat(stats, "num_total_blocks", "total_blocks", "num_blocks")
    free = stat(stats, "num_free_blocks", "free_blocks")
    return float((total - free) / total) if total else 0.0


class _EngineCollector:
    def __init__(self, get_stats: Any, model_name: str) -> None:
        self.get_stats = get_stats
        self.model_name = model_name

    def collect(self):  # noqa: ANN201 - prometheus_client's protocol
        st = self.get_stats()
        labels = ["model_name"]
        value = [self.model_name]

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(value, float(v))
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(value, float(v))
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    stat(st, "num_running", "num_requests_running"))
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    stat(st, "num_waiting", "num_requests_waiting"))
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_usage(st))
        yield counter("vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.",
                      stat(st, "prefix_cache_queries", "num_prefix_cache_queries"))
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      stat(st, "prefix_cache_hits", "num_prefix_cache_hits"))
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      stat(st, "num_preemptions", "preemptions"))
        yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
                      stat(st, "spec_decode_num_drafts"))
        yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                      stat(st, "spec_decode_num_draft_tokens"))
        yield counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                      stat(st, "spec_decode_num_accepted_tokens"))
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.", labels=labels + ["position"])
        for pos, n in enumerate(stat(st, "spec_decode_num_accepted_tokens_per_pos", default=[])):
            per_pos.add_metric(value + [str(pos)], float(n))
        yield per_pos


# As vLLM: no "<counter>_created" series (they double the page and no dashboard uses them).
prometheus_client.disable_created_metrics()


class ServerMetrics:
    """The app's registry and the AsyncLLMEngine stat logger that feeds it (called on the engine thread)."""

    def __init__(self, model_name: str, get_stats: Any) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         labels, registry=r).labels(model_name)
        self.request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                       labels + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             labels, buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self.prompt_tokens_hist = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                            labels, buckets=[1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000,
                                                             10000], registry=r).labels(model_name)
        self.generation_tokens_hist = Histogram("vllm:request_generation_tokens",
                                                "Number of generation tokens processed.", labels,
                                                buckets=[1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000,
                                                         10000], registry=r).labels(model_name)
        r.register(_EngineCollector(get_stats, model_name))
        self._lock = threading.Lock()
        # request_id -> [tokens seen, time of last new token, prompt counted]
        self._seen: dict[str, list] = {}

    # ---- AsyncLLMEngine stat-logger protocol (engine thread)
    def record_step(self, outputs: list[Any], now: float) -> None:
        with self._lock:
            for out in outputs:
                rid = out.request_id
                state = self._seen.get(rid)
                ntok = sum(len(c.token_ids) for c in out.outputs)
                if state is None:
                    state = self._seen[rid] = [0, None, False]
                new = ntok - state[0]
                metrics = getattr(out, "metrics", None)
                arrival = getattr(metrics, "arrival_time", None)
                if new > 0:
                    self.generation_tokens.inc(new)
                    if not state[2]:
                        state[2] = True
                        n_prompt = len(out.prompt_token_ids or [])
                        self.prompt_tokens.inc(n_prompt)
                        self.prompt_tokens_hist.observe(n_prompt)
                        first = getattr(metrics, "first_token_time", None) or now
                        if arrival is not None:
                            self.ttft.observe(max(0.0, first - arrival))
                    elif state[1] is not None:
                        self.itl.observe(max(0.0, now - state[1]))
                    state[0] = ntok
                    state[1] = now
                if out.finished:
                    self._seen.pop(rid, None)
                    finished = getattr(metrics, "finished_time", None) or now
                    if arrival is not None:
                        self.e2e.observe(max(0.0, finished - arrival))
                    self.generation_tokens_hist.observe(ntok)
                    reason = next((c.finish_reason for c in out.outputs if c.finish_reason), None) or "stop"
                    self.request_success.labels(self.model_name, reason).inc()

    def record_abort(self, request_id: str) -> None:
        with self._lock:
            self._seen.pop(request_id, None)
        self.request_success.labels(self.model_name, "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
