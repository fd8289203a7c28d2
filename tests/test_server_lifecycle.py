"""Starting and stopping: a busy port fails at once, SIGTERM drains running requests and exits 0.

The shutdown is checked twice: in-process, with the engine slowed down so a long stream must be
ended by the deadline (deterministic), and end to end on a real `deepinfer serve` subprocess.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from server_helpers import ServerThread, free_port, wait_until_healthy

from deepinfer.core.config import EngineConfig
from deepinfer.core.server.config import ServerConfig


def serve_command(model: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "deepinfer", "serve", "--model", model, "--port", str(port), "--device", "cpu",
            "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "8MiB", "--log-level", "warning",
            *extra]


def test_a_busy_port_fails_at_once_before_the_model_loads(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        result = subprocess.run(serve_command(str(tmp_path / "absent-model"), port), check=False,
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    expected = (f"error: cannot serve: cannot listen on 127.0.0.1:{port}: Address already in use "
                f"(another process is listening there; pick another --port)")
    assert lines == [expected], result.stderr
    assert time.monotonic() - started < 60  # no model load was attempted (the model path does not exist)


async def read_stream(http: httpx.AsyncClient, body: dict, first_chunk: asyncio.Event) -> list[str]:
    """Every `data:` payload of a completion stream."""
    events = []
    async with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                first_chunk.set()
    return events


def last_finish_reason(events: list[str]) -> str | None:
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    return next((c["choices"][0]["finish_reason"] for c in reversed(chunks) if c["choices"]), None)


@pytest.fixture()
def slow_server(tiny_llama_dir):
    """Each engine step takes at least 20 ms, so a 400-token stream outlasts a 1 s drain."""
    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=512,
                          num_gpu_blocks=96)
    server = ServerThread(config, ServerConfig(served_model_name="tiny", shutdown_timeout_s=5.0)).start()
    server.engine.add_stats_listener(lambda stats: time.sleep(0.02))
    yield server
    server.stop()


def test_shutdown_lets_short_requests_finish_and_ends_long_streams(slow_server):
    state = slow_server.state

    async def scenario():
        first_chunk = asyncio.Event()
        async with httpx.AsyncClient(base_url=slow_server.base_url, timeout=60) as http:
            long_stream = asyncio.ensure_future(read_stream(
                http, {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}, first_chunk))
            await first_chunk.wait()
            short = asyncio.ensure_future(http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 5,
                                                                               "ignore_eos": True}))
            await asyncio.sleep(0.05)
            slow_server._loop.call_soon_threadsafe(state.begin_shutdown, 1.0)
            await asyncio.sleep(0.1)
            refused = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
            health = await http.get("/health")
            started = time.monotonic()
            events = await long_stream
            return await short, refused, health, events, time.monotonic() - started

    short, refused, health, events, drained_s = asyncio.run(scenario())
    assert short.status_code == 200 and short.json()["choices"][0]["finish_reason"] == "length"
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert health.status_code == 503 and health.json() == {"status": "shutting_down"}
    assert events[-1] == "[DONE]" and last_finish_reason(events) == "abort"
    assert drained_s < 5  # ended at the 1 s deadline, not when its 400 tokens were done
    assert slow_server.wait_idle()["blocks"]["num_used"] == 0


def test_sigterm_drains_the_stream_and_exits_0_without_a_traceback(tiny_llama_dir):
    port = free_port()
    process = subprocess.Popen(serve_command(str(tiny_llama_dir), port, "--shutdown-timeout", "1"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(process, base)

        async def scenario():
            first_chunk = asyncio.Event()
            async with httpx.AsyncClient(base_url=base, timeout=60) as http:
                stream = asyncio.ensure_future(read_stream(
                    http, {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True}, first_chunk))
                await first_chunk.wait()
                process.send_signal(signal.SIGTERM)
                return await stream

        events = asyncio.run(scenario())
        with pytest.raises(httpx.TransportError):  # the listener is closed: no new connections
            httpx.get(base + "/health", timeout=5)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert events[-1] == "[DONE]" and last_finish_reason(events) in ("abort", "length")
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr and "Error" not in stderr, stderr
