"""Reasoning output through the official `openai` and `anthropic` clients against a real server (CPU).

The model is tests/reasoning_model.py's tiny Qwen3: the real Qwen3 chat template, and a reply that
greedy decoding makes "<think>The quick brown fox jumps over the lazy dog</think>Paris." every time, so each split is checked
against a reply known in advance. References: that script, transformers' own apply_chat_template
for `enable_thinking: false`, and the non-streamed answer for the streamed one. A reasoning budget
(`thinking_token_budget`, `thinking.budget_tokens`) must cut the scripted reasoning at exactly its
tokens ("The quick brown" is its first 5), after which the script's answer follows the forced end marker.
"""

from __future__ import annotations

import anthropic
import openai
import pytest
from reasoning_model import ANSWER, REASONING, qwen3_tokenizer, save_reasoning_model
from server_helpers import ServerThread

from deepinfer.core.config import EngineConfig
from deepinfer.core.server.config import ServerConfig

ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "max_tokens": 40}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_reasoning_model(tmp_path_factory.mktemp("reasoning") / "qwen3")


def start(model_dir, **server_fields):
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=512, max_num_seqs=4)
    return ServerThread(config, ServerConfig(served_model_name="qwen3", **server_fields)).start()


@pytest.fixture(scope="module")
def server(model_dir):
    running = start(model_dir)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def test_reasoning_is_returned_beside_the_content(client):
    reply = client.chat.completions.create(model="qwen3", messages=ASK, **GREEDY)
    message = reply.choices[0].message
    assert message.reasoning_content == REASONING
    assert message.content == ANSWER
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens_details.reasoning_tokens == 16  # the markers not counted


def test_streamed_deltas_carry_reasoning_then_content(client):
    chunks = list(client.chat.completions.create(model="qwen3", messages=ASK, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(d.reasoning_content or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, content) == (REASONING, ANSWER)
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 16
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert all(not d.reasoning_content for d in deltas[first_content:])  # no reasoning after the answer began


def test_max_tokens_counts_the_reasoning(client):
    reply = client.chat.completions.create(model="qwen3", messages=ASK, temperature=0, max_tokens=3)
    assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.reasoning_content == "The qu"  # "<think>", "The", " qu"
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


BUDGETED = "The quick brown"  # the reasoning's first 5 tokens: "The", " qu", "ick", " br", "own"


@pytest.mark.parametrize("constraint, content", [({}, ANSWER), ({"guided_choice": ["London"]}, "London")])
def test_thinking_token_budget_ends_the_reasoning_then_the_answer_follows(client, constraint, content):
    budget = {"thinking_token_budget": 5, **constraint}
    reply = client.chat.completions.create(model="qwen3", messages=ASK, extra_body=budget, **GREEDY)
    assert (reply.choices[0].message.reasoning_content, reply.choices[0].message.content) == (BUDGETED, content)
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens_details.reasoning_tokens == 5
    chunks = list(client.chat.completions.create(model="qwen3", messages=ASK, extra_body=budget, stream=True,
                                                 **GREEDY))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = ("".join(d.reasoning_content or "" for d in deltas), "".join(d.content or "" for d in deltas))
    assert streamed == (BUDGETED, content)


def test_a_budget_above_the_reasoning_changes_nothing(client):
    whole = client.chat.completions.create(model="qwen3", messages=ASK, extra_body={"thinking_token_budget": 16},
                                           **GREEDY)
    assert (whole.choices[0].message.reasoning_content, whole.choices[0].message.content) == (REASONING, ANSWER)
    cut = client.chat.completions.create(model="qwen3", messages=ASK, extra_body={"thinking_token_budget": 5},
                                         **GREEDY)
    assert whole.usage.completion_tokens - cut.usage.completion_tokens == 16 - 5


def test_messages_api_returns_thinking_blocks_capped_by_budget_tokens(claude):
    ask = {"model": "qwen3", "max_tokens": 40, "messages": ASK, "extra_body": {"temperature": 0}}
    plain = claude.messages.create(**ask)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in plain.content] == [
        ("thinking", REASONING), ("text", ANSWER)]
    capped = claude.messages.create(**ask, thinking={"type": "enabled", "budget_tokens": 5})
    assert [b.type for b in capped.content] == ["thinking", "text"]
    assert (capped.content[0].thinking, capped.content[1].text) == (BUDGETED, ANSWER)
    assert capped.stop_reason == "end_turn"
    with claude.messages.stream(**ask, thinking={"type": "enabled", "budget_tokens": 5}) as stream:
        thinking = "".join(e.delta.thinking for e in stream if e.type == "content_block_delta"
                           and e.delta.type == "thinking_delta")
        final = stream.get_final_message()
    assert thinking == BUDGETED
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in capped.content]
    silent = claude.messages.create(**ask, thinking={"type": "disabled"})
    assert [b.type for b in silent.content] == ["text"]  # the template closed the reasoning
    counted = claude.messages.count_tokens(model="qwen3", messages=ASK, thinking={"type": "disabled"})
    assert counted.input_tokens == silent.usage.input_tokens + silent.usage.cache_read_input_tokens
    assert counted.input_tokens > plain.usage.input_tokens + plain.usage.cache_read_input_tokens
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(**{**ask, "max_tokens": 5}, thinking={"type": "enabled", "budget_tokens": 5})
    assert "budget_tokens" in err.value.body["error"]["message"]


