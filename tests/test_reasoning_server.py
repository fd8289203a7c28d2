"""Reasoning output through the official `openai` client against a real server (CPU).

The model is tests/reasoning_model.py's tiny Qwen3: the real Qwen3 chat template, and a reply that
greedy decoding makes "<think>The capital</think>Paris." every time, so each split is checked
against a reply known in advance. References: that script, transformers' own apply_chat_template
for `enable_thinking: false`, and the non-streamed answer for the streamed one.
"""

from __future__ import annotations

import openai
import pytest
from reasoning_model import ANSWER, REASONING, qwen3_tokenizer, save_reasoning_model
from server_helpers import ServerThread

from deepinfer.core.config import EngineConfig
from deepinfer.core.server.config import ServerConfig

ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "max_tokens": 24}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_reasoning_model(tmp_path_factory.mktemp("reasoning") / "qwen3")


def start(model_dir, **server_fields):
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=512, max_num_seqs=4)
    return ServerThread(config, ServerConfig(served_model_name="qwen3", **server_fields)).start()


@pytest.fixture(scope="module")
def client(model_dir):
    server = start(model_dir)
    yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    server.stop()


def test_reasoning_is_returned_beside_the_content(client):
    reply = client.chat.completions.create(model="qwen3", messages=ASK, **GREEDY)
    message = reply.choices[0].message
    assert message.reasoning_content == REASONING
    assert message.content == ANSWER
    assert reply.choices[0].finish_reason == "stop"


def test_streamed_deltas_carry_reasoning_then_content(client):
    chunks = list(client.chat.completions.create(model="qwen3", messages=ASK, stream=True, **GREEDY))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(d.reasoning_content or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, content) == (REASONING, ANSWER)
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert all(not d.reasoning_content for d in deltas[first_content:])  # no reasoning after the answer began


def test_max_tokens_counts_the_reasoning(client):
    reply = client.chat.completions.create(model="qwen3", messages=ASK, temperature=0, max_tokens=3)
    assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.reasoning_content == "The capital"  # "<think>", "The", " capital"
    assert reply.choices[0].message.content == ""


def test_enable_thinking_false_reaches_the_template(client):
    reply = client.chat.completions.create(model="qwen3", messages=ASK, extra_body={
        "chat_template_kwargs": {"enable_thinking": False}}, **GREEDY)
    tokenizer = qwen3_tokenizer()
    reference = tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert reference.endswith("<think>\n\n</think>\n\n")
    assert reply.usage.prompt_tokens == len(tokenizer.encode(reference, add_special_tokens=False))
    assert reply.choices[0].message.reasoning_content is None  # the template closed the reasoning
    default = client.chat.completions.create(model="qwen3", messages=ASK, **GREEDY)
    assert reply.usage.prompt_tokens > default.usage.prompt_tokens


@pytest.mark.parametrize("constraint, content", [
    ({"guided_choice": ["London"]}, "London"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": {
        "type": "object", "properties": {"city": {"enum": ["Rome"]}}, "required": ["city"],
        "additionalProperties": False}}}}, '{"city": "Rome"}'),
])
def test_constraints_start_after_the_reasoning(client, constraint, content):
    reply = client.chat.completions.create(model="qwen3", messages=ASK, extra_body=constraint, **GREEDY)
    assert reply.choices[0].message.reasoning_content == REASONING  # left free, as the model wrote it
    assert reply.choices[0].message.content == content


def test_reasoning_parser_none_leaves_the_text_whole(model_dir):
    server = start(model_dir, reasoning_parser="none")
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="qwen3", messages=ASK, **GREEDY)
        assert reply.choices[0].message.content == f"<think>{REASONING}</think>{ANSWER}"
        assert getattr(reply.choices[0].message, "reasoning_content", None) is None
        # without the gate the constraint applies from the first token: no reasoning can start
        forced = client.chat.completions.create(model="qwen3", messages=ASK, extra_body={"guided_choice": ["London"]},
                                                **GREEDY)
        assert forced.choices[0].message.content == "London"
    finally:
        server.stop()


def test_reasoning_effort_and_template_kwargs_are_checked(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="qwen3", messages=ASK, reasoning_effort="low", **GREEDY)
    assert err.value.body["param"] == "reasoning_effort" and "does not use" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="qwen3", messages=ASK, extra_body={
            "chat_template_kwargs": {"messages": []}}, **GREEDY)
    assert err.value.body["param"] == "chat_template_kwargs"


def test_llm_chat_returns_both_parts(model_dir):
    from deepinfer import LLM, SamplingParams

    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=24)
    (output,) = llm.chat(ASK, params)
    sample = output.outputs[0]
    assert (sample.reasoning_content, sample.content) == (REASONING, ANSWER)
    assert sample.text == f"<think>{REASONING}</think>{ANSWER}"
    (closed,) = llm.chat(ASK, params, chat_template_kwargs={"enable_thinking": False})
    assert closed.outputs[0].reasoning_content is None
    (forced,) = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=24, structured_outputs={"choice": ["Rome"]}))
    assert (forced.outputs[0].reasoning_content, forced.outputs[0].content) == (REASONING, "Rome")
