"""The Messages and Responses APIs on the default model, SmolLM2-135M-Instruct (its GGUF, on the CPU),
through the official `anthropic` and `openai` clients.

References: SmolLM2's greedy answer to the capital question (the one tests/test_server_openai.py
holds on the chat endpoint), transformers' own chat-template rendering and tokenizer of the GGUF
for every prompt count, and the non-streamed answers for the streamed ones.
"""

from __future__ import annotations

import anthropic
import openai
import pytest
from server_helpers import ServerThread

from deepinfer.core.config import EngineConfig
from deepinfer.core.server.config import ServerConfig

NAME = "smollm2"
QUESTION = "What is the capital of France?"
PARIS = "The capital of France is Paris."
GREEDY = {"extra_body": {"temperature": 0}}  # the anthropic client's signature no longer has the sampling fields
CONVERSATION = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "And of Italy?"}]


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    config = EngineConfig(model=str(smollm2_gguf), device="cpu", dtype="float32", max_model_len=512)
    running = ServerThread(config, ServerConfig(served_model_name=NAME, shutdown_timeout_s=1.0)).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def prompt_tokens(server):
    """messages -> the prompt's token count as transformers renders the GGUF's chat template and tokenizes it
    (the server's tokenizer is the one transformers builds from the file; its template runs here unsandboxed,
    in transformers' own renderer)."""
    tokenizer = server.engine.tokenizer.hf_tokenizer

    def count(messages: list[dict]) -> int:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(tokenizer.encode(text, add_special_tokens=False))

    return count


def test_a_message_is_smollm2s_answer(claude, prompt_tokens):
    reply = claude.messages.create(model=NAME, max_tokens=12, messages=[{"role": "user", "content": QUESTION}],
                                   **GREEDY)
    assert [(block.type, block.text) for block in reply.content] == [("text", PARIS)]
    assert (reply.stop_reason, reply.stop_sequence) == ("end_turn", None)
    usage = reply.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == prompt_tokens([{"role": "user", "content": QUESTION}])


def test_a_streamed_message_sends_anthropics_events(claude):
    with claude.messages.stream(model=NAME, max_tokens=12, messages=[{"role": "user", "content": QUESTION}],
                                **GREEDY) as stream:
        events = [event.type for event in stream if event.type != "text"]  # "text": the client's own helper
        final = stream.get_final_message()
    assert events[:2] == ["message_start", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[2:-3]) == {"content_block_delta"}
    assert [block.text for block in final.content] == [PARIS] and final.stop_reason == "end_turn"


def test_stop_sequences_cut_the_message_and_name_themselves(claude):
    ask = {"model": NAME, "max_tokens": 12, "messages": [{"role": "user", "content": QUESTION}],
           "stop_sequences": ["Paris", "London"], **GREEDY}
    reply = claude.messages.create(**ask)
    assert [block.text for block in reply.content] == [PARIS[:PARIS.index("Paris")]]
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", "Paris")
    with claude.messages.stream(**ask) as stream:
        streamed = stream.get_final_message()
    assert (streamed.content[0].text, streamed.stop_sequence) == (reply.content[0].text, "Paris")


def test_count_tokens_is_the_tokenizers_count(claude, prompt_tokens):
    counted = claude.messages.count_tokens(model=NAME, system="You are brief.", messages=CONVERSATION)
    assert counted.input_tokens == prompt_tokens([{"role": "system", "content": "You are brief."}, *CONVERSATION])
    bare = claude.messages.count_tokens(model=NAME, messages=CONVERSATION)
    assert bare.input_tokens == prompt_tokens(CONVERSATION)  # the template's own default system prompt


def test_a_response_is_smollm2s_answer(client, prompt_tokens):
    reply = client.responses.create(model=NAME, input=QUESTION, max_output_tokens=12, temperature=0)
    assert [item.type for item in reply.output] == ["message"]
    assert reply.output_text == PARIS and reply.status == "completed"
    assert reply.usage.input_tokens == prompt_tokens([{"role": "user", "content": QUESTION}])
    assert reply.usage.output_tokens <= 12


def test_a_streamed_response_sends_the_apis_events(client):
    events = list(client.responses.create(model=NAME, input=[{"role": "user", "content": QUESTION}],
                                          max_output_tokens=12, temperature=0, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == PARIS
    assert events[-1].response.output_text == PARIS
