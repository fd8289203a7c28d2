"""The server under hostile clients: floods of oversized prompts, idle and slow sockets, too many
connections, exhausted file descriptors, chat templates that never end.

Each test builds its requests and sockets itself against a real server on a loopback port, and
each fails when the protection it covers is removed: work moved back onto the event loop stalls
the stream and /health past 1 s; without the request deadline the idle sockets' reads time out;
without the connection cap the extra sockets get no 503; without the accept-error log the
subprocess prints thousands of tracebacks. No network beyond loopback.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import select
import socket
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest
from server_helpers import ServerThread

from deepinfer.core.chat_template import ChatTemplate
from deepinfer.core.config import EngineConfig
from deepinfer.core.server.config import ServerConfig

REQUEST_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 12
LATENCY_LIMIT_S = 1.0


# An event loop that does no unbounded work ----------------------------------------------------------

@pytest.fixture(scope="module")
def smol(smollm2_gguf, tmp_path_factory):
    """A tiny random Llama (fast steps, so a stream's gaps are the server's, not the model's) with the
    default model's real 49k-token BPE tokenizer and a 1024-token context."""
    from conftest import save_tiny_model

    from deepinfer.core.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name).hf_tokenizer
    directory = tmp_path_factory.mktemp("real_vocab")
    save_tiny_model("llama", directory, tokenizer, vocab_size=len(tokenizer), max_position_embeddings=4096)
    config = EngineConfig(model=str(directory), device="cpu", dtype="float32", max_model_len=1024,
                          num_gpu_blocks=80)
    server = ServerThread(config, ServerConfig(served_model_name="smol", shutdown_timeout_s=1.0)).start()
    yield server
    server.stop()


def words_text(num_chars: int, seed: int) -> str:
    """English-like text that the BPE has to work through (no single long token)."""
    rng = random.Random(seed)
    words = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from"]
    text = " ".join(rng.choice(words) + str(rng.randint(0, 99)) for _ in range(num_chars // 4))
    return text[:num_chars]


async def watch_latency(base_url: str, stop: asyncio.Event) -> float:
    """The slowest /health answer while `stop` is unset, polled every 50 ms."""
    worst = 0.0
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        while not stop.is_set():
            started = time.monotonic()
            assert (await http.get("/health")).status_code == 200
            worst = max(worst, time.monotonic() - started)
            await asyncio.sleep(0.05)
    return worst


async def stream_gaps(http: httpx.AsyncClient, body: dict, first_chunk: asyncio.Event,
                      stop: asyncio.Event) -> list[float] | None:
    """The gaps between a stream's chunks from its first chunk until `stop` (then it hangs up);
    None if the stream ended first."""
    gaps, last = [], None
    async with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return None
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last = now
            first_chunk.set()
            if stop.is_set():
                return gaps
    return None


def test_oversized_prompts_stall_neither_a_stream_nor_health(smol):
    """16 prompts just under the character bound (so each must really be tokenized) and each far over
    the 1024-token limit arrive while a stream runs: every one is a 400, and neither the stream's
    largest inter-token gap nor any /health answer reaches 1 s."""
    serving = smol.state.serving
    num_chars = serving.max_prompt_chars - 100
    prompts = [words_text(num_chars, seed) for seed in range(16)]

    async def scenario():
        stop, first_chunk = asyncio.Event(), asyncio.Event()
        async with httpx.AsyncClient(base_url=smol.base_url, timeout=120) as http:
            watcher = asyncio.ensure_future(watch_latency(smol.base_url, stop))
            stream = asyncio.ensure_future(stream_gaps(
                http, {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "temperature": 0},
                first_chunk, stop))
            await asyncio.wait({stream, asyncio.ensure_future(first_chunk.wait())},
                               return_when=asyncio.FIRST_COMPLETED)
            assert first_chunk.is_set(), stream.result()
            rejected = await asyncio.gather(*(http.post("/v1/completions", json={"prompt": p, "max_tokens": 1})
                                              for p in prompts))
            stop.set()
            return rejected, await stream, await watcher

    rejected, gaps, worst_health = asyncio.run(asyncio.wait_for(scenario(), timeout=300))
    assert [r.status_code for r in rejected] == [400] * 16
    assert all(r.json()["error"]["code"] == "context_length_exceeded" for r in rejected)
    assert gaps, "the stream ended before the flood did; it measured nothing"
    assert max(gaps) < LATENCY_LIMIT_S, f"largest inter-token gap {max(gaps):.2f} s"
    assert worst_health < LATENCY_LIMIT_S, f"slowest /health {worst_health:.2f} s"


def test_a_prompt_beyond_the_character_bound_is_refused_without_tokenizing(smol, monkeypatch):
    tokenizer = smol.engine.tokenizer
    encoded_lengths = []
    encode = tokenizer.encode

    def spy(text, *args, **kwargs):
        encoded_lengths.append(len(text))
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", spy)
    huge = words_text(1_900_000, seed=99)
    assert len(huge) > smol.state.serving.max_prompt_chars
    for body, url in [({"prompt": huge}, "/v1/completions"),
                      ({"messages": [{"role": "user", "content": huge}]}, "/v1/chat/completions")]:
        response = httpx.post(smol.base_url + url, json=body, timeout=60)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "context_length_exceeded"
        assert "at least" in response.json()["error"]["message"]
    assert not any(length > smol.state.serving.max_prompt_chars for length in encoded_lengths)


# Slow, idle and too many connections -----------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=128,
                          num_gpu_blocks=64)
    server_config = ServerConfig(served_model_name="tiny", request_timeout_s=REQUEST_TIMEOUT_S,
                                 max_connections=MAX_CONNECTIONS, shutdown_timeout_s=1.0)
    server = ServerThread(config, server_config).start()
    yield server
    server.stop()


def connect(server: ServerThread, timeout_s: float = REQUEST_TIMEOUT_S + 5) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=timeout_s)
    return sock


