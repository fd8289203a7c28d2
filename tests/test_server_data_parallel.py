"""`deepinfer serve --data-parallel-size 2`: two engine-core processes behind one front end.

The router alone: the least-loaded replica, the replica of a remembered prefix unless it is loaded
beyond the margin, the cache salt and the LRU bound. Replica placement: every replica on the CPU,
cuda:i per GPU, and one error when there are fewer GPUs. The replica-labelled metrics. Then real
processes on the CPU with the tiny model: greedy answers equal a one-engine server's; concurrent
requests spread over both replicas (each one's request_success counts some); a request sharing a
long prefix with an earlier one follows it to its replica though the other is less loaded; /health
sums the replicas; SIGTERM stops every process with exit status 0; a killed replica ends its open
stream with a 5xx error and the server exits 1, leaving no process behind; a model that does not load, or
fewer GPUs than replicas, is one error line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import free_port
from test_server_api_servers import REQUESTS, ServeProcess, ask, metric_values, one_server_answers

from deepinfer.core.engine.frontend.data_parallel_client import replica_devices
from deepinfer.core.engine.frontend.replica_router import ReplicaRouter
from deepinfer.core.engine.stats import FinishedRequestStats, IterationStats
from deepinfer.core.errors import DeepInferError
from deepinfer.core.server.config import ServerConfig
from deepinfer.core.server.metrics import EngineMetrics

BLOCK = 16

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


# The router, replica placement and the labelled metrics alone -------------------------------------

def test_a_prompt_without_a_full_block_goes_to_the_least_loaded_replica():
    router = ReplicaRouter(3, BLOCK)
    assert router.choose([1, 2, 3], None, [2, 0, 1]) == 1
    assert router.choose([1, 2, 3], None, [0, 0, 1]) == 0  # a tie: the first
    assert router.prefix_hashes(list(range(BLOCK - 1)), None) == []


def test_a_remembered_prefix_keeps_its_replica_until_it_is_loaded_beyond_the_margin():
    router = ReplicaRouter(2, BLOCK, margin=4)
    prefix = list(range(100, 100 + 2 * BLOCK))
    assert router.choose(prefix + [1], None, [3, 0]) == 1
    assert router.choose(prefix + [2], None, [0, 4]) == 1  # 4 <= 0 + 4: the prefix wins
    assert router.choose(prefix[:BLOCK] + [7] * BLOCK, None, [0, 4]) == 1  # the first block alone matches
    assert router.choose(prefix + [3], None, [0, 5]) == 0  # beyond the margin: the least loaded, remembered
    assert router.choose(prefix + [4], None, [1, 0]) == 0
    assert router.choose(prefix + [5], "tenant", [1, 0]) == 1  # another salt: another prefix


def test_the_router_forgets_the_oldest_prefixes_past_its_capacity():
    router = ReplicaRouter(2, BLOCK, capacity=2)
    first, second = [1] * BLOCK, [2] * BLOCK
    assert router.choose(first, None, [1, 0]) == 1
    assert router.choose(second, None, [0, 1]) == 0
    assert router.choose([3] * BLOCK, None, [0, 1]) == 0  # `first` is dropped
    assert router.choose(first, None, [0, 1]) == 0


def test_replicas_go_one_per_gpu_or_all_on_the_cpu(monkeypatch):
    import torch

    assert replica_devices("cpu", 2) == ["cpu", "cpu"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert replica_devices("auto", 3) == ["cpu"] * 3
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert replica_devices("auto", 2) == ["cuda:0", "cuda:1"]
    assert replica_devices("cuda", 2) == ["cuda:0", "cuda:1"]
    with pytest.raises(DeepInferError, match="--data-parallel-size 4 needs 4 CUDA GPUs; torch sees 2"):
        replica_devices("cuda", 4)
    with pytest.raises(DeepInferError, match="not 'cuda:1'"):
        replica_devices("cuda:1", 2)


def test_data_parallel_and_several_api_servers_are_refused_together():
    assert ServerConfig(data_parallel_size=2).engine_process is True
    with pytest.raises(ValueError, match="cannot both be more than 1"):
        ServerConfig(data_parallel_size=2, api_server_count=2)


def test_each_replicas_figures_carry_its_label():
    metrics = EngineMetrics("m", num_replicas=2)
    metrics.record(IterationStats(num_running=3, num_generation_tokens=4,
                                  finished_requests=[FinishedRequestStats("stop", 2, 4, 0.5, 0.01)]), replica=1)
    metrics.record(IterationStats(num_running=1, num_generation_tokens=2), replica=0)
    values = metric_values(metrics.render().decode())
    assert values[("deepinfer:generation_tokens_total", (("model_name", "m"), ("replica", "0")))] == 2
    assert values[("deepinfer:generation_tokens_total", (("model_name", "m"), ("replica", "1")))] == 4
    assert values[("deepinfer:num_requests_running", (("model_name", "m"), ("replica", "1")))] == 3
    success = (("finished_reason", "stop"), ("model_name", "m"))
    assert values[("deepinfer:request_success_total", (*success, ("replica", "1")))] == 1
    assert values[("deepinfer:request_success_total", (*success, ("replica", "0")))] == 0
    assert values[("deepinfer:e2e_request_latency_seconds_count", (("model_name", "m"), ("replica", "1")))] == 1


# Real processes -------------------------------------------------------------------------------------

class DataParallelServer(ServeProcess):
    """A `deepinfer serve --data-parallel-size 2` subprocess and its two engine pids."""

    def __init__(self, model: Path):
        super().__init__(model, ["--block-size", str(BLOCK), "--data-parallel-size", "2"])
        self.engines = self.spawned
        assert len(self.engines) == 2

    def successes(self) -> list[float]:
        """Each replica's finished requests so far."""
        values = metric_values(httpx.get(self.base_url + "/metrics", timeout=10).text)
        return [sum(value for (name, labels), value in values.items()
                    if name == "deepinfer:request_success_total" and ("replica", str(replica)) in labels)
                for replica in range(2)]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    server = DataParallelServer(tiny_llama_dir)
    yield server
    server.stop()


