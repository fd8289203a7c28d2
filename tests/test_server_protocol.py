"""The server's HTTP surface matches what it documents and what clients send.

The OpenAPI schema is checked with openapi-spec-validator and jsonschema against the server's own
answers; fields deepinfer lacks are each refused by name; HEAD, Content-Type, the bearer scheme,
CORS; completions with a list of prompts, echo and logit_bias through the `openai` client against
HF transformers' greedy generate; /tokenize and /detokenize against the HF tokenizer.
"""

from __future__ import annotations

import threading

import httpx
import jsonschema
import openai
import pytest
import torch
from openapi_spec_validator import validate as validate_openapi
from server_helpers import ServerThread

from deepinfer.core.config import EngineConfig
from deepinfer.core.server.config import ServerConfig
from deepinfer.core.server.unsupported import CHAT, COMPLETIONS, UNSUPPORTED_FIELDS

API_KEY = "sk-test"
NAME = "tiny"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def engine_config(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=256, num_gpu_blocks=96,
                        max_num_seqs=8)


@pytest.fixture(scope="module")
def server(tiny_models):
    model_dir, _ = tiny_models["llama"]
    running = ServerThread(engine_config(model_dir), ServerConfig(api_key=API_KEY, served_model_name=NAME,
                                                                  shutdown_timeout_s=1.0)).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=max_new_tokens,
                                pad_token_id=0, **kwargs)
    return out[0, len(prompt_ids):].tolist()


# The schema ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def schema(http) -> dict:
    response = http.get("/openapi.json")
    assert response.status_code == 200
    return response.json()


def test_openapi_schema_is_valid_and_has_no_422(schema):
    validate_openapi(schema)
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            assert "422" not in operation["responses"], (path, method)
    assert "HTTPValidationError" not in schema["components"]["schemas"]


def test_openapi_lists_the_statuses_and_content_types_the_server_answers(schema, server, http):
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"):
        responses = schema["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "400", "401", "404", "413", "415", "429", "503"}, path
        for status in ("400", "401", "404", "413", "415", "429", "503"):
            assert responses[status]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse")
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"):
        assert set(schema["paths"][path]["post"]["responses"]["200"]["content"]) == {
            "application/json", "text/event-stream"}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):  # Anthropic's error shape, as the server answers
        responses = schema["paths"][path]["post"]["responses"]
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("AnthropicErrorResponse")
        jsonschema.validate(http.post(path, json={"model": NAME}).json(), {
            "$ref": "#/components/schemas/AnthropicErrorResponse", "components": schema["components"]})
    stream = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True})
    assert stream.headers["content-type"].startswith("text/event-stream")
    metrics = httpx.get(server.base_url + "/metrics")
    assert list(schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == [
        metrics.headers["content-type"]]
    # every error the server sends has the documented shape
    error_schema = {"$ref": "#/components/schemas/ErrorResponse", "components": schema["components"]}
    for response in (http.post("/v1/completions", json={"prompt": 5}), httpx.get(server.base_url + "/v1/models"),
                     http.post("/v1/completions", content=b"{}"),
                     http.post("/v1/completions", json={"prompt": "x", "model": "nope"})):
        jsonschema.validate(response.json(), error_schema)


def test_integral_floats_and_long_stop_strings_are_what_the_schema_says(schema, http):
    body = {"model": NAME, "prompt": "Hello", "n": 2.0, "max_tokens": 3.0, "seed": 7.0, "top_k": 1.0,
            "stop": "a stop string far longer than sixteen characters", "temperature": 0}
    request_schema = {"$ref": "#/components/schemas/CompletionRequest", "components": schema["components"]}
    jsonschema.validate(body, request_schema, cls=jsonschema.Draft202012Validator)  # 2.0 is an integer
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert [c["index"] for c in response.json()["choices"]] == [0, 1]
    for bad in ({"n": 2.5}, {"n": True}, {"max_tokens": "3"}, {"stop": ["x"] * 17}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"prompt": "x"} | bad, request_schema, cls=jsonschema.Draft202012Validator)
        assert http.post("/v1/completions", json={"prompt": "x"} | bad).status_code == 400, bad


# HTTP details ----------------------------------------------------------------------------------------

def test_head_works_where_get_does(server, http):
    for path in ("/health", "/metrics", "/v1/models", f"/v1/models/{NAME}"):
        head, get = http.head(path), http.get(path)
        assert head.status_code == get.status_code == 200 and head.content == b"" and get.content, path
        assert head.headers["content-type"] == get.headers["content-type"], path
    assert http.head("/v1/completions").status_code == 405


