"""64 concurrent streaming clients, a third of which hang up at random moments.

Every client that stays gets exactly the text the same request gets alone (greedy), every
block is free afterwards, and the Prometheus counters add up to what the clients and the
engine's per-request reports say.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest
from server_helpers import ServerThread

from deepinfer.core.config import EngineConfig
from deepinfer.core.server.config import ServerConfig

NUM_CLIENTS = 64
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(tiny_models):
    model_dir, _ = tiny_models["llama"]
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=512,
                          num_gpu_blocks=256, max_num_seqs=32, max_num_batched_tokens=512)
    running = ServerThread(config, ServerConfig(served_model_name="tiny")).start()
    yield running
    running.stop()


class FinishedRecorder:
    """The engine's own per-request reports (FinishedRequestStats), gathered from its stats listener."""

    def __init__(self):
        self.lock = threading.Lock()
        self.finished = []

    def __call__(self, stats) -> None:
        with self.lock:
            self.finished.extend(stats.finished_requests)


def request_body(i: int) -> dict:
    words = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog"]
    prompt = f"Request {i}: " + " ".join(words[: 2 + i % 7]) + f" {i * 7919 % 1000}"
    # logprobs name every token a chunk carries (text alone may wait for the rest of a UTF-8 character,
    # and a client that reads behind gets several tokens in one chunk), so clients count tokens, not chunks.
    return {"model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "logprobs": 1}


async def stream_one(client: httpx.AsyncClient, body: dict, hang_up_after: int | None) -> dict:
    """Stream a completion; with hang_up_after=k, disconnect once k tokens have arrived."""
    text, tokens, usage, done = "", 0, None, False
    async with client.stream("POST", "/v1/completions", json=body | {"stream": True,
                                                                      "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, await r.aread()
        if hang_up_after == 0:
            return {"hung_up": True}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[len("data: "):])
            if event["choices"]:
                text += event["choices"][0]["text"]
                tokens += len(event["choices"][0]["logprobs"]["tokens"])
            else:
                usage = event["usage"]
            if hang_up_after is not None and tokens >= hang_up_after:
                return {"hung_up": True}
    return {"hung_up": False, "text": text, "usage": usage, "done": done}


def test_64_streams_with_random_disconnects(server):
    recorder = FinishedRecorder()
    server.engine.add_stats_listener(recorder)
    bodies = [request_body(i) for i in range(NUM_CLIENTS)]
    rng = random.Random(0)
    leavers = set(rng.sample(range(NUM_CLIENTS), NUM_CLIENTS // 3))
    hang_up_after = {i: rng.randrange(0, MAX_TOKENS) for i in leavers}

    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        alone = {i: http.post("/v1/completions", json=bodies[i]).json()["choices"][0]["text"]
                 for i in range(NUM_CLIENTS) if i not in leavers}
    server.wait_idle()
    before = server.metrics()
    with recorder.lock:
        recorder.finished.clear()

    async def run_all():
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 4, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(stream_one(client, bodies[i], hang_up_after.get(i))
                                          for i in range(NUM_CLIENTS)))

    results = asyncio.run(run_all())

    stayed = [i for i in range(NUM_CLIENTS) if i not in leavers]
    for i in stayed:
        assert results[i]["done"], i
        assert results[i]["text"] == alone[i], (i, results[i]["text"], alone[i])
        assert results[i]["usage"]["completion_tokens"] == MAX_TOKENS
    assert all(results[i]["hung_up"] for i in leavers)

    health = server.wait_idle()
    blocks = health["blocks"]
    assert blocks["num_used"] == 0, blocks  # every block came back (cached ones stay evictable, not used)

    after = server.metrics()

    def delta(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    with recorder.lock:
        finished = list(recorder.finished)
    assert len(finished) == NUM_CLIENTS  # each request finished exactly once
    by_reason = {}
    for f in finished:
        by_reason[f.finish_reason] = by_reason.get(f.finish_reason, 0) + 1
    aborted = [f for f in finished if f.finish_reason == "abort"]
    assert by_reason.get("length", 0) + by_reason.get("abort", 0) == NUM_CLIENTS
    assert len(stayed) <= by_reason["length"] and 0 < len(aborted) <= len(leavers)
    for reason in ("stop", "length", "abort", "error"):
        assert delta("deepinfer:request_success_total", finished_reason=reason) == by_reason.get(reason, 0), reason
    # generated tokens: what the staying clients were told, plus what the engine made for the ones that
    # left (finished by length after a late hang-up, or aborted)
    told = sum(results[i]["usage"]["completion_tokens"] for i in stayed)
    made_for_leavers = sum(f.num_generation_tokens for f in finished) - len(stayed) * MAX_TOKENS
    assert made_for_leavers >= 0
    assert delta("deepinfer:generation_tokens_total") == told + made_for_leavers
    assert delta("deepinfer:e2e_request_latency_seconds_count") == NUM_CLIENTS
    assert after[("deepinfer:num_requests_running", ())] == 0


def test_non_streaming_client_that_leaves_is_aborted(server):
    recorder = FinishedRecorder()
    server.engine.add_stats_listener(recorder)
    body = json.dumps(request_body(1) | {"max_tokens": 400}).encode()
    address = urlsplit(server.base_url)
    with socket.create_connection((address.hostname, address.port)) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: tiny\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + 30
        while server.engine.health()["scheduler"]["num_running"] == 0:  # it runs before its client leaves
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
    health = server.wait_idle(timeout_s=10)
    assert health["blocks"]["num_used"] == 0
    with recorder.lock:
        reasons = [f.finish_reason for f in recorder.finished]
        tokens = [f.num_generation_tokens for f in recorder.finished]
    assert reasons == ["abort"] and tokens[0] < 400


def test_streaming_client_that_leaves_is_aborted(server):
    recorder = FinishedRecorder()
    server.engine.add_stats_listener(recorder)
    body = request_body(2) | {"max_tokens": 400, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=30) as http, \
            http.stream("POST", "/v1/completions", json=body) as response:
        events = (line for line in response.iter_lines() if line.startswith("data: "))
        first = [json.loads(next(events)[len("data: "):]) for _ in range(3)]
        assert all(chunk["choices"][0]["finish_reason"] is None for chunk in first)
    health = server.wait_idle(timeout_s=10)
    assert health["blocks"]["num_used"] == 0
    with recorder.lock:
        finished = list(recorder.finished)
    assert [f.finish_reason for f in finished] == ["abort"]
    assert 3 <= finished[0].num_generation_tokens < 400
