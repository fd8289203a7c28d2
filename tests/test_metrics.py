"""Prometheus metrics: names, labels and buckets as vLLM's, fed only by IterationStats, counted once.

The unit tests feed hand-made IterationStats and compare with hand-computed totals; the server
test runs real requests and checks the counters against what the clients received.
"""

from __future__ import annotations

import math

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import ServerThread

from deepinfer.core.config import EngineConfig
from deepinfer.core.engine.stats import FinishedRequestStats, IterationStats
from deepinfer.core.server.config import ServerConfig
from deepinfer.core.server.metrics import TTFT_BUCKETS, EngineMetrics

REQUIRED = [
    ("deepinfer:num_requests_running", "gauge"),
    ("deepinfer:num_requests_waiting", "gauge"),
    ("deepinfer:kv_cache_usage_perc", "gauge"),
    ("deepinfer:prefix_cache_queries", "counter"),
    ("deepinfer:prefix_cache_hits", "counter"),
    ("deepinfer:num_preemptions", "counter"),
    ("deepinfer:prompt_tokens", "counter"),
    ("deepinfer:generation_tokens", "counter"),
    ("deepinfer:request_success", "counter"),
    ("deepinfer:time_to_first_token_seconds", "histogram"),
    ("deepinfer:inter_token_latency_seconds", "histogram"),
    ("deepinfer:e2e_request_latency_seconds", "histogram"),
]


def parse(metrics: EngineMetrics) -> dict:
    """{(sample name, sorted labels): value} from the rendered exposition text (the path a scraper sees)."""
    values = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


def families(metrics: EngineMetrics) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(metrics.render().decode())}


def test_every_required_metric_is_exported_with_its_type_and_model_label():
    metrics = EngineMetrics("m1")
    exported = families(metrics)
    for name, kind in REQUIRED:
        assert exported.get(name) == kind, (name, exported.get(name))
    values = parse(metrics)
    label = (("model_name", "m1"),)
    assert values[("deepinfer:num_requests_running", label)] == 0
    for reason in ("stop", "length", "abort", "error"):  # exported at 0 before any request finishes
        assert values[("deepinfer:request_success_total", (("finished_reason", reason), ("model_name", "m1")))] == 0


