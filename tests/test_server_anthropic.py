"""Anthropic's Messages API through the official `anthropic` client, against a real server.

The model is the tiny random Llama with a Qwen2.5-like template that renders tools. References:
the chat completions endpoint (the Messages API runs on the chat path, so at temperature 0 the
same conversation gets the same text and prompt tokens), the non-streamed answer for the streamed
one, jsonschema for a forced tool call's input and a json_schema answer, and Anthropic's documented
event order and error shape.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from server_helpers import tools_template_server
from test_tool_parsers import QWEN_LIKE_TEMPLATE

NAME = "tiny"
WEATHER_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER_SCHEMA}
CONVERSATION = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": [{"type": "text", "text": "Paris."}]},
                {"role": "user", "content": [{"type": "text", "text": "And of the fox?"}]}]
SYSTEM = "You are brief."
GREEDY = {"extra_body": {"temperature": 0}}  # the client's own signature no longer has the sampling fields


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    running = tools_template_server(tiny_llama_dir, tmp_path_factory.mktemp("anthropic") / "model", QWEN_LIKE_TEMPLATE, NAME)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def answer(client):
    return client.messages.create(model=NAME, max_tokens=12, system=SYSTEM, messages=CONVERSATION,
                                  metadata={"user_id": "someone"}, **GREEDY)


def test_a_message_is_the_chat_paths_answer(server, answer):
    chat = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0).chat.completions.create(
        model=NAME, max_tokens=12, temperature=0, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of the fox?"}])
    assert answer.type == "message" and answer.role == "assistant" and answer.model == NAME
    assert answer.id.startswith("msg_")
    assert [block.type for block in answer.content] == ["text"]
    assert answer.content[0].text == chat.choices[0].message.content
    expected = {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert answer.stop_reason == expected and answer.stop_sequence is None
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert answer.usage.output_tokens == chat.usage.completion_tokens


def test_a_stream_sends_anthropics_events_and_the_same_message(client, answer):
    with client.messages.stream(model=NAME, max_tokens=12, system=[{"type": "text", "text": SYSTEM}],
                                messages=CONVERSATION, **GREEDY) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start"
    assert events[-2:] == ["message_delta", "message_stop"]
    blocks = [e for e in events if e.startswith("content_block")]
    assert blocks[0] == "content_block_start" and blocks[-1] == "content_block_stop"
    assert set(blocks[1:-1]) <= {"content_block_delta", "text"}
    assert final.content[0].text == answer.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (answer.stop_reason, answer.usage.output_tokens)


def test_stop_sequences_end_the_message_and_say_which(client, answer):
    text = answer.content[0].text
    stop = next(text[i:i + 2] for i in range(3, len(text) - 1) if text[i:i + 2].strip())
    stopped = client.messages.create(model=NAME, max_tokens=12, system=SYSTEM, messages=CONVERSATION, **GREEDY,
                                     stop_sequences=["never written", stop])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stopped.content[0].text == text[:text.index(stop)]
    with client.messages.stream(model=NAME, max_tokens=12, system=SYSTEM, messages=CONVERSATION,
                                stop_sequences=[stop], **GREEDY) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)
    assert streamed.content[0].text == stopped.content[0].text


def test_output_config_format_constrains_the_answer_which_ends_its_turn(client):
    schema = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "ok": {"type": "boolean"}},
              "required": ["unit", "ok"], "additionalProperties": False}
    reply = client.messages.create(model=NAME, max_tokens=80, messages=[{"role": "user", "content": "JSON, please."}],
                                   output_config={"format": {"type": "json_schema", "schema": schema}}, **GREEDY)
    assert (reply.stop_reason, reply.stop_sequence) == ("end_turn", None)  # the grammar ended it: end of sequence
    jsonschema.validate(json.loads(reply.content[0].text), schema)


def test_count_tokens_counts_the_prompt_as_the_model_sees_it(client, answer):
    counted = client.messages.count_tokens(model=NAME, system=SYSTEM, messages=CONVERSATION)
    assert counted.input_tokens == answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    with_tools = client.messages.count_tokens(model=NAME, system=SYSTEM, messages=CONVERSATION, tools=[WEATHER])
    assert with_tools.input_tokens > counted.input_tokens + 20  # the template lists the tool's schema


def test_a_forced_tool_call_streams_and_its_result_goes_back(client):
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    forced = {"type": "tool", "name": "get_weather"}
    call = client.messages.create(model=NAME, max_tokens=160, messages=ask, tools=[WEATHER], tool_choice=forced,
                                  **GREEDY)
    assert call.stop_reason == "tool_use"
    (use,) = [block for block in call.content if block.type == "tool_use"]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER_SCHEMA)

    with client.messages.stream(model=NAME, max_tokens=160, messages=ask, tools=[WEATHER], tool_choice=forced,
                                **GREEDY) as stream:
        fragments = [e.delta.partial_json for e in stream if e.type == "content_block_delta"
                     and e.delta.type == "input_json_delta"]
        final = stream.get_final_message()
    assert len(fragments) > 1
    streamed = [block for block in final.content if block.type == "tool_use"]
    assert [(b.name, b.input) for b in streamed] == [(use.name, use.input)]
    assert final.stop_reason == "tool_use"

    conversation = [*ask, {"role": "assistant", "content": [block.model_dump() for block in call.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                  "content": [{"type": "text", "text": "21 C, sunny"}]}]}]
    reply = client.messages.create(model=NAME, max_tokens=4, messages=conversation, tools=[WEATHER], **GREEDY)
    assert reply.stop_reason in ("max_tokens", "end_turn", "tool_use")
    counted = client.messages.count_tokens(model=NAME, messages=conversation, tools=[WEATHER])
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == counted.input_tokens
    asked = client.messages.count_tokens(model=NAME, messages=ask, tools=[WEATHER])
    assert counted.input_tokens > asked.input_tokens + len("21 C, sunny") // 2  # the call and its result are in


@pytest.mark.parametrize("fields, message", [
    ({"max_tokens": None}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"messages": []}, "at least one message"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'image'"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "tool_use_id"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tool"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "not among"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"thinking": {"type": "enabled", "budget_tokens": 16}}, "budget_tokens"),
    ({"max_tokens": 100_000}, "context length"),
])
def test_bad_requests_are_400s_in_anthropics_shape(server, fields, message):
    body = {"model": NAME, "max_tokens": 8, "messages": CONVERSATION} | fields
    response = httpx.post(server.base_url + "/v1/messages", json={k: v for k, v in body.items() if v is not None})
    assert response.status_code == 400, response.text
    error = response.json()
    assert set(error) == {"type", "error"} and error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert message in error["error"]["message"], error


def test_the_client_raises_anthropics_errors(server, client):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=NAME, max_tokens=8, messages=[
            {"role": "user", "content": [{"type": "document", "source": {"type": "text", "data": "x"}}]}])
    assert "'document'" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="claude-opus", max_tokens=8, messages=CONVERSATION)
    assert info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model=NAME, messages=[])
    not_json = httpx.post(server.base_url + "/v1/messages", content=b"{oops",
                          headers={"content-type": "application/json"})
    assert not_json.status_code == 400
    assert not_json.json()["type"] == "error" and "JSON" in not_json.json()["error"]["message"]