def test_responses_api_returns_a_reasoning_item(client):
    reply = client.responses.create(model="qwen3", input=ASK[0]["content"], max_output_tokens=40, temperature=0)
    assert [item.type for item in reply.output] == ["reasoning", "message"]
    assert reply.output[0].content[0].text == REASONING
    assert reply.output_text == ANSWER
    assert reply.usage.output_tokens_details.reasoning_tokens == 16
    events = list(client.responses.create(model="qwen3", input=ASK[0]["content"], max_output_tokens=40,
                                          temperature=0, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == REASONING
    assert events[-1].type == "response.completed"
    streamed = [item.model_dump(exclude={"id"}) for item in events[-1].response.output]
    assert streamed == [item.model_dump(exclude={"id"}) for item in reply.output]
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == 16


def test_a_budget_needs_single_token_markers():
    from conftest import build_tiny_tokenizer

    from deepinfer.core.reasoning import REASONING_PARSERS, Opening, ReasoningSplit
    from deepinfer.core.tokenizer import Tokenizer

    split = ReasoningSplit(REASONING_PARSERS["qwen3"], Opening.OPTIONAL)
    assert split.grammar_span(Tokenizer(build_tiny_tokenizer())) is None  # "<think>" is several tokens there
    with pytest.raises(ValueError, match="single tokens"):
        split.grammar_span(Tokenizer(build_tiny_tokenizer()), budget=5)
    tokenizer = qwen3_tokenizer()
    span = split.grammar_span(Tokenizer(tokenizer), budget=5)
    assert (span.start_token_id, span.end_token_id, span.budget) == (
        tokenizer.convert_tokens_to_ids("<think>"), tokenizer.convert_tokens_to_ids("</think>"), 5)


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
    params = SamplingParams(temperature=0, max_tokens=40)
    (output,) = llm.chat(ASK, params)
    sample = output.outputs[0]
    assert (sample.reasoning_content, sample.content) == (REASONING, ANSWER)
    assert sample.text == f"<think>{REASONING}</think>{ANSWER}"
    (closed,) = llm.chat(ASK, params, chat_template_kwargs={"enable_thinking": False})
    assert closed.outputs[0].reasoning_content is None
    (forced,) = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=40, structured_outputs={"choice": ["Rome"]}))
    assert (forced.outputs[0].reasoning_content, forced.outputs[0].content) == (REASONING, "Rome")
    (capped,) = llm.chat(ASK, params, thinking_token_budget=5)
    assert (capped.outputs[0].reasoning_content, capped.outputs[0].content) == (BUDGETED, ANSWER)