def test_counters_sum_steps_and_gauges_keep_the_last_step():
    metrics = EngineMetrics("m")
    steps = [
        IterationStats(num_running=3, num_waiting=5, kv_cache_usage=0.25, prefix_cache_queries=64,
                       prefix_cache_hits=32, num_prompt_tokens=32, num_generation_tokens=3,
                       request_prompt_tokens=64, request_cached_tokens=32, time_to_first_tokens_s=[0.003, 0.2, 0.2]),
        IterationStats(num_running=2, num_waiting=0, kv_cache_usage=0.5, num_preemptions=1,
                       num_generation_tokens=2, inter_token_latencies_s=[0.02, 0.03],
                       finished_requests=[FinishedRequestStats("stop", 10, 2, 0.4, 0.003, 0.001)]),
        IterationStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_generation_tokens=1,
                       inter_token_latencies_s=[0.5],
                       finished_requests=[FinishedRequestStats("length", 20, 2, 1.2, 0.2),
                                          FinishedRequestStats("abort", 2, 1, 2.0, 0.2)]),
    ]
    for step in steps:
        metrics.record(step)
    v = parse(metrics)
    m = (("model_name", "m"),)

    def reason(r):
        return (("finished_reason", r), ("model_name", "m"))

    assert v[("deepinfer:num_requests_running", m)] == 0
    assert v[("deepinfer:kv_cache_usage_perc", m)] == 0.0
    assert v[("deepinfer:prefix_cache_queries_total", m)] == 64
    assert v[("deepinfer:prefix_cache_hits_total", m)] == 32
    assert v[("deepinfer:num_preemptions_total", m)] == 1
    # vLLM's prompt_tokens: whole prompts (cached tokens included), split by source
    assert v[("deepinfer:prompt_tokens_total", m)] == 64
    assert v[("deepinfer:prompt_tokens_cached_total", m)] == 32
    assert v[("deepinfer:prompt_tokens_by_source_total", (("model_name", "m"), ("source", "local_compute")))] == 32
    assert v[("deepinfer:prompt_tokens_by_source_total", (("model_name", "m"), ("source", "local_cache_hit")))] == 32
    assert v[("deepinfer:generation_tokens_total", m)] == 3 + 2 + 1  # per step, never again at finish
    assert v[("deepinfer:request_success_total", reason("stop"))] == 1
    assert v[("deepinfer:request_success_total", reason("length"))] == 1
    assert v[("deepinfer:request_success_total", reason("abort"))] == 1
    assert v[("deepinfer:request_success_total", reason("error"))] == 0
    assert v[("deepinfer:time_to_first_token_seconds_count", m)] == 3
    assert math.isclose(v[("deepinfer:time_to_first_token_seconds_sum", m)], 0.403)
    # cumulative buckets: 0.003 falls in le=0.005, the two 0.2s in le=0.25
    assert v[("deepinfer:time_to_first_token_seconds_bucket", (("le", "0.001"), ("model_name", "m")))] == 0
    assert v[("deepinfer:time_to_first_token_seconds_bucket", (("le", "0.005"), ("model_name", "m")))] == 1
    assert v[("deepinfer:time_to_first_token_seconds_bucket", (("le", "0.1"), ("model_name", "m")))] == 1
    assert v[("deepinfer:time_to_first_token_seconds_bucket", (("le", "0.25"), ("model_name", "m")))] == 3
    assert v[("deepinfer:inter_token_latency_seconds_count", m)] == 3
    assert math.isclose(v[("deepinfer:inter_token_latency_seconds_sum", m)], 0.55)
    assert v[("deepinfer:e2e_request_latency_seconds_count", m)] == 3
    assert math.isclose(v[("deepinfer:e2e_request_latency_seconds_sum", m)], 3.6)
    assert v[("deepinfer:e2e_request_latency_seconds_bucket", (("le", "0.5"), ("model_name", "m")))] == 1


def test_exposition_has_no_created_series():
    metrics = EngineMetrics("m")
    metrics.record(IterationStats(num_generation_tokens=2, time_to_first_tokens_s=[0.1]))
    names = [sample.name for family in text_string_to_metric_families(metrics.render().decode())
             for sample in family.samples]
    assert "deepinfer:generation_tokens_total" in names and "deepinfer:time_to_first_token_seconds_sum" in names
    assert not [name for name in names if name.endswith("_created")]
    assert b"_created" not in metrics.render()


def test_buckets_are_vllms():
    metrics = EngineMetrics("m")
    les = [float(labels[0][1]) for (name, labels) in parse(metrics)
           if name == "deepinfer:time_to_first_token_seconds_bucket"]
    assert les == TTFT_BUCKETS + [math.inf]
    assert TTFT_BUCKETS[:3] == [0.001, 0.005, 0.01] and TTFT_BUCKETS[-1] == 2560.0


def test_each_app_has_its_own_registry():
    # Two servers in one process (or two tests) must not share or collide on counters.
    first, second = EngineMetrics("same"), EngineMetrics("same")
    first.record(IterationStats(num_generation_tokens=7))
    assert parse(first)[("deepinfer:generation_tokens_total", (("model_name", "same"),))] == 7
    assert parse(second)[("deepinfer:generation_tokens_total", (("model_name", "same"),))] == 0


@pytest.fixture(scope="module")
def server(tiny_models):
    model_dir, _ = tiny_models["llama"]
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=256, num_gpu_blocks=64)
    running = ServerThread(config, ServerConfig(served_model_name="metered")).start()
    yield running
    running.stop()


