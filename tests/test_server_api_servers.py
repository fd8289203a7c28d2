"""`deepinfer serve --api-server-count 2`: two API-server processes in front of one engine process.

Real processes on the CPU with the tiny model: requests pinned to each API server (the test opens
connections until both processes hold some, reading which process owns each from /proc) answer as
one in-process server does (greedy); /metrics of either is the total of both; a client that
disconnects aborts its request; SIGTERM stops every
process with exit status 0; a killed engine process ends the open streams of both API servers with
a 5xx error and the server exits 1, leaving no process behind; a model that does not load is one
error line. The shared metric tallies are also checked alone, added into by a spawned process.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import ServerThread, free_port, wait_until_healthy

from deepinfer.core.config import EngineConfig
from deepinfer.core.engine.stats import FinishedRequestStats, IterationStats
from deepinfer.core.server.config import ServerConfig
from deepinfer.core.server.metrics import EngineMetrics, ServerMetrics, new_tallies

TCP_ESTABLISHED, TCP_LISTEN = "01", "0A"  # /proc/net/tcp states

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


def _record_in_child(tallies, stats: IterationStats) -> None:
    EngineMetrics("m", tallies=tallies).record(stats)
    ServerMetrics(tallies).count_rejection(429)


def metric_values(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_shared_tallies_sum_what_every_process_adds():
    tallies = new_tallies(shared=True)
    mine = EngineMetrics("m", tallies=tallies)
    mine.record(IterationStats(num_generation_tokens=3, time_to_first_tokens_s=[0.02],
                               finished_requests=[FinishedRequestStats("length", 4, 3, 0.5, 0.02)]))
    theirs = IterationStats(num_running=2, num_generation_tokens=5, inter_token_latencies_s=[0.01, 0.3],
                            finished_requests=[FinishedRequestStats("stop", 2, 5, 1.2, 0.01, 0.001)])
    child = multiprocessing.get_context("spawn").Process(target=_record_in_child, args=(tallies, theirs))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    values = metric_values(mine.render().decode())
    label = (("model_name", "m"),)
    assert values[("deepinfer:generation_tokens_total", label)] == 8
    assert values[("deepinfer:num_requests_running", label)] == 2  # a gauge: the latest value, not a sum
    assert values[("deepinfer:request_success_total", (("finished_reason", "length"), ("model_name", "m")))] == 1
    assert values[("deepinfer:request_success_total", (("finished_reason", "stop"), ("model_name", "m")))] == 1
    assert values[("deepinfer:e2e_request_latency_seconds_count", label)] == 2
    assert values[("deepinfer:e2e_request_latency_seconds_sum", label)] == pytest.approx(1.7)
    assert values[("deepinfer:inter_token_latency_seconds_bucket", (("le", "0.01"), ("model_name", "m")))] == 1
    assert values[("deepinfer:inter_token_latency_seconds_bucket", (("le", "0.3"), ("model_name", "m")))] == 2
    rejected = metric_values(ServerMetrics(tallies).render().decode())
    assert rejected == {("deepinfer:requests_rejected_total", (("status", "429"),)): 1.0}


# Processes and their connections ------------------------------------------------------------------

def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:["):-1]))
    return inodes


def tcp_sockets(port: int, state: str) -> set[int]:
    """The inodes of the sockets on local `port` in `state`."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == state:
            inodes.add(int(fields[9]))
    return inodes


def connections_by_process(port: int, pids: list[int]) -> dict[int, int]:
    established = tcp_sockets(port, TCP_ESTABLISHED)
    return {pid: len(socket_inodes(pid) & established) for pid in pids}


