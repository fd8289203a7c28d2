"""IterationStats: what one engine step reports, for Prometheus metrics and benchmarks.

The engine loop builds one per step and hands it to every registered listener (the server's
metrics module is one). Each token and each request is counted in exactly one step, so no consumer
can count a token twice (once per step and again at finish).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FinishedRequestStats:
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency_s: float  # arrival -> finish
    ttft_s: float | None  # arrival -> first output token (None if it never produced one)
    queue_time_s: float | None = None  # arrival -> first scheduled


@dataclass
class IterationStats:
    num_running: int = 0  # requests holding KV blocks after this step
    num_waiting: int = 0  # requests in the waiting queue after this step
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use by requests, 0..1
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache this step
    prefix_cache_hits: int = 0  # of those, tokens found in the cache
    num_preemptions: int = 0  # requests preempted this step
    num_prompt_tokens: int = 0  # prompt tokens computed (not cached) this step
    num_generation_tokens: int = 0  # output tokens sampled this step
    # The requests whose first token came this step (one per request, whatever its n), as vLLM counts them:
    request_prompt_tokens: int = 0  # their prompt tokens, cached ones included
    request_cached_tokens: int = 0  # of those, the tokens the prefix cache served (to the first sample)
    time_to_first_tokens_s: list[float] = field(default_factory=list)  # one per request whose first token came
    inter_token_latencies_s: list[float] = field(default_factory=list)  # one per non-first output token
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