def read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed it."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic()


@pytest.mark.parametrize("sent", [
    b"",  # connects and says nothing
    b"GET /heal",  # half a request line
    b"GET /health HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n",  # headers without their end
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\ncontent-length: 200\r\n\r\n"
     b'{"prompt": "hi", '),  # a body shorter than announced
], ids=["idle", "partial-request-line", "partial-headers", "partial-body"])
def test_a_request_that_does_not_arrive_in_time_is_cut_off(tiny, sent):
    with connect(tiny) as sock:
        opened = time.monotonic()
        sock.sendall(sent)
        data, closed = read_until_closed(sock)
    assert REQUEST_TIMEOUT_S * 0.8 <= closed - opened <= REQUEST_TIMEOUT_S + 3
    if sent:
        assert data.startswith(b"HTTP/1.1 408 "), data[:100]
        assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    else:
        assert data == b""
    assert httpx.get(tiny.base_url + "/health").status_code == 200


def test_a_slow_drip_is_cut_off_at_the_deadline_not_kept_alive_by_each_byte(tiny):
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Padding: " + b"a" * 200 + b"\r\n\r\n"
    with connect(tiny) as sock:
        opened = time.monotonic()
        for byte in request:  # one byte every 20 ms, until the server answers
            if select.select([sock], [], [], 0.02)[0]:
                break
            sock.sendall(bytes([byte]))
        data, closed = read_until_closed(sock)
    assert closed - opened < REQUEST_TIMEOUT_S + 3 < len(request) * 0.02
    assert data.startswith(b"HTTP/1.1 408 ")


def test_a_kept_alive_connection_gets_a_deadline_for_its_next_request(tiny):
    with connect(tiny) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while b"\r\n\r\n" not in first:
            first += sock.recv(65536)
        head, body = first.split(b"\r\n\r\n", 1)
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")))
        while len(body) < length:
            body += sock.recv(65536)
        assert head.startswith(b"HTTP/1.1 200 ") and len(body) == length
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the next request never ends its headers
        started = time.monotonic()
        data, closed = read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 408 ") and closed - started <= REQUEST_TIMEOUT_S + 3


def test_connections_beyond_the_cap_get_503_and_are_closed(tiny):
    held = [connect(tiny, timeout_s=30) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)  # let the server accept them all
        with connect(tiny) as extra:
            data, _ = read_until_closed(extra)
        assert data.startswith(b"HTTP/1.1 503 "), data[:100]
        assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "too_many_connections"
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the held sockets' slots come back once the server sees them close
        if httpx.get(tiny.base_url + "/health").status_code == 200:
            break
        time.sleep(0.1)
    assert httpx.get(tiny.base_url + "/health").status_code == 200


ACCEPT_SERVER = textwrap.dedent("""
    import asyncio, logging, resource, sys
    from deepinfer.core.server.connection import AcceptErrorLog
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))

    async def main():
        loop = asyncio.get_running_loop()
        if sys.argv[1] == "guarded":
            loop.set_exception_handler(AcceptErrorLog(interval_s=60))
        server = await loop.create_server(asyncio.Protocol, "127.0.0.1", 0, backlog=512)
        print(server.sockets[0].getsockname()[1], flush=True)
        await asyncio.sleep(3)

    asyncio.run(main())
""")