def test_greedy_answers_equal_one_engines_and_concurrent_requests_use_both_replicas(server, tiny_llama_dir):
    expected = one_server_answers(tiny_llama_dir)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
    assert [ask(client, route, body) for route, body in REQUESTS] == expected
    before = server.successes()
    prompts = [[5 + index, 9, 13] for index in range(6)]  # shorter than a block: routed by load alone

    def complete(prompt: list[int]) -> str:
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        concurrent = list(pool.map(complete, prompts))
    assert concurrent == [complete(prompt) for prompt in prompts]  # the same one by one
    after = server.successes()
    gained = [after[replica] - before[replica] for replica in range(2)]
    assert sum(gained) == 2 * len(prompts) and min(gained) > 0, gained


def test_a_shared_long_prefix_follows_its_replica_though_the_other_is_less_loaded(server):
    prefix = [(7 * index) % 200 + 3 for index in range(3 * BLOCK)]
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
    before = server.successes()
    client.completions.create(model="tiny", prompt=prefix + [1], max_tokens=2, temperature=0)  # both idle: replica 0
    assert [b - a for a, b in zip(before, server.successes())] == [1, 0]
    body = {"prompt": [4, 4], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as response:
        next(line for line in response.iter_lines() if line.startswith("data: "))  # open on replica 0
        client.completions.create(model="tiny", prompt=prefix + [2], max_tokens=2, temperature=0)
    gained = [b - a for a, b in zip(before, server.successes())]
    assert gained[1] == 0 and gained[0] >= 2, gained  # the stream (finished or aborted) and both prefix requests
    values = metric_values(httpx.get(server.base_url + "/metrics", timeout=10).text)
    hits = values[("deepinfer:prefix_cache_hits_total", (("model_name", "tiny"), ("replica", "0")))]
    assert hits >= 3 * BLOCK


def test_health_is_healthy_while_both_replicas_are_and_sums_them(server):
    health = httpx.get(server.base_url + "/health", timeout=10)
    assert health.status_code == 200
    body = health.json()
    assert body["engine_alive"] is True and len(body["replicas"]) == 2
    assert body["blocks"]["num_blocks"] == sum(replica["blocks"]["num_blocks"] for replica in body["replicas"])


def test_sigterm_stops_every_process_and_exits_0(server):
    server.process.send_signal(signal.SIGTERM)
    _, stderr = server.process.communicate(timeout=60)
    assert server.process.returncode == 0, stderr
    assert "Traceback" not in stderr, stderr
    assert server.wait_until_gone() == []


@pytest.mark.slow
def test_a_killed_replica_ends_its_open_stream_with_a_5xx_and_the_server_exits_1(tiny_llama_dir):
    server = DataParallelServer(tiny_llama_dir)
    try:
        started = [threading.Event(), threading.Event()]
        body = {"prompt": [4, 4], "max_tokens": 480, "ignore_eos": True, "stream": True}

        def stream(index: int) -> list[str]:
            events = []
            with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
                        started[index].set()
            return events

        with ThreadPoolExecutor(max_workers=2) as pool:
            first = pool.submit(stream, 0)
            assert started[0].wait(60)
            second = pool.submit(stream, 1)  # one open request each: the second goes to the other replica
            assert started[1].wait(60)
            os.kill(server.engines[0], signal.SIGKILL)
            events = [first.result(timeout=60), second.result(timeout=60)]
        server.process.wait(timeout=60)  # the server stops by itself: it never hangs
        _, stderr = server.process.communicate()
        assert server.process.returncode == 1, stderr
        errors = [[json.loads(e) for e in stream_events if e != "[DONE]" and "error" in json.loads(e)]
                  for stream_events in events]
        assert sum(1 for found in errors if found and found[0]["error"]["code"] == "engine_dead") >= 1, errors
        assert "engine process" in stderr
        assert server.wait_until_gone() == []
    finally:
        server.stop()


@pytest.mark.slow
def test_a_model_that_does_not_load_or_too_few_gpus_is_one_error_line_and_status_1(tmp_path):
    absent = tmp_path / "absent-model"
    for device, message in [("cpu", f"ModelLoadError: model path {absent} does not exist"),
                            ("cuda", "--data-parallel-size 64 needs 64 CUDA GPUs; torch sees ")]:
        result = subprocess.run(
            [sys.executable, "-m", "deepinfer", "serve", "--model", str(absent), "--port", str(free_port()),
             "--device", device, "--log-level", "critical", "--data-parallel-size", "64" if device == "cuda" else "2"],
            check=False, capture_output=True, text=True, timeout=120)
        assert result.returncode == 1
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: cannot serve: {message}"), result.stderr
