"""Prometheus metrics with vLLM's names under a `deepinfer:` prefix.

The engine's figures come only from IterationStats (core/engine/stats.py), which reports each
token and each request in exactly one step, so nothing is counted twice. One observation of a
request histogram (time to first token, e2e latency, queue time) and one request_success count
stand for one API request, whatever its `n`: its first token of any sample, its end when every
sample is done. Inter-token latency has one observation per token after a sample's first.
`prompt_tokens` counts a request's whole prompt once, when its first token comes, cached tokens
included, as vLLM counts it; `prompt_tokens_cached` and `prompt_tokens_by_source` split it.

The server's own figure, `requests_rejected`, counts the answers with an error status by status.

Each app has its own CollectorRegistry, so several servers (or tests) in one process never share
or collide on a metric. Histogram buckets are vLLM's. The exposition leaves out the `_created`
series prometheus_client adds to counters and histograms (vLLM turns them off too).
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from itertools import accumulate

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from deepinfer.core.engine.stats import IterationStats

FINISH_REASONS = ("stop", "length", "abort", "error")
GAUGES = {  # name: help
    "num_requests_running": "Requests holding KV blocks (in the batch).",
    "num_requests_waiting": "Requests waiting to be scheduled.",
    "kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
}
COUNTERS = {
    "prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "num_preemptions": "Cumulative number of preemptions from the engine.",
    "prompt_tokens": "Number of prefill tokens processed (cached ones included).",
    "prompt_tokens_cached": "Number of cached prompt tokens (prefix cache).",
    "generation_tokens": "Number of generation tokens processed.",
}
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit")

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
# generate_latest writes the classic text format 0.0.4 (every name here is a legacy name, so no
# escaping applies). prometheus-client 0.22+ labels its CONTENT_TYPE_LATEST "version=1.0.0", and its
# own HTTP handler still answers a scraper that does not ask for 1.0.0 with this header.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _WithoutCreated:
    """A registry's collection minus the `_created` samples."""

    def __init__(self, registry: CollectorRegistry):
        self._registry = registry

    def collect(self):
        for family in self._registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class ServerMetrics:
    """The app's registry; the engine's metrics join it once the model is loaded."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests_rejected = Counter("deepinfer:requests_rejected",
                                         "HTTP requests answered with an error status (4xx or 5xx), by status.",
                                         ["status"], registry=self.registry)
        self.engine: EngineMetrics | None = None

    def count_rejection(self, status: int) -> None:
        self.requests_rejected.labels(str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(_WithoutCreated(self.registry))


class _Histogram:
    """A histogram's tallies: the count of each bucket (not cumulative; the last is +Inf), the sum."""

    def __init__(self, name: str, doc: str, buckets: list[float]):
        self.name, self.doc, self.bounds = name, doc, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, values: list[float]) -> None:
        counts, bounds = self.counts, self.bounds
        for value in values:  # the bucket of a value is the first bound >= it, as prometheus_client's
            counts[bisect_left(bounds, value)] += 1
        self.sum += sum(values)

    def family(self, model_name: str) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        cumulative = list(accumulate(self.counts))
        family.add_metric([model_name], [(floatToGoString(bound), count) for bound, count in
                                         zip([*self.bounds, math.inf], cumulative)], self.sum)
        return family


class EngineMetrics:
    """The engine's metrics, tallied from each step's IterationStats and exposed when scraped.

    Register with `engine.add_stats_listener(metrics.record)`. `record` runs once per engine step on
    the engine's (or its client's) thread, at hundreds of steps a second with a token of every running
    request each: it adds plain numbers under one lock (a bisect per token for inter-token latency),
    where prometheus_client's metric objects would take a lock and check their state for every
    increment and observation. The registry reads the tallies through `collect` on each scrape."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self._model_name = model_name
        self._lock = threading.Lock()  # record (the engine's thread) against collect (a scrape)
        self._gauges = dict.fromkeys(GAUGES, 0.0)
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._prompt_tokens_by_source = dict.fromkeys(PROMPT_TOKEN_SOURCES, 0)
        self._request_success = dict.fromkeys(FINISH_REASONS, 0)  # exported at 0, so rates work before a finish
        self._time_to_first_token = _Histogram("deepinfer:time_to_first_token_seconds",
                                               "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self._inter_token_latency = _Histogram("deepinfer:inter_token_latency_seconds",
                                               "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self._e2e_request_latency = _Histogram("deepinfer:e2e_request_latency_seconds",
                                               "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self._request_queue_time = _Histogram("deepinfer:request_queue_time_seconds",
                                              "Histogram of time spent in WAITING phase for request.",
                                              REQUEST_LATENCY_BUCKETS)
        self.registry.register(self)

    def record(self, stats: IterationStats) -> None:
        """One engine step's report (thread-safe)."""
        with self._lock:
            gauges, counters = self._gauges, self._counters
            gauges["num_requests_running"] = stats.num_running
            gauges["num_requests_waiting"] = stats.num_waiting
            gauges["kv_cache_usage_perc"] = stats.kv_cache_usage
            counters["prefix_cache_queries"] += stats.prefix_cache_queries
            counters["prefix_cache_hits"] += stats.prefix_cache_hits
            counters["num_preemptions"] += stats.num_preemptions
            counters["prompt_tokens"] += stats.request_prompt_tokens
            counters["prompt_tokens_cached"] += stats.request_cached_tokens
            counters["generation_tokens"] += stats.num_generation_tokens
            self._prompt_tokens_by_source["local_compute"] += stats.request_prompt_tokens - stats.request_cached_tokens
            self._prompt_tokens_by_source["local_cache_hit"] += stats.request_cached_tokens
            if stats.time_to_first_tokens_s:
                self._time_to_first_token.observe(stats.time_to_first_tokens_s)
            if stats.inter_token_latencies_s:
                self._inter_token_latency.observe(stats.inter_token_latencies_s)
            for finished in stats.finished_requests:
                reason = finished.finish_reason
                self._request_success[reason] = self._request_success.get(reason, 0) + 1
                self._e2e_request_latency.observe([finished.e2e_latency_s])
                if finished.queue_time_s is not None:
                    self._request_queue_time.observe([finished.queue_time_s])

    def collect(self):
        """The metric families now (prometheus_client's custom-collector protocol)."""
        model = [self._model_name]
        with self._lock:
            for name, value in self._gauges.items():
                family = GaugeMetricFamily(f"deepinfer:{name}", GAUGES[name], labels=["model_name"])
                family.add_metric(model, value)
                yield family
            for name, value in self._counters.items():
                family = CounterMetricFamily(f"deepinfer:{name}", COUNTERS[name], labels=["model_name"])
                family.add_metric(model, value)
                yield family
            by_source = CounterMetricFamily("deepinfer:prompt_tokens_by_source", "Number of prompt tokens by source.",
                                            labels=["model_name", "source"])
            for source, value in self._prompt_tokens_by_source.items():
                by_source.add_metric([self._model_name, source], value)
            yield by_source
            success = CounterMetricFamily("deepinfer:request_success", "Count of finished requests by finish reason.",
                                          labels=["model_name", "finished_reason"])
            for reason, value in self._request_success.items():
                success.add_metric([self._model_name, reason], value)
            yield success
            for histogram in (self._time_to_first_token, self._inter_token_latency, self._e2e_request_latency,
                              self._request_queue_time):
                yield histogram.family(self._model_name)

    def render(self) -> bytes:
        return generate_latest(_WithoutCreated(self.registry))
