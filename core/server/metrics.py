"""Prometheus metrics with vLLM's names under a `deepinfer:` prefix.

The engine's figures come only from IterationStats (core/engine/stats.py), which reports each
token and each request in exactly one step, so nothing is counted twice. One observation of a
request histogram (time to first token, e2e latency, queue time) and one request_success count
stand for one API request, whatever its `n`: its first token of any sample, its end when every
sample is done. Inter-token latency has one observation per token after a sample's first.
`prompt_tokens` counts a request's whole prompt once, when its first token comes, cached tokens
included, as vLLM counts it; `prompt_tokens_cached` and `prompt_tokens_by_source` split it.

The server's own figure, `requests_rejected`, counts the answers with an error status by status.

Every figure is a slot of one MetricTallies array (metric_tallies.py): private to the process, or
shared by the API servers of `--api-server-count N`, which all add into it, so any one's /metrics
is the sum over all of them. Counters and histograms add; gauges hold the latest step's value.
The engine replicas of `--data-parallel-size N` tally apart, one array each, and each engine series
has one sample per replica under a `replica` label (a Prometheus `sum without (replica)` is the
server's total).

Each app has its own CollectorRegistry, so several servers (or tests) in one process never share
or collide on a metric. Histogram buckets are vLLM's. The exposition has no `_created` series
(vLLM turns them off too).
"""

from __future__ import annotations

