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

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from deepinfer.core.engine.stats import IterationStats

FINISH_REASONS = ("stop", "length", "abort", "error")

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
CONTENT_TYPE = CONTENT_TYPE_LATEST  # "text/plain; version=0.0.4; charset=utf-8"


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


class EngineMetrics:
    """Register with `engine.add_stats_listener(metrics.record)`."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"deepinfer:{name}", doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"deepinfer:{name}", doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(f"deepinfer:{name}", doc, labels, buckets=buckets, registry=self.registry).labels(
                model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests holding KV blocks (in the batch).")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_queries = counter("prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.num_preemptions = counter("num_preemptions", "Cumulative number of preemptions from the engine.")
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed (cached ones included).")
        self.prompt_tokens_cached = counter("prompt_tokens_cached", "Number of cached prompt tokens (prefix cache).")
        by_source = Counter("deepinfer:prompt_tokens_by_source", "Number of prompt tokens by source.",
                            labels + ["source"], registry=self.registry)
        self.prompt_tokens_computed = by_source.labels(model_name, "local_compute")
        self.prompt_tokens_cache_hit = by_source.labels(model_name, "local_cache_hit")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self._model_name = model_name
        self.request_success = Counter("deepinfer:request_success", "Count of finished requests by finish reason.",
                                       labels + ["finished_reason"], registry=self.registry)
        for reason in FINISH_REASONS:  # exported at 0 from the start, so rates work before the first finish
            self.request_success.labels(model_name, reason)
        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds",
                                             "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = histogram("request_queue_time_seconds",
                                            "Histogram of time spent in WAITING phase for request.",
                                            REQUEST_LATENCY_BUCKETS)

    def record(self, stats: IterationStats) -> None:
        """One engine step's report; called from the engine thread (prometheus_client is thread-safe)."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        self.prefix_cache_queries.inc(stats.prefix_cache_queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits)
        self.num_preemptions.inc(stats.num_preemptions)
        self.prompt_tokens.inc(stats.request_prompt_tokens)
        self.prompt_tokens_cached.inc(stats.request_cached_tokens)
        self.prompt_tokens_computed.inc(stats.request_prompt_tokens - stats.request_cached_tokens)
        self.prompt_tokens_cache_hit.inc(stats.request_cached_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        for ttft in stats.time_to_first_tokens_s:
            self.time_to_first_token.observe(ttft)
        for itl in stats.inter_token_latencies_s:
            self.inter_token_latency.observe(itl)
        for finished in stats.finished_requests:
            self.request_success.labels(self._model_name, finished.finish_reason).inc()
            self.e2e_request_latency.observe(finished.e2e_latency_s)
            if finished.queue_time_s is not None:
                self.request_queue_time.observe(finished.queue_time_s)

    def render(self) -> bytes:
        return generate_latest(_WithoutCreated(self.registry))
