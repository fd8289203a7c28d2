"""Structured outputs and tool calling through the official `openai` client, on SmolLM2 (CPU).

One server for the module; requests go out concurrently (AsyncOpenAI) so the engine batches them.
References: jsonschema for every JSON answer and every tool call's arguments, re.fullmatch for
regex answers, the choice list, and the non-streaming answer for the streamed one.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from server_helpers import ServerThread
from test_structured_grammars import SCHEMAS

from deepinfer.core.config import EngineConfig
from deepinfer.core.server.config import ServerConfig

NAME = "smol"
ASK_JSON = [{"role": "user", "content": "Describe a fictional person as JSON."}]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"enum": ["Paris", "London", "Tokyo"]}},
    "required": ["name", "age", "city"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}, "strict": True}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}, "strict": True}}
PARAMETERS = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    config = EngineConfig(model=str(smollm2_gguf), device="cpu", dtype="float32", max_model_len=1024,
                          max_num_seqs=16)
    server = ServerThread(config, ServerConfig(served_model_name=NAME)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def gather(server, calls):
    """Run `calls` (functions of an AsyncOpenAI client returning coroutines) concurrently."""
    async def run():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(call(client) for call in calls))

    return asyncio.run(run())


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def random_schemas(count: int) -> list[dict]:
    """`count` schemas drawn by hypothesis (a fixed seed: the same ones every run)."""
    drawn = []

    @seed(20260101)
    @settings(max_examples=count, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(SCHEMAS)
    def collect(schema):
        drawn.append(schema)

    collect()
    return drawn


def test_random_schemas_at_temperature_0_and_1_validate(server):
    schemas = [PERSON, *random_schemas(10)]
    assert len({json.dumps(s) for s in schemas}) >= 6
    calls = [
        (lambda c, s=s, t=t, i=i: c.chat.completions.create(
            model=NAME, messages=ASK_JSON, max_tokens=120, temperature=t, seed=i,
            response_format=json_schema_format(s)))
        for i, s in enumerate(schemas) for t in (0.0, 1.0)]
    replies = gather(server, calls)
    finished = 0
    for (schema, reply) in zip([s for s in schemas for _ in (0, 1)], replies):
        choice = reply.choices[0]
        if choice.finish_reason == "stop":
            finished += 1
            jsonschema.validate(json.loads(choice.message.content), schema)
        else:
            assert choice.finish_reason == "length"
    assert finished >= len(replies) - 2


def test_every_way_of_asking_for_a_constraint(server):
    """response_format, structured_outputs, guided_*, llama.cpp's grammar; chat and completions."""
    regex = r"(Yes|No), because [a-z ]{5,30}\."
    choices = ["Paris", "Lyon", "Marseille"]
    gbnf = 'root ::= "The capital is " city "."\ncity ::= "Paris" | "Rome"'
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    chat = [
        ({"response_format": {"type": "json_object"}}, "json_object"),
        ({"extra_body": {"structured_outputs": {"json": PERSON}}}, PERSON),
        ({"extra_body": {"guided_json": PERSON}}, PERSON),
        ({"extra_body": {"structured_outputs": {"regex": regex}}}, regex),
        ({"extra_body": {"guided_regex": regex}}, regex),
        ({"extra_body": {"structured_outputs": {"choice": choices}}}, choices),
        ({"extra_body": {"guided_choice": choices}}, choices),
        ({"extra_body": {"guided_grammar": gbnf}}, "gbnf"),
        ({"extra_body": {"grammar": gbnf}}, "gbnf"),
    ]
    completions = [
        ({"extra_body": {"guided_choice": choices}}, choices),
        ({"extra_body": {"guided_regex": regex}}, regex),
        ({"extra_body": {"response_format": json_schema_format(PERSON)}}, PERSON),
    ]
    calls = [lambda c, kw=kw: c.chat.completions.create(model=NAME, messages=ask, max_tokens=60, temperature=0,
                                                        **kw) for kw, _ in chat]
    calls += [lambda c, kw=kw: c.completions.create(model=NAME, prompt="The capital of France is", max_tokens=60,
                                                    temperature=0, **kw) for kw, _ in completions]
    replies = gather(server, calls)
    for (_, expected), reply in zip(chat + completions, replies):
        choice = reply.choices[0]
        text = choice.message.content if hasattr(choice, "message") else choice.text
        assert choice.finish_reason == "stop", (expected, text)
        if expected == "json_object":
            assert isinstance(json.loads(text), dict)
        elif expected == "gbnf":
            assert text in ("The capital is Paris.", "The capital is Rome.")
        elif isinstance(expected, list):
            assert text in expected
        elif isinstance(expected, str):
            assert re.fullmatch(expected, text), text
        else:
            jsonschema.validate(json.loads(text), expected)