import math
from bisect import bisect_left

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from deepinfer.core.engine.stats import IterationStats
from deepinfer.core.server.metric_tallies import MetricTallies

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
REJECTED_STATUSES = range(400, 600)  # the error statuses an answer can have

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
HISTOGRAMS = {  # name: (help, buckets)
    "time_to_first_token_seconds": ("Histogram of time to first token in seconds.", TTFT_BUCKETS),
    "inter_token_latency_seconds": ("Histogram of inter-token latency in seconds.", ITL_BUCKETS),
    "e2e_request_latency_seconds": ("Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS),
    "request_queue_time_seconds": ("Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS),
}
# generate_latest writes the classic text format 0.0.4 (every name here is a legacy name, so no
# escaping applies). prometheus-client 0.22+ labels its CONTENT_TYPE_LATEST "version=1.0.0", and its
# own HTTP handler still answers a scraper that does not ask for 1.0.0 with this header.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Layout:
    """Where each figure lives in the tallies: one index per gauge, counter and label value; per
    histogram the counts of its buckets (not cumulative; the last is +Inf), then its sum."""

    def __init__(self) -> None:
        self.size = 0
        self.gauges = {name: self._take(1) for name in GAUGES}
        self.counters = {name: self._take(1) for name in COUNTERS}
        self.prompt_tokens_by_source = {source: self._take(1) for source in PROMPT_TOKEN_SOURCES}
        self.request_success = {reason: self._take(1) for reason in FINISH_REASONS}
        self.rejected = self._take(len(REJECTED_STATUSES))
        self.histograms = {name: self._take(len(buckets) + 2) for name, (_, buckets) in HISTOGRAMS.items()}

    def _take(self, count: int) -> int:
        start, self.size = self.size, self.size + count
        return start


LAYOUT = _Layout()


def new_tallies(shared: bool = False) -> MetricTallies:
    """The tallies of one server (`shared`: of all the API servers spawned with it)."""
    return MetricTallies.shared(LAYOUT.size) if shared else MetricTallies(LAYOUT.size)


class _WithoutCreated:
    """A registry's collection minus the `_created` samples."""

    def __init__(self, registry: CollectorRegistry):
        self._registry = registry

    def collect(self):
        for family in self._registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class ServerMetrics:
    """The app's registry and tallies; the engine's metrics join them once the model is loaded."""

    def __init__(self, tallies: MetricTallies | None = None):
        self.tallies = tallies if tallies is not None else new_tallies()
        self.registry = CollectorRegistry()
        self.registry.register(self)
        self.engine: EngineMetrics | None = None

    def count_rejection(self, status: int) -> None:
        if status in REJECTED_STATUSES:
            with self.tallies.lock:
                self.tallies.values[LAYOUT.rejected + status - REJECTED_STATUSES.start] += 1

    def collect(self):
        """The statuses counted so far (prometheus_client's custom-collector protocol)."""
        family = CounterMetricFamily("deepinfer:requests_rejected",
                                     "HTTP requests answered with an error status (4xx or 5xx), by status.",
                                     labels=["status"])
        with self.tallies.lock:
            counts = self.tallies.array[LAYOUT.rejected:LAYOUT.rejected + len(REJECTED_STATUSES)].copy()
        for offset in np.flatnonzero(counts):
            family.add_metric([str(REJECTED_STATUSES.start + int(offset))], float(counts[offset]))
        yield family

    def render(self) -> bytes:
        return generate_latest(_WithoutCreated(self.registry))


FEW_OBSERVATIONS = 16  # up to this many a step are counted one by one; more at once with numpy


def _observe(tallies: MetricTallies, start: int, buckets: list[float], observed: list[float]) -> None:
    """Add `observed` to the histogram at `start`: the bucket of a value is the first bound >= it, as
    prometheus_client's."""
    if len(observed) <= FEW_OBSERVATIONS:
        values = tallies.values
        for value in observed:
            values[start + bisect_left(buckets, value)] += 1
    else:
        counts = np.bincount(np.searchsorted(buckets, observed, side="left"), minlength=len(buckets) + 1)
        tallies.array[start:start + len(buckets) + 1] += counts
    tallies.values[start + len(buckets) + 1] += sum(observed)


class EngineMetrics:
    """The engine's metrics, tallied from each step's IterationStats and exposed when scraped.

    Register with `engine.add_stats_listener(metrics.record)`. `record` runs once per engine step on
    the engine's (or its client's) thread, at hundreds of steps a second with a token of every running
    request each: it adds plain numbers into the tallies under their lock (a step's many inter-token
    latencies at once, with numpy), where prometheus_client's
    metric objects would take a lock and check their state for every increment and observation. The
    registry reads the tallies through `collect` on each scrape."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 tallies: MetricTallies | None = None, num_replicas: int | None = None):
        """`num_replicas`: the engine replicas of `serve --data-parallel-size N`; each tallies apart (private
        tallies; `tallies` is unused) and every series carries a `replica` label, "0" to "N-1"."""
        self.registry = registry if registry is not None else CollectorRegistry()
        if num_replicas is None:
            self.tallies_by_replica = [tallies if tallies is not None else new_tallies()]
        else:
            self.tallies_by_replica = [new_tallies() for _ in range(num_replicas)]
        self.tallies = self.tallies_by_replica[0]
        self._labelled = num_replicas is not None
        self._model_name = model_name
        self.registry.register(self)

    def record(self, stats: IterationStats, replica: int = 0) -> None:
        """One step's report of engine `replica` (thread-safe, and across the processes sharing the tallies)."""
        gauges, counters, histograms = LAYOUT.gauges, LAYOUT.counters, LAYOUT.histograms
        tallies = self.tallies_by_replica[replica]
        with tallies.lock:
            values = tallies.values
            values[gauges["num_requests_running"]] = stats.num_running
            values[gauges["num_requests_waiting"]] = stats.num_waiting
            values[gauges["kv_cache_usage_perc"]] = stats.kv_cache_usage
            values[counters["prefix_cache_queries"]] += stats.prefix_cache_queries
            values[counters["prefix_cache_hits"]] += stats.prefix_cache_hits
            values[counters["num_preemptions"]] += stats.num_preemptions
            values[counters["prompt_tokens"]] += stats.request_prompt_tokens
            values[counters["prompt_tokens_cached"]] += stats.request_cached_tokens
            values[counters["generation_tokens"]] += stats.num_generation_tokens
            by_source = LAYOUT.prompt_tokens_by_source
            values[by_source["local_compute"]] += stats.request_prompt_tokens - stats.request_cached_tokens
            values[by_source["local_cache_hit"]] += stats.request_cached_tokens
            if stats.time_to_first_tokens_s:
                _observe(tallies, histograms["time_to_first_token_seconds"], TTFT_BUCKETS,
                         stats.time_to_first_tokens_s)
            if stats.inter_token_latencies_s:
                _observe(tallies, histograms["inter_token_latency_seconds"], ITL_BUCKETS,
                         stats.inter_token_latencies_s)
            if stats.finished_requests:
                for finished in stats.finished_requests:
                    values[LAYOUT.request_success[finished.finish_reason]] += 1
                _observe(tallies, histograms["e2e_request_latency_seconds"], REQUEST_LATENCY_BUCKETS,
                         [f.e2e_latency_s for f in stats.finished_requests])
                queue_times = [f.queue_time_s for f in stats.finished_requests if f.queue_time_s is not None]
                if queue_times:
                    _observe(tallies, histograms["request_queue_time_seconds"], REQUEST_LATENCY_BUCKETS, queue_times)

    def collect(self):
        """The metric families now (prometheus_client's custom-collector protocol): one sample per replica."""
        snapshots = []
        for tallies in self.tallies_by_replica:
            with tallies.lock:
                snapshots.append(tallies.array.copy())
        extra = ["replica"] if self._labelled else []
        replicas = [[self._model_name, str(index)] if self._labelled else [self._model_name]
                    for index in range(len(snapshots))]
        for name, index in LAYOUT.gauges.items():
            family = GaugeMetricFamily(f"deepinfer:{name}", GAUGES[name], labels=["model_name", *extra])
            for labels, values in zip(replicas, snapshots):
                family.add_metric(labels, float(values[index]))
            yield family
        for name, index in LAYOUT.counters.items():
            family = CounterMetricFamily(f"deepinfer:{name}", COUNTERS[name], labels=["model_name", *extra])
            for labels, values in zip(replicas, snapshots):
                family.add_metric(labels, float(values[index]))
            yield family
        for name, doc, label, slots in (
                ("prompt_tokens_by_source", "Number of prompt tokens by source.", "source",
                 LAYOUT.prompt_tokens_by_source),
                ("request_success", "Count of finished requests by finish reason.", "finished_reason",
                 LAYOUT.request_success)):
            family = CounterMetricFamily(f"deepinfer:{name}", doc, labels=["model_name", *extra, label])
            for labels, values in zip(replicas, snapshots):
                for value, index in slots.items():
                    family.add_metric([*labels, value], float(values[index]))
            yield family
        for name, (doc, buckets) in HISTOGRAMS.items():
            start = LAYOUT.histograms[name]
            family = HistogramMetricFamily(f"deepinfer:{name}", doc, labels=["model_name", *extra])
            for labels, values in zip(replicas, snapshots):
                cumulative = np.cumsum(values[start:start + len(buckets) + 1])
                family.add_metric(labels, [(floatToGoString(bound), float(count)) for bound, count in
                                           zip([*buckets, math.inf], cumulative)],
                                  float(values[start + len(buckets) + 1]))
            yield family

    def render(self) -> bytes:
        return generate_latest(_WithoutCreated(self.registry))