@pytest.mark.parametrize("headers, needle", [
    ({}, "no Content-Type header"),
    ({"content-type": "application/x-www-form-urlencoded"}, "must be application/json"),
    ({"content-type": "text/plain"}, "must be application/json"),
])
def test_a_missing_or_wrong_content_type_is_named(server, headers, needle):
    response = httpx.post(server.base_url + "/v1/completions", content=b'{"prompt": "hi"}',
                          headers=HEADERS | headers)
    assert response.status_code == 415
    assert needle in response.json()["error"]["message"]
    ok = httpx.post(server.base_url + "/v1/completions", content=b'{"prompt": "hi", "max_tokens": 1}',
                    headers=HEADERS | {"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


@pytest.mark.parametrize("authorization", [f"bearer {API_KEY}", f"BEARER {API_KEY}", f"Bearer   {API_KEY}"])
def test_the_bearer_scheme_is_case_insensitive(server, authorization):
    assert httpx.get(server.base_url + "/v1/models", headers={"Authorization": authorization}).status_code == 200


def test_the_key_guards_everything_but_health_and_metrics(server):
    for path in ("/v1/models", "/openapi.json"):
        assert httpx.get(server.base_url + path).status_code == 401
        assert httpx.get(server.base_url + path, headers={"Authorization": f"Basic {API_KEY}"}).status_code == 401
    assert httpx.post(server.base_url + "/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/metrics").status_code == 200


def test_docs_need_no_cdn(http):
    """Swagger UI and ReDoc load their code from a CDN, so they are off; the schema itself is served."""
    assert http.get("/docs").status_code == 404 and http.get("/redoc").status_code == 404
    assert http.get("/openapi.json").json()["info"]["title"] == "deepinfer"


def test_health_is_read_on_the_engine_thread(server, http, monkeypatch):
    """The scheduler's numbers come from a snapshot the engine thread takes, never from the event loop."""
    llm_engine = server.engine.engine
    readers = []
    health = llm_engine.health

    def spy():
        readers.append(threading.current_thread().name)
        return health()

    monkeypatch.setattr(llm_engine, "health", spy)
    http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
    for _ in range(5):
        reported = http.get("/health").json()
        assert reported["scheduler"]["num_running"] <= reported["scheduler"]["max_num_seqs"]
    assert readers and set(readers) == {"deepinfer-engine"}
    assert http.get("/health").json()["scheduler"]["num_running"] == 0  # the idle state is reported exactly


# Fields deepinfer lacks, and those that change nothing -------------------------------------------------

UNSUPPORTED_CASES = [(field, endpoint) for field, entry in UNSUPPORTED_FIELDS.items()
                     for endpoint in sorted(entry.endpoints)]


def base_body(endpoint: str) -> tuple[str, dict]:
    if endpoint == CHAT:
        return "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}
    return "/v1/completions", {"prompt": "Hello", "max_tokens": 1}


SETTING_VALUES = {"tool_choice": "required", "function_call": {"name": "f"}, "response_format": {"type": "json_object"},
                  "modalities": ["text", "audio"], "min_tokens": 3, "spaces_between_special_tokens": False,
                  "tools": [{"type": "function", "function": {"name": "f"}}]}


@pytest.mark.parametrize("field, endpoint", UNSUPPORTED_CASES, ids=[f"{e}-{f}" for f, e in UNSUPPORTED_CASES])
def test_each_field_that_would_change_the_answer_is_refused_by_name(http, field, endpoint):
    path, body = base_body(endpoint)
    value = SETTING_VALUES.get(field, {"some": "value"} if field.endswith("kwargs") else True)
    response = http.post(path, json=body | {field: value})
    assert response.status_code == 400, (field, response.text)
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"]
    for no_op in UNSUPPORTED_FIELDS[field].no_op:  # its "ask for nothing" values are fine
        assert http.post(path, json=body | {field: no_op}).status_code == 200, (field, no_op)


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_fields_that_change_nothing_are_accepted(http, endpoint):
    path, body = base_body(endpoint)
    extras = {"store": True, "metadata": {"team": "a"}, "service_tier": "auto", "parallel_tool_calls": False,
              "user": "someone", "prediction": {"type": "content", "content": "x"}, "unknown_field": 1}
    assert http.post(path, json=body | extras).status_code == 200


# Completions: prompt lists, echo, logit_bias -----------------------------------------------------------

def test_a_list_of_prompts_gets_one_choice_per_prompt_and_sample(server, client, tiny_models, tiny_tokenizer):
    _, hf_model = tiny_models["llama"]
    prompts = ["Once upon a time", "The capital of France is", "Hello world"]
    reply = client.completions.create(model=NAME, prompt=prompts, temperature=0, max_tokens=5, n=2)
    assert [c.index for c in reply.choices] == list(range(6))
    expected = [hf_greedy(hf_model, tiny_tokenizer.encode(p), 5) for p in prompts]
    for index, choice in enumerate(reply.choices):
        assert choice.text == tiny_tokenizer.decode(expected[index // 2], skip_special_tokens=True)
    assert reply.usage.prompt_tokens == sum(len(tiny_tokenizer.encode(p)) for p in prompts)
    assert reply.usage.completion_tokens == 2 * sum(len(e) for e in expected)
    token_prompts = [tiny_tokenizer.encode(p) for p in prompts[:2]]
    by_ids = client.completions.create(model=NAME, prompt=token_prompts, temperature=0, max_tokens=5)
    assert [c.text for c in by_ids.choices] == [reply.choices[0].text, reply.choices[2].text]
    streamed = client.completions.create(model=NAME, prompt=prompts, temperature=0, max_tokens=5, stream=True)
    texts = [""] * 3
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [reply.choices[0].text, reply.choices[2].text, reply.choices[4].text]


def test_a_bad_prompt_in_a_list_is_named(http):
    response = http.post("/v1/completions", json={"prompt": [[1, 2], [3, 10**6]]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt.1"


def test_echo_puts_the_prompt_before_the_answer(client, tiny_tokenizer):
    prompt = "Once upon a time"
    plain = client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=4).choices[0].text
    echoed = client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=4, echo=True)
    assert echoed.choices[0].text == prompt + plain
    ids = tiny_tokenizer.encode(prompt)
    by_ids = client.completions.create(model=NAME, prompt=ids, temperature=0, max_tokens=4, echo=True)
    assert by_ids.choices[0].text == tiny_tokenizer.decode(ids) + plain
    streamed = client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=4, echo=True,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == prompt + plain


def test_logit_bias_matches_hf_sequence_bias(client, tiny_models, tiny_tokenizer):
    _, hf_model = tiny_models["llama"]
    prompt_ids = tiny_tokenizer.encode("The capital of France is")
    greedy = hf_greedy(hf_model, prompt_ids, 6)
    banned, forced = greedy[0], 77
    expected = hf_greedy(hf_model, prompt_ids, 6, sequence_bias={(banned,): -100.0})
    assert expected != greedy
    reply = client.completions.create(model=NAME, prompt=prompt_ids, temperature=0, max_tokens=6,
                                      logit_bias={str(banned): -100}, extra_body={"ignore_eos": True})
    assert reply.choices[0].text == tiny_tokenizer.decode(expected, skip_special_tokens=True)
    forced_reply = client.completions.create(model=NAME, prompt=prompt_ids, temperature=1.0, seed=1, max_tokens=4,
                                             logit_bias={str(forced): 100}, logprobs=0,
                                             extra_body={"ignore_eos": True})
    assert forced_reply.choices[0].logprobs.tokens == [tiny_tokenizer.decode([forced])] * 4
    chat = client.chat.completions.create(model=NAME, messages=MESSAGES, temperature=0, max_tokens=3,
                                          logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == tiny_tokenizer.decode([forced] * 3)


@pytest.mark.parametrize("bias", [{"999999": 1}, {"abc": 1}, {"-1": 1}, {"5": 101}])
def test_bad_logit_bias_is_a_400(http, bias):
    response = http.post("/v1/completions", json={"prompt": "x", "logit_bias": bias})
    assert response.status_code == 400 and response.json()["error"]["param"] == "logit_bias"


# /tokenize and /detokenize ---------------------------------------------------------------------------

def test_tokenize_and_detokenize_in_vllms_shape(http, tiny_tokenizer):
    text = "the quick brown fox"
    answer = http.post("/tokenize", json={"model": NAME, "prompt": text, "return_token_strs": True}).json()
    expected = tiny_tokenizer.encode(text)
    assert answer == {"count": len(expected), "max_model_len": 256, "tokens": expected,
                      "token_strs": tiny_tokenizer.convert_ids_to_tokens(expected)}
    bare = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == tiny_tokenizer.encode(text, add_special_tokens=False) and bare["token_strs"] is None
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
    rendered = tiny_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tiny_tokenizer.encode(rendered, add_special_tokens=False)
    assert http.post("/detokenize", json={"tokens": expected}).json() == {
        "prompt": tiny_tokenizer.decode(expected)}
    assert http.post("/detokenize", json={"tokens": [10**6]}).status_code == 400
    assert http.post("/tokenize", json={"prompt": text, "model": "other"}).status_code == 404


# CORS ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cors_server(tiny_models):
    model_dir, _ = tiny_models["llama"]
    running = ServerThread(engine_config(model_dir), ServerConfig(
        api_key=API_KEY, allowed_origins=["https://app.example"], shutdown_timeout_s=1.0)).start()
    yield running
    running.stop()


PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}


def test_cors_preflight_for_an_allowed_origin(cors_server):
    response = httpx.options(cors_server.base_url + "/v1/chat/completions",
                             headers={"Origin": "https://app.example"} | PREFLIGHT)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in response.headers["access-control-allow-methods"]
    assert "authorization" in response.headers["access-control-allow-headers"].lower()
    refused = httpx.get(cors_server.base_url + "/v1/models", headers={"Origin": "https://app.example"})
    assert refused.status_code == 401  # the key still applies, and the browser may read why
    assert refused.headers["access-control-allow-origin"] == "https://app.example"


def test_cors_refuses_other_origins_and_is_off_by_default(cors_server, server):
    other = httpx.options(cors_server.base_url + "/v1/chat/completions",
                          headers={"Origin": "https://evil.example"} | PREFLIGHT)
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    default = httpx.options(server.base_url + "/v1/chat/completions",
                            headers={"Origin": "https://app.example"} | PREFLIGHT)
    assert "access-control-allow-origin" not in default.headers
