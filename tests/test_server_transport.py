"""The server under the clients a transport meets: HTTP/1.0 and `Connection: close` (urllib, curl -0,
nginx's default upstream), a reader that stops reading its stream, and request heads that a proxy
in front could read differently.

Every test talks to a real server over loopback with raw sockets or urllib. The model is a random
one-layer Llama with byte tokens (fast steps); the server's listening socket has a small send
buffer, as a slow network would give it, so a client that stops reading stalls the server's writes
after a few KiB instead of the kernel's autotuned megabytes.
"""

from __future__ import annotations

import gc
import json
import logging
import socket
import time
import urllib.request

import httpx
import pytest
from server_helpers import ServerThread

from deepinfer.core.config import EngineConfig
from deepinfer.core.engine.frontend.outputs import (
    CompletionOutput,
    PendingOutputs,
    RequestOutput,
    TokenLogprob,
)
from deepinfer.core.server.config import ServerConfig
from deepinfer.core.server.connection import MAX_HEAD_BYTES

REQUEST_TIMEOUT_S = 0.3
STREAM_WRITE_TIMEOUT_S = 1.0
API_KEY = "sk-transport"
SHAPE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
         "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
         "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
SERVER_SNDBUF = 16384  # accepted sockets inherit it from the listener


def start_server(tmp_path_factory, **server_options) -> ServerThread:
    shape = tmp_path_factory.mktemp("shape") / "tiny-llama.json"
    shape.write_text(json.dumps(SHAPE))
    config = EngineConfig(dummy_weights=True, shape=str(shape), device="cpu", dtype="float32", max_model_len=8192,
                          num_gpu_blocks=1200)
    server = ServerThread(config, ServerConfig(served_model_name="tiny", shutdown_timeout_s=1.0, **server_options))
    server._socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SERVER_SNDBUF)
    return server.start()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A request timeout far shorter than the generations below; the default write timeout."""
    running = start_server(tmp_path_factory, request_timeout_s=REQUEST_TIMEOUT_S)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """An API key and a short write timeout."""
    running = start_server(tmp_path_factory, api_key=API_KEY, stream_write_timeout_s=STREAM_WRITE_TIMEOUT_S)
    yield running
    running.stop()


def completion_body(max_tokens: int, stream: bool, **extra) -> bytes:
    body = {"prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {}), **extra}
    return json.dumps(body).encode()


def post(path: str, body: bytes, version: str = "1.1", headers: tuple[str, ...] = ()) -> bytes:
    lines = [f"POST {path} HTTP/{version}", "Host: x", "Content-Type: application/json",
             f"Content-Length: {len(body)}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(1 << 20):
        data += chunk
    return data


def exchange(server: ServerThread, request: bytes, timeout_s: float = 60.0, **socket_options) -> bytes:
    """Send `request` on a fresh connection; everything the server sends until it closes."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout_s) as sock:
        sock.sendall(request)
        return read_until_closed(sock)


def split_response(data: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    if headers.get("transfer-encoding") == "chunked":
        decoded = b""
        while True:
            size_line, _, body = body.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            decoded, body = decoded + body[:size], body[size + 2:]
        body = decoded
    return int(lines[0].split()[1]), headers, body


def sse_events(body: bytes) -> list[str]:
    return [line[len("data: "):] for line in body.decode().split("\n\n") if line.startswith("data: ")]


def streamed_completion(events: list[str]) -> tuple[int, int, str | None]:
    """(completion tokens per usage, tokens whose logprob arrived, the last finish_reason) of a stream that
    ended with [DONE]."""
    assert events and events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    finish = [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]]
    logprob_tokens = sum(len(c["logprobs"]["tokens"]) for chunk in chunks for c in chunk["choices"]
                         if c.get("logprobs"))
    return chunks[-1]["usage"]["completion_tokens"], logprob_tokens, finish[-1] if finish else None


# HTTP/1.0 and Connection: close ----------------------------------------------------------------------

GENERATION = 200  # tokens
STEP_DELAY_S = 0.005  # per engine step: the generation lasts at least GENERATION * STEP_DELAY_S = 1 s


@pytest.fixture()
def slow_steps(server):
    """Every engine step takes STEP_DELAY_S longer (a stats listener runs on the engine thread after
    each step), so a generation outlasts the request timeout however fast the machine is."""
    def delay(_stats) -> None:
        time.sleep(STEP_DELAY_S)

    server.engine.add_stats_listener(delay)
    yield
    server.engine._listeners.remove(delay)