class ServeProcess:
    """A `deepinfer serve` subprocess on the CPU with `flags` added, the processes it spawned (`spawned`), and
    their end."""

    def __init__(self, model: Path, flags: list[str], own_session: bool = False):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "deepinfer", "serve", "--model", str(model), "--port", str(self.port),
             "--device", "cpu", "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "8MiB",
             "--log-level", "warning", "--shutdown-timeout", "5", "--served-model-name", "tiny", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=own_session)
        wait_until_healthy(self.process, self.base_url)
        self.spawned = [pid for pid in children(self.process.pid)
                        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]

    def processes_left(self) -> list[int]:
        return [pid for pid in self.spawned if Path(f"/proc/{pid}").exists()
                and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]

    def wait_until_gone(self, timeout_s: float = 10) -> list[int]:
        """-> the spawned processes still there after up to `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.processes_left() and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.processes_left()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()
        for pid in self.processes_left():
            os.kill(pid, signal.SIGKILL)


class MultiServer(ServeProcess):
    """A `deepinfer serve --api-server-count 2` subprocess, its API-server pids and its engine pid."""

    def __init__(self, model: Path, own_session: bool = False):
        super().__init__(model, ["--api-server-count", "2"], own_session)
        listening = tcp_sockets(self.port, TCP_LISTEN)
        self.api_servers = sorted(pid for pid in self.spawned if socket_inodes(pid) & listening)
        (self.engine,) = [pid for pid in self.spawned if pid not in self.api_servers]
        assert len(self.api_servers) == 2

    def pinned_clients(self, per_process: int = 2, attempts: int = 200) -> dict[int, list[httpx.Client]]:
        """Kept-alive connections, opened one at a time until each API server holds `per_process`."""
        pinned: dict[int, list[httpx.Client]] = {pid: [] for pid in self.api_servers}
        for _ in range(attempts):
            if all(len(clients) >= per_process for clients in pinned.values()):
                break
            before = connections_by_process(self.port, self.api_servers)
            client = httpx.Client(base_url=self.base_url, timeout=60)
            assert client.get("/v1/models").status_code == 200
            after = connections_by_process(self.port, self.api_servers)
            (owner,) = [pid for pid in self.api_servers if after[pid] > before[pid]]
            if len(pinned[owner]) < per_process:
                pinned[owner].append(client)
            else:
                client.close()
        assert all(len(clients) == per_process for clients in pinned.values()), {p: len(c) for p, c in pinned.items()}
        return pinned


@pytest.fixture(scope="module")
def servers(tiny_llama_dir):
    server = MultiServer(tiny_llama_dir)
    yield server
    server.stop()


REQUESTS = [  # (route, body): completions and chat, plain and streamed
    ("completions", {"prompt": "Once upon a time", "max_tokens": 12}),
    ("completions", {"prompt": "The capital of", "max_tokens": 9, "stream": True}),
    ("chat", {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 10}),
    ("chat", {"messages": [{"role": "user", "content": "Name a colour"}], "max_tokens": 7, "stream": True}),
]


def ask(client: openai.OpenAI, route: str, body: dict) -> tuple[str, int, int]:
    """(text, prompt tokens, completion tokens) of one greedy request."""
    extra = {"temperature": 0, "extra_body": {"ignore_eos": True}}
    stream = body.get("stream", False)
    options = {"stream_options": {"include_usage": True}} if stream else {}
    if route == "completions":
        answer = client.completions.create(model="tiny", **body, **extra, **options)
    else:
        answer = client.chat.completions.create(model="tiny", **body, **extra, **options)
    if not stream:
        choice = answer.choices[0]
        return (choice.text if route == "completions" else choice.message.content,
                answer.usage.prompt_tokens, answer.usage.completion_tokens)
    text, usage = "", None
    for chunk in answer:
        if chunk.choices:
            text += (chunk.choices[0].text if route == "completions" else chunk.choices[0].delta.content) or ""
        usage = chunk.usage or usage
    return text, usage.prompt_tokens, usage.completion_tokens


def one_server_answers(model: Path) -> list[tuple[str, int, int]]:
    config = EngineConfig(model=str(model), device="cpu", dtype="float32", max_model_len=512)
    server = ServerThread(config, ServerConfig(served_model_name="tiny", shutdown_timeout_s=1.0)).start()
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
        return [ask(client, route, body) for route, body in REQUESTS]
    finally:
        server.stop()


def test_both_api_servers_answer_concurrent_requests_as_one_server_does_and_metrics_count_them_all(
        servers, tiny_llama_dir):
    expected = one_server_answers(tiny_llama_dir)
    pinned = servers.pinned_clients(per_process=len(REQUESTS))  # one connection per request: each its own
    jobs = [(http, index) for clients in pinned.values() for index, http in enumerate(clients)]
    openai_clients = {id(http): openai.OpenAI(base_url=servers.base_url + "/v1", api_key="none", http_client=http)
                      for http, _ in jobs}
    counts_before = connections_by_process(servers.port, servers.api_servers)

    def run(job):
        http, index = job
        return index, ask(openai_clients[id(http)], *REQUESTS[index])

    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(run, jobs))
    for index, answer in answers:
        assert answer == expected[index], REQUESTS[index]
    # Each request goes out on its pinned connection, alive when the requests start (well within the
    # keep-alive timeout): each API server serves half of them.
    assert all(count == len(REQUESTS) for count in counts_before.values()), counts_before

    totals = [metric_values(clients[0].get("/metrics").text) for clients in pinned.values()]
    assert totals[0] == totals[1]  # either API server's /metrics is the total
    label = (("model_name", "tiny"),)
    success = totals[0][("deepinfer:request_success_total", (("finished_reason", "length"), *label))]
    assert success == len(jobs)
    assert totals[0][("deepinfer:generation_tokens_total", label)] == sum(a[2] for _, a in answers)
    assert totals[0][("deepinfer:prompt_tokens_total", label)] == sum(a[1] for _, a in answers)
    assert totals[0][("deepinfer:e2e_request_latency_seconds_count", label)] == len(jobs)
    for clients in pinned.values():
        for http in clients:
            http.close()


def test_health_is_the_engines_through_either_api_server(servers):
    for clients in servers.pinned_clients(per_process=1).values():
        health = clients[0].get("/health")
        assert health.status_code == 200 and health.json()["engine_alive"] is True
        clients[0].close()


def test_a_client_that_disconnects_aborts_its_request_in_the_shared_engine(servers):
    pinned = servers.pinned_clients(per_process=1)
    body = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "stream": True}
    for clients in pinned.values():
        http = clients[0]
        with http.stream("POST", "/v1/completions", json=body) as response:
            next(line for line in response.iter_lines() if line.startswith("data: "))
        http.close()  # gone after its first chunk, with some 470 tokens to go
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        health = httpx.get(servers.base_url + "/health", timeout=10).json()
        if health["scheduler"]["num_running"] == 0 and health["blocks"]["num_used"] == 0:
            break
        time.sleep(0.1)
    assert health["scheduler"]["num_running"] == 0 and health["blocks"]["num_used"] == 0
    label = (("model_name", "tiny"),)
    aborted = metric_values(httpx.get(servers.base_url + "/metrics", timeout=10).text)[
        ("deepinfer:request_success_total", (("finished_reason", "abort"), *label))]
    assert aborted == len(pinned)


def test_sigterm_stops_every_process_and_exits_0(servers):
    servers.process.send_signal(signal.SIGTERM)
    _, stderr = servers.process.communicate(timeout=60)
    assert servers.process.returncode == 0, stderr
    assert "Traceback" not in stderr, stderr
    assert servers.wait_until_gone() == []


@pytest.mark.slow
def test_a_killed_engine_ends_the_streams_of_both_api_servers_with_a_5xx_and_the_server_exits_1(tiny_llama_dir):
    server = MultiServer(tiny_llama_dir)
    try:
        pinned = server.pinned_clients(per_process=1)
        started = threading.Barrier(len(pinned) + 1)
        body = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "stream": True}

        def stream(http: httpx.Client) -> list[str]:
            events = []
            with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
                        if len(events) == 1:
                            started.wait(timeout=60)
            return events

        with ThreadPoolExecutor(max_workers=len(pinned)) as pool:
            streams = [pool.submit(stream, clients[0]) for clients in pinned.values()]
            started.wait(timeout=60)  # both streams are running
            os.kill(server.engine, signal.SIGKILL)
            events = [future.result(timeout=60) for future in streams]
        try:  # the streams ended: the API servers know; /health is never healthy again
            health = httpx.get(server.base_url + "/health", timeout=10)
            assert health.status_code == 503 and health.json()["status"] in ("engine_dead", "shutting_down")
        except httpx.TransportError:
            pass  # already stopped listening
        server.process.wait(timeout=60)  # the server stops by itself: it never hangs
        _, stderr = server.process.communicate()
        assert server.process.returncode == 1, stderr
        for stream_events in events:
            errors = [json.loads(e) for e in stream_events if e != "[DONE]" and "error" in json.loads(e)]
            assert errors and errors[0]["error"]["code"] == "engine_dead", stream_events[-3:]
        assert "engine process" in stderr
        assert server.wait_until_gone() == []
    finally:
        server.stop()


@pytest.mark.slow
def test_a_model_that_does_not_load_is_one_error_line_and_status_1(tmp_path):
    port = free_port()
    result = subprocess.run(
        [sys.executable, "-m", "deepinfer", "serve", "--model", str(tmp_path / "absent-model"), "--port", str(port),
         "--device", "cpu", "--log-level", "critical", "--api-server-count", "2"],
        check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: cannot serve: ModelLoadError: model path {tmp_path / 'absent-model'} does not exist"], result.stderr


@pytest.mark.slow
def test_ctrl_c_to_the_process_group_drains_once_and_exits_130(tiny_llama_dir):
    """SIGINT to every process (a terminal's Ctrl-C): only `deepinfer serve` acts on it, once, so the
    running stream gets the drain (it finishes, or is ended at --shutdown-timeout with [DONE]),
    not the immediate end a second signal means."""
    server = MultiServer(tiny_llama_dir, own_session=True)
    try:
        (http,) = server.pinned_clients(per_process=1)[server.api_servers[0]]
        body = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "stream": True}
        events, signalled_at = [], None
        with http.stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    if len(events) == 1:
                        os.killpg(server.process.pid, signal.SIGINT)
                        signalled_at = time.monotonic()
        ended_after_s = time.monotonic() - signalled_at
        _, stderr = server.process.communicate(timeout=60)
        assert server.process.returncode == 130, stderr
        assert "Traceback" not in stderr, stderr
        chunks = [json.loads(e) for e in events if e != "[DONE]"]
        assert events[-1] == "[DONE]" and chunks[-1]["choices"][0]["finish_reason"] in ("length", "abort")
        if chunks[-1]["choices"][0]["finish_reason"] == "abort":
            assert ended_after_s >= 4  # ended at the 5 s deadline, not at once
        assert server.wait_until_gone() == []
    finally:
        server.stop()
