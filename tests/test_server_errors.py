"""Every client mistake gets a 4xx in OpenAI's error shape, never a 500; loading is a 503.

Raw HTTP (httpx) against a real server on a loopback port, so malformed bodies reach the server
exactly as sent.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from server_helpers import ServerThread

from deepinfer.core.config import EngineConfig
from deepinfer.core.server.app import _build_engine
from deepinfer.core.server.config import ServerConfig

API_KEY = "test-key-123"
MAX_MODEL_LEN = 128
MAX_PROMPT_TOKENS = 64
MAX_BODY = 16 * 1024
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_dir):
    return str(tiny_llama_dir)


def engine_config(model: str, **overrides) -> EngineConfig:
    options = {"model": model, "device": "cpu", "dtype": "float32", "max_model_len": MAX_MODEL_LEN, "num_gpu_blocks": 64,
                   "max_num_seqs": 2, "max_waiting_requests": 2}
    return EngineConfig(**(options | overrides))


@pytest.fixture(scope="module")
def server(tiny_model):
    server_config = ServerConfig(api_key=API_KEY, served_model_name="tiny", max_prompt_tokens=MAX_PROMPT_TOKENS,
                                 max_body_bytes=MAX_BODY)
    running = ServerThread(engine_config(tiny_model), server_config).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=30) as http:
        yield http


def assert_error(response: httpx.Response, status: int, *needles: str) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    for needle in needles:
        assert needle in error["message"], (needle, error["message"])
    return error


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2} | fields


def test_valid_request_is_200(client):
    response = client.post("/v1/chat/completions", json=chat())
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_malformed_json_is_400(client):
    for raw in ['{"model": "tiny", "messages": [', "not json at all", '{"messages": [{"role": "user",}]}']:
        response = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert_error(response, 400, "JSON")


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": "5"}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"n": 1.5}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"messages": "Hello"}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"content": "no role"}]}, "messages.0.role"),
    ({"stop": 7}, "stop"),
    ({"top_p": 0}, "top_p"),
    ({"temperature": 3.0}, "temperature"),
    ({"presence_penalty": -5}, "presence_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
])
def test_wrong_types_and_ranges_are_400_naming_the_field(client, fields, param):
    error = assert_error(client.post("/v1/chat/completions", json=chat(**fields)), 400)
    assert error["param"] == param
    assert param in error["message"]


def test_values_json_allows_but_sampling_cannot_take_are_400(client):
    base = '{"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2, '
    for raw, param in [(base + '"temperature": NaN}', "temperature"), (base + '"top_p": Infinity}', "top_p"),
                       (base + '"seed": 100000000000000000000000}', "seed"),
                       (base + '"stop_token_ids": [99999999]}', "stop_token_ids"),
                       (base + '"stop": ' + json.dumps(["x"] * 17) + "}", "stop")]:
        response = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert assert_error(response, 400)["param"] == param, raw
    lone_surrogate = '{"model": "tiny", "messages": [{"role": "user", "content": "hi \\ud800"}]}'
    response = client.post("/v1/chat/completions", content=lone_surrogate, headers={"content-type": "application/json"})
    assert_error(response, 400, "not valid Unicode")


def test_body_that_is_not_an_object_is_400(client):
    assert_error(client.post("/v1/chat/completions", json=[1, 2]), 400, "must be a JSON object")
    assert_error(client.post("/v1/chat/completions", content=b"", headers={"content-type": "application/json"}),
                 400, "must be a JSON object")
    assert_error(client.post("/v1/completions", json={"model": "tiny"}), 400, "prompt")


def test_empty_messages_unknown_role_and_non_text_parts_are_400(client):
    assert_error(client.post("/v1/chat/completions", json=chat(messages=[])), 400, "at least one message")
    error = assert_error(client.post("/v1/chat/completions", json=chat(messages=[{"role": "wizard", "content": "x"}])),
                         400, "unknown role 'wizard'")
    assert error["param"] == "messages.0.role"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    assert_error(client.post("/v1/chat/completions", json=chat(messages=image)), 400, "only text parts")
    assert_error(client.post("/v1/chat/completions", json=chat(messages=[{"role": "user", "content": None}])), 400,
                 "content is required")


def test_options_that_cannot_be_combined_are_400(client):
    assert_error(client.post("/v1/chat/completions", json=chat(tools=[{"type": "function"}])), 400, "tools")
    assert_error(client.post("/v1/chat/completions", json=chat(top_logprobs=2)), 400, "requires logprobs")
    assert_error(client.post("/v1/chat/completions", json=chat(stream_options={"include_usage": True})), 400,
                 "stream")
    assert_error(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0}), 400, "only allowed with echo")
    assert_error(client.post("/v1/completions", json={"prompt": "x", "stream": True, "prompt_logprobs": 1}), 400,
                 "prompt_logprobs")
    assert_error(client.post("/v1/completions", json={"prompt": "x", "n": 2, "best_of": 3}), 400, "best_of")


def test_huge_max_tokens_is_400_with_both_numbers(client):
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 10**9})
    error = assert_error(response, 400, str(MAX_MODEL_LEN), str(10**9 + 4), "4 in the prompt")
    assert error["code"] == "context_length_exceeded"
    # exactly at the limit is fine (prompt 4 + 124 = 128)
    ok = client.post("/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": MAX_MODEL_LEN - 4, "stop": ["a"]})
    assert ok.status_code == 200, ok.text


def test_prompt_over_the_prompt_limit_is_400(client):
    prompt = list(range(10, 10 + MAX_PROMPT_TOKENS + 1))
    assert_error(client.post("/v1/completions", json={"prompt": prompt}), 400, str(MAX_PROMPT_TOKENS + 1),
                 str(MAX_PROMPT_TOKENS))
    ok = client.post("/v1/completions", json={"prompt": prompt[:MAX_PROMPT_TOKENS], "max_tokens": 1})
    assert ok.status_code == 200, ok.text


def test_token_ids_outside_the_vocabulary_are_400(client):
    assert_error(client.post("/v1/completions", json={"prompt": [1, 10**7]}), 400, "outside the vocabulary")
    assert_error(client.post("/v1/completions", json={"prompt": [1, -3]}), 400, "outside the vocabulary")


def test_n_too_large_is_400(client):
    assert_error(client.post("/v1/chat/completions", json=chat(n=1000)), 400, "n")
    assert_error(client.post("/v1/chat/completions", json=chat(n=3)), 400, "max_num_seqs")  # server runs 2 at once


def test_unknown_model_is_404(client):
    error = assert_error(client.post("/v1/chat/completions", json=chat(model="gpt-4")), 404, "gpt-4", "tiny")
    assert error["code"] == "model_not_found"
    assert_error(client.get("/v1/models/gpt-4"), 404)
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"


def test_api_key_is_required_on_v1_routes_only(server):
    url = server.base_url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        assert_error(httpx.get(url + "/v1/models", headers=headers), 401, "API key")
        assert_error(httpx.post(url + "/v1/chat/completions", json=chat(), headers=headers), 401)
    assert httpx.get(url + "/v1/models", headers=HEADERS).json()["data"][0]["id"] == "tiny"
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200


def test_anthropic_clients_send_the_key_as_x_api_key_and_get_anthropics_errors(server):
    url, body = server.base_url + "/v1/messages", {"model": "tiny", "max_tokens": 2,
                                                   "messages": [{"role": "user", "content": "Hello"}]}
    assert httpx.post(url, json=body, headers={"x-api-key": API_KEY}).status_code == 200
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong", "x-api-key": API_KEY}):
        refused = httpx.post(url, json=body, headers=headers)
        assert refused.status_code == 401
        assert refused.json() == {"type": "error", "error": {"type": "authentication_error", "message": (
            "missing or invalid API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')")}}
    too_large = httpx.post(url, json=body | {"system": "x" * MAX_BODY}, headers={"x-api-key": API_KEY})
    assert too_large.status_code == 413 and too_large.json()["error"]["type"] == "request_too_large"
    assert_error(httpx.post(server.base_url + "/v1/chat/completions", json=chat(), headers={"x-api-key": "wrong"}),
                 401, "API key")


def test_body_too_large_is_413(client):
    big = chat(messages=[{"role": "user", "content": "x" * MAX_BODY}])
    assert_error(client.post("/v1/chat/completions", json=big), 413, str(MAX_BODY))

    def chunks():  # no Content-Length: the limit must hold while reading
        body = json.dumps(big).encode()
        for start in range(0, len(body), 4096):
            yield body[start:start + 4096]

    assert_error(client.post("/v1/chat/completions", content=chunks(),
                             headers={"content-type": "application/json"}), 413)


def test_unknown_route_and_wrong_method_keep_the_error_shape(client):
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/chat/completions"), 405)


def test_full_queue_is_429(server):
    # 2 requests run and 2 wait; of 12 arriving at once, the ones beyond that are refused with a 429.
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 100, "ignore_eos": True}

    async def burst():
        async with httpx.AsyncClient(base_url=server.base_url, headers=HEADERS, timeout=60) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(12)))

    responses = asyncio.run(burst())
    refused = [r for r in responses if r.status_code == 429]
    served = [r for r in responses if r.status_code == 200]
    assert len(refused) + len(served) == 12 and len(refused) >= 1 and len(served) >= 2
    for response in refused:
        error = assert_error(response, 429, "queue is full")
        assert error["type"] == "rate_limit_error" and response.headers["retry-after"] == "1"
    assert all(r.json()["usage"]["completion_tokens"] == 100 for r in served)
    assert server.wait_idle()["blocks"]["num_used"] == 0


def test_503_while_loading_then_ready(tiny_model):
    release = threading.Event()

    def slow_factory(config):
        release.wait(30)
        return _build_engine(config)

    loading = ServerThread(engine_config(tiny_model), engine_factory=slow_factory).start(wait_ready=False)
    try:
        health = httpx.get(loading.base_url + "/health")
        assert health.status_code == 503 and health.json() == {"status": "loading"}
        assert_error(httpx.get(loading.base_url + "/v1/models"), 503, "loading")
        assert_error(httpx.post(loading.base_url + "/v1/completions", json={"prompt": "hi"}), 503, "loading")
        release.set()
        deadline = time.monotonic() + 60
        while httpx.get(loading.base_url + "/health").status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        health = httpx.get(loading.base_url + "/health").json()
        assert health["status"] == "ok"
        assert httpx.post(loading.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
    finally:
        release.set()
        loading.stop()


def test_load_failure_is_reported(tmp_path):
    failures = []
    broken = ServerThread(EngineConfig(model=str(tmp_path / "missing"), device="cpu"),
                          on_load_failed=failures.append).start(wait_ready=False)
    try:
        deadline = time.monotonic() + 30
        while broken.state.status == "loading" and time.monotonic() < deadline:
            time.sleep(0.05)
        health = httpx.get(broken.base_url + "/health")
        assert health.status_code == 503
        assert health.json()["status"] == "failed" and "missing" in health.json()["error"]
        assert len(failures) == 1
        assert_error(httpx.get(broken.base_url + "/v1/models"), 503, "failed to load")
    finally:
        broken.stop()