def test_streaming_and_n_samples(client):
    schema = json_schema_format(PERSON)
    plain = client.chat.completions.create(model=NAME, messages=ASK_JSON, max_tokens=80, temperature=0,
                                           response_format=schema)
    stream = client.chat.completions.create(model=NAME, messages=ASK_JSON, max_tokens=80, temperature=0,
                                            response_format=schema, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == plain.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    several = client.chat.completions.create(model=NAME, messages=ASK_JSON, max_tokens=80, temperature=1.0, seed=7,
                                             n=3, response_format=schema)
    assert len(several.choices) == 3
    for choice in several.choices:
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert sum(c.finish_reason == "stop" for c in several.choices) >= 2


def assert_calls_validate(tool_calls, names=None):
    assert tool_calls
    for call in tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_tool_choice_required_and_named_streamed_and_not(server, client):
    named = {"type": "function", "function": {"name": "get_time"}}
    requests = [{"tool_choice": "required"}, {"tool_choice": "required", "parallel_tool_calls": False},
                {"tool_choice": named}]
    replies = gather(server, [
        lambda c, kw=kw: c.chat.completions.create(model=NAME, messages=ASK_WEATHER, tools=[WEATHER, TIME],
                                                   max_tokens=80, temperature=0, **kw) for kw in requests])
    for kw, reply in zip(requests, replies):
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        names = ["get_time"] if kw["tool_choice"] == named else None
        assert_calls_validate(choice.message.tool_calls, names)
        if kw.get("parallel_tool_calls") is False or kw["tool_choice"] == named:
            assert len(choice.message.tool_calls) == 1

    stream = client.chat.completions.create(model=NAME, messages=ASK_WEATHER, tools=[WEATHER, TIME], max_tokens=80,
                                            temperature=0, tool_choice=named, stream=True)
    calls, finish = {}, None
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"id": delta.id, "name": delta.function.name, "arguments": ""})
            assert delta.id in (None, entry["id"])
            entry["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls"
    want = replies[2].choices[0].message.tool_calls
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in want]
    assert all(c["id"] and c["id"].startswith("call_") for c in calls.values())


def test_a_conversation_with_a_tool_result_continues(client):
    first = client.chat.completions.create(model=NAME, messages=ASK_WEATHER, tools=[WEATHER], max_tokens=60,
                                           temperature=0, tool_choice="required", parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    conversation = [*ASK_WEATHER,
                    {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'}]
    reply = client.chat.completions.create(model=NAME, messages=conversation, tools=[WEATHER], max_tokens=30,
                                           temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    assert reply.usage.prompt_tokens > first.usage.prompt_tokens + 20  # the call and the result are in the prompt
    none = client.chat.completions.create(model=NAME, messages=conversation, tools=[WEATHER], max_tokens=5,
                                          temperature=0, tool_choice="none")
    assert none.choices[0].message.tool_calls is None


@pytest.mark.parametrize("kwargs, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "json"),
    ({"extra_body": {"guided_regex": "(?<=x)y"}}, "regex"),
    ({"extra_body": {"guided_grammar": "root ::= undefined_rule"}}, "grammar"),
    ({"extra_body": {"guided_json": {"type": "array", "uniqueItems": True}}}, "uniqueItems"),
    ({"extra_body": {"guided_regex": "a" * 140_000}}, "characters; at most"),
    ({"extra_body": {"guided_regex": "a", "guided_choice": ["a"]}}, "one structured output"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "combined"),
])
def test_bad_constraints_are_400s_with_the_engines_message(client, kwargs, message):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=ASK_JSON, max_tokens=5, **kwargs)
    assert message in info.value.message


@pytest.mark.parametrize("extra_body, param", [
    ({"structured_outputs": {"regex": "(?<=x)y"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs.grammar"),
    ({"guided_regex": "(?<=x)y"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
])
def test_a_constraint_the_grammar_engine_refuses_names_its_own_field(client, extra_body, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=ASK_JSON, max_tokens=5, extra_body=extra_body)
    assert info.value.body["param"] == param