@pytest.mark.usefixtures("slow_steps")
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("client", ["http/1.0", "connection-close", "urllib"])
def test_a_request_without_keep_alive_gets_its_whole_answer_past_the_request_timeout(server, client, stream):
    """The request deadline ends when the request is in: h11 then says "must close", not "done", for
    these clients. Before, the answer was cut at the deadline (a false 408, or a stream without [DONE])."""
    body = completion_body(GENERATION, stream)
    started = time.monotonic()
    if client == "urllib":  # sends `Connection: close` itself
        request = urllib.request.Request(server.base_url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            status, payload = response.status, response.read()
    else:
        version, headers = ("1.0", ()) if client == "http/1.0" else ("1.1", ("Connection: close",))
        status, _, payload = split_response(exchange(server, post("/v1/completions", body, version, headers)))
    assert time.monotonic() - started > GENERATION * STEP_DELAY_S > 3 * REQUEST_TIMEOUT_S
    assert status == 200, payload[:300]
    if stream:
        assert streamed_completion(sse_events(payload))[0::2] == (GENERATION, "length")
    else:
        answer = json.loads(payload)
        assert answer["usage"]["completion_tokens"] == GENERATION
        assert answer["choices"][0]["finish_reason"] == "length"


# A reader that stops reading ------------------------------------------------------------------------

GENERATED = ("deepinfer:generation_tokens_total", ())


def generated_tokens(server: ServerThread) -> float:
    return server.metrics()[GENERATED]


def wait_for(condition, timeout_s: float = 300.0, state=lambda: None) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"hang guard: {state()}"
        time.sleep(0.05)


def live_outputs() -> list[RequestOutput]:
    gc.collect()
    return [o for o in gc.get_objects() if type(o) is RequestOutput]


@pytest.mark.parametrize(("prompts", "n"), [(1, 1), (2, 1), (1, 2)], ids=["one", "two-prompts", "n=2"])
def test_a_stalled_stream_holds_one_pending_output_per_request(server, prompts, n):
    """A client that reads nothing while its stream is generated: the engine finishes it, and what the
    server holds meanwhile is, per engine request, its last output handled, its next one taken and one
    merged pending output, and the output being written (before: a snapshot per step, each with the whole
    text so far). Reading afterwards gets every token and its logprob once."""
    max_tokens = 500
    body = json.loads(completion_body(max_tokens, stream=True, logprobs=3, n=n))
    body["prompt"] = ["hi"] * prompts if prompts > 1 else "hi"
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(120)
        sock.connect(("127.0.0.1", server.port))
        before = generated_tokens(server)
        sock.sendall(post("/v1/completions", json.dumps(body).encode()))
        wait_for(lambda: generated_tokens(server) - before >= prompts * n * max_tokens,  # in full, nothing read
                 state=lambda: (generated_tokens(server) - before, server.engine.health()["scheduler"]))
        server.wait_idle(timeout_s=120)
        held = live_outputs()
        final_text = max((len(c.text) for o in held for c in o.outputs), default=0)
        data = read_until_closed_or_done(sock)
    bound = 3 * prompts + 1
    assert 0 < len(held) <= bound, [(o.request_id, len(o.outputs[0].token_ids)) for o in held]
    assert sum(len(c.text) for o in held for c in o.outputs) <= bound * n * final_text
    status, _, payload = split_response(data)
    assert status == 200
    completion_tokens, logprob_tokens, finish = streamed_completion(sse_events(payload))
    assert completion_tokens == logprob_tokens == prompts * n * max_tokens and finish == "length"


def read_until_closed_or_done(sock: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"0\r\n\r\n") and (chunk := sock.recv(1 << 20)):
        data += chunk
    return data


def test_a_stream_not_read_for_the_write_timeout_is_aborted_and_its_sequence_freed(keyed, caplog):
    """The write deadline drops the connection, the request is aborted (counted as one) and the engine
    has nothing running: long before the 6000 tokens asked for could have been generated."""
    max_tokens = 6000
    before = keyed.metrics()
    abort_key = ("deepinfer:request_success_total", (("finished_reason", "abort"),))
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(60)
        sock.connect(("127.0.0.1", keyed.port))
        with caplog.at_level(logging.WARNING, logger="deepinfer.server"):
            sock.sendall(post("/v1/completions", completion_body(max_tokens, stream=True, logprobs=3),
                              headers=(f"Authorization: Bearer {API_KEY}",)))
            wait_for(lambda: generated_tokens(keyed) > before[GENERATED])
            health = keyed.wait_idle(timeout_s=60)
        try:
            data = read_until_closed(sock)
        except ConnectionResetError:
            data = b""
    after = keyed.metrics()
    assert health["blocks"]["num_used"] == 0
    assert after[abort_key] == before[abort_key] + 1
    generated = after[GENERATED] - before[GENERATED]
    assert 0 < generated < max_tokens
    assert b"data: [DONE]" not in data
    assert any("has read nothing of its response" in r.getMessage() and "aborting its request" in r.getMessage()
               for r in caplog.records)
    assert httpx.get(keyed.base_url + "/health").status_code == 200


def test_pending_outputs_merge_deltas_in_order_and_keep_the_newest_state():
    """Against the sequence itself: the merged deltas are the concatenation of every step's, the other
    fields the last step's."""
    steps = [("ab", [5, 6], None), ("", [], None), ("c", [7], "length")]
    pending = PendingOutputs()
    text, ids = "", []
    for delta_text, delta_ids, finish in steps:
        text, ids = text + delta_text, ids + delta_ids
        logprobs = [TokenLogprob(t, -float(t), []) for t in delta_ids]
        completion = CompletionOutput(index=0, text=text, token_ids=list(ids), finish_reason=finish,
                                      delta_text=delta_text, delta_token_ids=list(delta_ids), delta_logprobs=logprobs)
        pending.add(RequestOutput("r", None, [1], [completion], finished=finish is not None))
    merged = pending.take()
    assert not pending
    out = merged.outputs[0]
    assert (out.delta_text, out.delta_token_ids, out.text, out.finish_reason) == ("abc", [5, 6, 7], "abc", "length")
    assert [lp.token_id for lp in out.delta_logprobs] == [5, 6, 7] and merged.finished
    pending.add(RequestOutput("r", None, [1], [CompletionOutput(index=0, delta_text="d", delta_token_ids=[8])],
                              finished=False))
    assert pending.take().outputs[0].delta_token_ids == [8]  # a take starts the merge afresh


# Strict request heads (raw sockets) --------------------------------------------------------------------

def get_health(extra_headers: bytes = b"", version: str = "1.1") -> bytes:
    return f"GET /health HTTP/{version}\r\nHost: x\r\nConnection: close\r\n".encode() + extra_headers + b"\r\n"


def error_of(data: bytes) -> tuple[int, str]:
    status, _, body = split_response(data)
    return status, json.loads(body)["error"]["code"]


@pytest.mark.parametrize("segments", [1, 3], ids=["one-segment", "three-segments"])
def test_a_head_over_the_cap_is_a_431_however_it_is_segmented(server, segments):
    padding = b"X-Padding: " + b"a" * (MAX_HEAD_BYTES - 200) + b"\r\n"
    fits = get_health(padding)
    assert len(fits) <= MAX_HEAD_BYTES
    assert split_response(exchange(server, fits))[0] == 200
    over = get_health(padding + b"X-More: " + b"b" * 400 + b"\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        step = -(-len(over) // segments)
        for start in range(0, len(over), step):
            sock.sendall(over[start:start + step])
            time.sleep(0.02)
        assert error_of(read_until_closed(sock)) == (431, "headers_too_large")


@pytest.mark.parametrize("head", [
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: 1\nX-B: 2\r\n\r\n",  # a bare LF inside the headers
    b"GET /health HTTP/1.1\nHost: x\r\n\r\n",  # after the request line
    b"GET /health HTTP/1.1\r\nHost: x\n\n",  # ending the head
], ids=["inside", "request-line", "end"])
def test_a_bare_lf_in_the_head_is_a_400(server, head):
    assert error_of(exchange(server, head)) == (400, "malformed_request")


def test_transfer_encoding_beside_content_length_is_a_400_and_the_connection_closes(server):
    """A proxy that frames by Content-Length would see the second request as body; h11 frames by
    Transfer-Encoding and would answer it. Neither happens: one 400, then the connection closes."""
    smuggled = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + str(5 + len(smuggled)).encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"0\r\n\r\n" + smuggled)
    data = exchange(server, request)
    assert error_of(data) == (400, "malformed_request")
    assert data.count(b"HTTP/1.1 ") == 1


@pytest.mark.parametrize("version", ["1.0", "1.1"])
def test_a_client_that_sends_a_large_body_in_full_reads_the_413(server, version):
    """The 413 goes out at once from Content-Length; the connection then lingers, discarding the body,
    until the client closes: closed at once, the kernel resets it over the unread bytes and the client
    sees ECONNRESET instead of the answer."""
    body = b'{"prompt": "' + b"a" * 13_000_000 + b'"}'
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(post("/v1/completions", body, version, ("Connection: close",)))
        assert error_of(read_until_closed(sock)) == (413, "body_too_large")


def test_two_authorization_headers_are_a_400(keyed):
    good = f"Authorization: Bearer {API_KEY}\r\n".encode()
    models = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    assert split_response(exchange(keyed, models + good + b"\r\n"))[0] == 200
    for pair in (good + b"Authorization: Bearer wrong\r\n", b"Authorization: Bearer wrong\r\n" + good, good + good):
        assert error_of(exchange(keyed, models + pair + b"\r\n")) == (400, "duplicate_authorization")