@pytest.mark.parametrize("mode", ["guarded", "plain"])
def test_failed_accepts_are_logged_once_per_interval(mode):
    """Out of descriptors, asyncio retries the accept every second and logs each failure with a
    traceback; with AcceptErrorLog one line covers a whole interval. ("plain" shows the flood.)"""
    process = subprocess.Popen([sys.executable, "-c", ACCEPT_SERVER, mode], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    port = int(process.stdout.readline())
    clients = []
    for _ in range(120):
        try:
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError:
            break
    _, stderr = process.communicate(timeout=30)
    for sock in clients:
        sock.close()
    if mode == "guarded":
        assert stderr.count("cannot accept connections") == 1, stderr[-2000:]
        assert "Traceback" not in stderr
    else:
        assert stderr.count("Traceback") > 10  # what the guard prevents


# Chat templates --------------------------------------------------------------------------------------

# 900,000 loop iterations: a noticeable time, inside the renderer's budget of 10^6
SLOW_TEMPLATE = ("{% for i in range(900) %}{% for j in range(1000) %}{% endfor %}{% endfor %}"
                 "{% for m in messages %}{{ m['content'] }}{% endfor %}")


def test_slow_chat_templates_run_off_the_loop(tiny, monkeypatch):
    """8 requests whose template takes a noticeable time each: all are answered, /health stays fast."""
    monkeypatch.setattr(tiny.engine.tokenizer, "chat_template", ChatTemplate(SLOW_TEMPLATE))

    async def scenario():
        stop = asyncio.Event()
        watcher = asyncio.ensure_future(watch_latency(tiny.base_url, stop))
        async with httpx.AsyncClient(base_url=tiny.base_url, timeout=120) as http:
            answers = await asyncio.gather(*(http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 1}) for i in range(8)))
        stop.set()
        return answers, await watcher

    answers, worst_health = asyncio.run(scenario())
    assert [a.status_code for a in answers] == [200] * 8, [a.text for a in answers]
    assert worst_health < LATENCY_LIMIT_S, f"slowest /health {worst_health:.2f} s"


def test_a_template_that_fails_is_a_400_and_the_server_keeps_answering(tiny, monkeypatch):
    """The renderer's errors (a template's raise_exception, and its time and size limits) are InvalidRequestErrors."""
    monkeypatch.setattr(tiny.engine.tokenizer, "chat_template", ChatTemplate(
                        "{% for i in range(1000) %}{% endfor %}{{ raise_exception('this template refuses') }}"))
    response = httpx.post(tiny.base_url + "/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages" and "this template refuses" in error["message"]
    assert httpx.get(tiny.base_url + "/health").status_code == 200


HOSTILE_TEMPLATES = {
    "nested-loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    # 200 MB in all: past any sane cap, survivable without one
    "huge-string": "{% for i in range(2000) %}{{ 'y' * 100000 }}{% endfor %}",
}
PROBE = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    from conftest import build_tiny_tokenizer
    from deepinfer.core.errors import InvalidRequestError
    from deepinfer.core.tokenizer import Tokenizer
    hf = build_tiny_tokenizer()
    hf.chat_template = sys.argv[2]
    try:
        Tokenizer(hf).apply_chat_template([{"role": "user", "content": "hi"}])
        print("rendered")
    except InvalidRequestError:
        print("refused")
""")


@functools.cache
def renderer_refuses(template: str, timeout_s: float) -> bool:
    """Whether core/tokenizer.py's renderer refuses `template` within `timeout_s` (in a subprocess, so a
    renderer without limits costs a killed process, not a thread spinning in this one)."""
    import pathlib

    try:
        result = subprocess.run([sys.executable, "-c", PROBE, str(pathlib.Path(__file__).parent), template],
                                check=False, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False
    return result.stdout.strip() == "refused"


@pytest.mark.parametrize("name", sorted(HOSTILE_TEMPLATES))
def test_hostile_templates_are_a_400_within_the_renderers_limits(tiny, monkeypatch, name):
    """GGUF templates that loop 10^10 times or build hundreds of megabytes: the renderer's time budget and
    size cap (core/tokenizer.py) stop them, the server answers 400 and keeps serving meanwhile."""
    if not renderer_refuses(HOSTILE_TEMPLATES["huge-string"], timeout_s=60):
        pytest.skip("core/tokenizer.py's renderer has no size cap yet")
    if not renderer_refuses(HOSTILE_TEMPLATES[name], timeout_s=60):
        pytest.fail(f"core/tokenizer.py's renderer does not stop the {name} template within 60 s")
    monkeypatch.setattr(tiny.engine.tokenizer, "chat_template", ChatTemplate(HOSTILE_TEMPLATES[name]))
    done = threading.Event()
    result = {}

    def send() -> None:
        result["response"] = httpx.post(tiny.base_url + "/v1/chat/completions",
                                        json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60)
        done.set()

    threading.Thread(target=send, daemon=True).start()
    while not done.wait(0.1):
        started = time.monotonic()
        assert httpx.get(tiny.base_url + "/health").status_code == 200
        assert time.monotonic() - started < LATENCY_LIMIT_S
    response = result["response"]
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages"
