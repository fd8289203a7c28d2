"""OpenAI's Responses API (stateless) through the official `openai` client's `responses.create`.

The model is the tiny random Llama with a Qwen2.5-like template that renders tools. References:
the chat completions endpoint (the Responses API runs on the chat path, so at temperature 0 the
same conversation gets the same text and usage), the non-streamed response for the streamed
one, jsonschema for function-call arguments and json_schema answers, and the API's event order.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from server_helpers import tools_template_server
from test_tool_parsers import QWEN_LIKE_TEMPLATE

NAME = "tiny"
INSTRUCTIONS = "You are brief."
WEATHER_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": WEATHER_SCHEMA, "strict": True}


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    running = tools_template_server(tiny_llama_dir, tmp_path_factory.mktemp("responses") / "model", QWEN_LIKE_TEMPLATE, NAME)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def answer(client):
    return client.responses.create(model=NAME, input="What is the capital of France?", instructions=INSTRUCTIONS,
                                   max_output_tokens=12, temperature=0)


def test_a_response_is_the_chat_paths_answer(client, answer):
    chat = client.chat.completions.create(model=NAME, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "What is the capital of France?"}])
    assert answer.object == "response" and answer.id.startswith("resp_") and answer.model == NAME
    assert [item.type for item in answer.output] == ["message"]
    assert answer.output_text == chat.choices[0].message.content
    finished = chat.choices[0].finish_reason
    assert answer.status == {"length": "incomplete", "stop": "completed"}[finished]
    if finished == "length":
        assert answer.incomplete_details.reason == "max_output_tokens"
    assert (answer.usage.input_tokens, answer.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                       chat.usage.completion_tokens)
    assert answer.store is False  # the API's default store: true is accepted; nothing is kept


def test_a_stream_sends_the_apis_events_and_the_same_response(client, answer):
    events = list(client.responses.create(model=NAME, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "What is the capital of France?"}]}],
        instructions=INSTRUCTIONS, max_output_tokens=12, temperature=0, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{answer.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == answer.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == answer.output_text and final.usage.output_tokens == answer.usage.output_tokens
    assert [item.status for item in final.output] == [item.status for item in answer.output]
    assert events[-2].item.status == answer.output[-1].status


def test_a_function_call_round_trip(client):
    forced = {"type": "function", "name": "get_weather"}
    first = client.responses.create(model=NAME, input="Weather in Paris?", tools=[WEATHER], tool_choice=forced,
                                    max_output_tokens=160, temperature=0)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)

    events = list(client.responses.create(model=NAME, input="Weather in Paris?", tools=[WEATHER],
                                          tool_choice=forced, max_output_tokens=160, temperature=0, stream=True))
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(fragments) > 1 and "".join(fragments) == done.arguments == call.arguments
    assert [item.type for item in events[-1].response.output] == ["function_call"]

    follow_up = [{"role": "user", "content": "Weather in Paris?"},
                 {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                 {"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": 21}'}]
    second = client.responses.create(model=NAME, input=follow_up, tools=[WEATHER], max_output_tokens=4,
                                     temperature=0)
    assert second.status in ("completed", "incomplete")
    chat = client.chat.completions.create(model=NAME, max_tokens=4, temperature=0, tools=[{
        "type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters", "strict")}}],
        messages=[{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [{
                      "id": call.call_id, "type": "function",
                      "function": {"name": call.name, "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": '{"celsius": 21}'}])
    assert second.usage.input_tokens == chat.usage.prompt_tokens > first.usage.input_tokens + 20


def test_text_format_json_schema_constrains_the_answer(client):
    schema = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                               "ok": {"type": "boolean"}},
              "required": ["unit", "ok"], "additionalProperties": False}
    reply = client.responses.create(model=NAME, input="Answer as JSON.", max_output_tokens=80, temperature=0,
                                    text={"format": {"type": "json_schema", "name": "answer", "schema": schema,
                                                     "strict": True}})
    assert reply.status == "completed"
    jsonschema.validate(json.loads(reply.output_text), schema)


@pytest.mark.parametrize("fields, message", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "stored"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input_image"),
    ({"tools": [{"type": "web_search"}]}, "function tools"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "not among"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"max_output_tokens": 100_000}, "context length"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "call_id"),
    ({"top_logprobs": 2}, "top_logprobs"),
])
def test_bad_requests_are_400s(server, fields, message):
    body = {"model": NAME, "input": "Hello", "max_output_tokens": 4} | fields
    response = httpx.post(server.base_url + "/v1/responses", json=body)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"], response.json()


def test_the_client_raises_on_stored_state(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=NAME, input="Hello", previous_response_id="resp_1", max_output_tokens=4)
    assert "keeps no state" in info.value.message