def test_server_metrics_add_up_to_what_clients_received(server):
    before = server.metrics()
    shared_prefix = list(range(30, 70))  # 40 tokens: a repeat reuses (40 - 1) // 16 = 2 blocks
    prompts = [shared_prefix, shared_prefix, list(range(100, 120)), shared_prefix + [5, 6]]
    usages = []
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        for i, prompt in enumerate(prompts):
            body = {"prompt": prompt, "temperature": 0, "max_tokens": 3 + i, "ignore_eos": True}
            usages.append(http.post("/v1/completions", json=body).json()["usage"])
        stopped = http.post("/v1/completions", json={"prompt": [7, 8, 9], "max_tokens": 4, "stop_token_ids": [],
                                                      "ignore_eos": False, "temperature": 0}).json()
    server.wait_idle()
    after = server.metrics()

    def delta(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    usages.append(stopped["usage"])
    num_requests = len(usages)
    generated = sum(u["completion_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    assert cached == 32 + 32  # the second and fourth prompt reuse the first one's two full blocks
    assert delta("deepinfer:generation_tokens_total") == generated
    assert delta("deepinfer:prompt_tokens_total") == prompt_tokens  # as vLLM: cached tokens included
    assert delta("deepinfer:prompt_tokens_cached_total") == cached
    assert delta("deepinfer:prompt_tokens_by_source_total", source="local_compute") == prompt_tokens - cached
    assert delta("deepinfer:prompt_tokens_by_source_total", source="local_cache_hit") == cached
    assert delta("deepinfer:prefix_cache_hits_total") == cached
    assert delta("deepinfer:prefix_cache_queries_total") >= cached
    assert delta("deepinfer:time_to_first_token_seconds_count") == num_requests
    assert delta("deepinfer:inter_token_latency_seconds_count") == generated - num_requests
    assert delta("deepinfer:e2e_request_latency_seconds_count") == num_requests
    assert delta("deepinfer:request_queue_time_seconds_count") == num_requests
    finished_by_length = 4 + (stopped["choices"][0]["finish_reason"] == "length")
    assert delta("deepinfer:request_success_total", finished_reason="length") == finished_by_length
    assert delta("deepinfer:request_success_total", finished_reason="stop") == num_requests - finished_by_length
    assert after[("deepinfer:num_requests_running", ())] == 0
    assert after[("deepinfer:num_requests_waiting", ())] == 0
    assert after[("deepinfer:kv_cache_usage_perc", ())] == 0
    text = httpx.get(server.base_url + "/metrics").text
    assert 'deepinfer:generation_tokens_total{model_name="metered"}' in text
    assert "_created" not in text


def test_a_request_with_n_samples_is_one_observation(server):
    """n > 1: one TTFT, one e2e, one queue time, one request_success and its prompt counted once (as in
    usage.prompt_tokens); inter-token latencies are per token after each sample's first."""
    before = server.metrics()
    body = {"prompt": list(range(200, 230)), "n": 3, "temperature": 1.0, "seed": 3, "max_tokens": 5,
            "ignore_eos": True}
    reply = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).json()
    server.wait_idle()
    after = server.metrics()

    def delta(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert len(reply["choices"]) == 3 and reply["usage"]["completion_tokens"] == 15
    for name in ("time_to_first_token_seconds_count", "e2e_request_latency_seconds_count",
                 "request_queue_time_seconds_count"):
        assert delta(f"deepinfer:{name}") == 1, name
    assert delta("deepinfer:request_success_total", finished_reason="length") == 1
    assert delta("deepinfer:prompt_tokens_total") == reply["usage"]["prompt_tokens"] == 30
    assert delta("deepinfer:generation_tokens_total") == 15
    assert delta("deepinfer:inter_token_latency_seconds_count") == 15 - 3


def test_rejections_are_counted_by_status(server):
    def rejected(status: int) -> float:
        return server.metrics().get(("deepinfer:requests_rejected_total", (("status", str(status)),)), 0.0)

    before = {status: rejected(status) for status in (400, 404, 415)}
    httpx.post(server.base_url + "/v1/completions", json={"prompt": "x", "temperature": "hot"})
    httpx.post(server.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 10**6})
    httpx.post(server.base_url + "/v1/completions", json={"prompt": "x", "model": "other"})
    httpx.post(server.base_url + "/v1/completions", content=b"{}")  # no Content-Type
    assert rejected(400) - before[400] == 2
    assert rejected(404) - before[404] == 1
    assert rejected(415) - before[415] == 1
