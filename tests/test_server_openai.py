"""The OpenAI API as the official `openai` client sees it, against a real server on a loopback port.

Reference answers come from HF transformers (greedy generate and log-softmax of the same tiny
random model), so the server is checked end to end: chat template, tokenization, sampling
parameters, streaming, logprobs, usage. The SmolLM2 GGUF answers "Paris" as HF does.
"""

from __future__ import annotations

import math
import re
import signal
import subprocess
import sys

import httpx
import openai
import pytest
import torch
from server_helpers import ServerThread, free_port, wait_until_healthy

from deepinfer.core.config import EngineConfig
from deepinfer.core.server.config import ServerConfig

NAME = "tiny-llama"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tiny(tiny_models, tiny_tokenizer):
    """(server, openai client, HF reference model, HF tokenizer) on the tiny random Llama."""
    model_dir, hf_model = tiny_models["llama"]
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=256, num_gpu_blocks=128,
                          max_num_seqs=8)
    server = ServerThread(config, ServerConfig(served_model_name=NAME)).start()
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield server, client, hf_model, tiny_tokenizer
    server.stop()


def chat_prompt_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=max_new_tokens,
                                pad_token_id=0, **kwargs)
    return out[0, len(prompt_ids):].tolist()


def hf_next_token_logprobs(hf_model, prompt_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids])).logits[0, -1].float()
    return torch.log_softmax(logits, dim=-1)


def test_models_lists_the_served_name(tiny):
    _, client, _, _ = tiny
    models = client.models.list().data
    assert [m.id for m in models] == [NAME]


def test_chat_greedy_matches_hf_generate(tiny):
    _, client, hf_model, tokenizer = tiny
    prompt_ids = chat_prompt_ids(tokenizer, QUESTION)
    expected = hf_greedy(hf_model, prompt_ids, 10)
    reply = client.chat.completions.create(model=NAME, messages=QUESTION, temperature=0, max_tokens=10)
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert choice.finish_reason == ("stop" if expected[-1] == tokenizer.eos_token_id else "length")
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.usage.completion_tokens == len(expected)
    assert reply.usage.total_tokens == len(prompt_ids) + len(expected)
    assert reply.model == NAME and reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")


def test_chat_stream_with_usage_equals_the_plain_answer(tiny):
    _, client, _, _ = tiny
    args = {"model": NAME, "messages": QUESTION, "temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
    plain = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    *content_chunks, usage_chunk = chunks
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 12 == plain.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == plain.usage.prompt_tokens
    assert all(c.usage is None for c in content_chunks)
    assert content_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in content_chunks) == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in content_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in content_chunks[:-1])
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_completion_stream_and_plain_agree_without_usage(tiny):
    _, client, hf_model, tokenizer = tiny
    prompt = "Once upon a time"
    plain = client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=8)
    expected = hf_greedy(hf_model, tokenizer.encode(prompt), 8)
    assert plain.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    assert plain.object == "text_completion" and plain.usage.prompt_tokens == len(tokenizer.encode(prompt))
    chunks = list(client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=8, stream=True))
    assert all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text


def test_completion_accepts_token_ids(tiny):
    _, client, hf_model, tokenizer = tiny
    prompt_ids = tokenizer.encode("the quick brown fox")
    reply = client.completions.create(model=NAME, prompt=prompt_ids, temperature=0, max_tokens=6)
    assert reply.choices[0].text == tokenizer.decode(hf_greedy(hf_model, prompt_ids, 6), skip_special_tokens=True)
    assert reply.usage.prompt_tokens == len(prompt_ids)


def test_completion_logprobs_match_hf(tiny):
    _, client, hf_model, tokenizer = tiny
    prompt = "Hello world"
    reply = client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=5, logprobs=3,
                                      extra_body={"ignore_eos": True})
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    reference = hf_next_token_logprobs(hf_model, tokenizer.encode(prompt))
    top3 = torch.topk(reference, 3)
    expected_top = {tokenizer.decode([i], skip_special_tokens=False): v for i, v in
                    zip(top3.indices.tolist(), top3.values.tolist(), strict=True)}
    assert logprobs.tokens[0] == tokenizer.decode([top3.indices[0].item()], skip_special_tokens=False)
    assert math.isclose(logprobs.token_logprobs[0], top3.values[0].item(), abs_tol=1e-4)
    assert set(logprobs.top_logprobs[0]) == set(expected_top)
    for token, value in expected_top.items():
        assert math.isclose(logprobs.top_logprobs[0][token], value, abs_tol=1e-4)
    # greedy: each chosen token is the best of its alternatives; offsets walk the token texts
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert math.isclose(value, max(top.values()), abs_tol=1e-6) and top[token] == value
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]
    assert "".join(logprobs.tokens) == reply.choices[0].text


def test_chat_logprobs_shape_and_values(tiny):
    _, client, hf_model, tokenizer = tiny
    reply = client.chat.completions.create(model=NAME, messages=QUESTION, temperature=0, max_tokens=4,
                                           logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    assert len(content) == 4 == reply.usage.completion_tokens
    reference = hf_next_token_logprobs(hf_model, chat_prompt_ids(tokenizer, QUESTION))
    assert math.isclose(content[0].logprob, reference.max().item(), abs_tol=1e-4)
    for entry in content:
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    streamed = client.chat.completions.create(model=NAME, messages=QUESTION, temperature=0, max_tokens=4,
                                              logprobs=True, top_logprobs=2, stream=True,
                                              extra_body={"ignore_eos": True})
    streamed_content = [e for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
                        for e in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed_content] == [(e.token, e.logprob) for e in content]


def test_n_samples_share_one_prompt(tiny):
    _, client, _, _ = tiny
    reply = client.chat.completions.create(model=NAME, messages=QUESTION, n=3, temperature=1.0, seed=11,
                                           max_tokens=8, logprobs=True, extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert reply.usage.completion_tokens == sum(len(c.logprobs.content) for c in reply.choices) == 24
    assert len({c.message.content for c in reply.choices}) > 1  # independent samples
    streamed = client.chat.completions.create(model=NAME, messages=QUESTION, n=3, temperature=1.0, seed=11,
                                              max_tokens=8, stream=True, extra_body={"ignore_eos": True})
    texts = ["", "", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [c.message.content for c in reply.choices]


def test_seed_reproduces_and_different_seeds_differ(tiny):
    _, client, _, _ = tiny

    def sample(seed: int) -> str:
        return client.completions.create(model=NAME, prompt="Once upon a time", temperature=1.0, seed=seed,
                                         max_tokens=12, extra_body={"ignore_eos": True}).choices[0].text

    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(4321)


def test_stop_strings_cut_the_answer(tiny):
    _, client, _, _ = tiny
    args = {"model": NAME, "prompt": "What is the capital of France?", "temperature": 0, "max_tokens": 16,
            "extra_body": {"ignore_eos": True}}
    full = client.completions.create(**args).choices[0].text
    # The random model's text is mostly byte fragments; stop on its first run of three letters.
    match = re.search(r"[A-Za-z]{3}", full[1:])
    assert match, f"no letters to stop on in {full!r}"
    stop = match.group(0)
    expected = full[: full.index(stop)]
    for stop_arg in (stop, ["never-appears", stop]):
        cut = client.completions.create(**(args | {"stop": stop_arg})).choices[0]
        assert cut.text == expected and cut.finish_reason == "stop"
    streamed = client.completions.create(**(args | {"stop": [stop]}), stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_max_completion_tokens_and_sampling_extras(tiny):
    _, client, hf_model, tokenizer = tiny
    args = {"model": NAME, "messages": QUESTION, "max_completion_tokens": 6, "extra_body": {"ignore_eos": True}}
    greedy = client.chat.completions.create(**args, temperature=0)
    assert greedy.usage.completion_tokens == 6 and greedy.choices[0].finish_reason == "length"
    # top_k=1 and min_p=1 leave only the most likely token: sampling at temperature 1 is greedy
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        sampled = client.chat.completions.create(**(args | {"extra_body": args["extra_body"] | extra}),
                                                 temperature=1.0, seed=5)
        assert sampled.choices[0].message.content == greedy.choices[0].message.content
    # repetition_penalty follows HF's definition: compare with HF generate
    prompt_ids = chat_prompt_ids(tokenizer, QUESTION)
    expected = hf_greedy(hf_model, prompt_ids, 6, repetition_penalty=1.5)
    penalized = client.chat.completions.create(
        model=NAME, messages=QUESTION, temperature=0, max_tokens=6, extra_body={"repetition_penalty": 1.5})
    assert penalized.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    # presence/frequency penalties are accepted and in range
    client.chat.completions.create(model=NAME, messages=QUESTION, temperature=0, max_tokens=2,
                                   presence_penalty=1.0, frequency_penalty=-0.5)


def test_user_selects_the_prefix_cache_tenant(tiny):
    _, client, _, _ = tiny
    prompt = list(range(40, 80))  # 40 tokens: at most (40 - 1) // 16 = 2 full blocks can be reused

    def cached(**extra) -> int:
        reply = client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=1, **extra)
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached(user="alice") == 0
    assert cached(user="alice") == 32
    assert cached(user="bob") == 0  # another tenant never sees alice's blocks
    assert cached(extra_body={"cache_salt": "alice"}) == 32


def test_health_reports_engine_state(tiny):
    server, _, _, _ = tiny
    health = httpx.get(server.base_url + "/health").json()
    assert health["status"] == "ok" and health["served_model_name"] == NAME
    for key in ("model", "scheduler", "blocks", "prefix_cache"):
        assert key in health, key


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    config = EngineConfig(model=str(smollm2_gguf), device="cpu", dtype="float32", max_model_len=512)
    server = ServerThread(config).start()
    yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    server.stop()


def test_smollm2_answers_paris(smol):
    model = smol.models.list().data[0].id
    reply = smol.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=12)
    assert reply.choices[0].message.content == "The capital of France is Paris."
    assert reply.choices[0].finish_reason == "stop"


def test_deepinfer_serve_command(tiny_models):
    """The CLI end to end: binds loopback, loads in the background, needs the key, stops on SIGINT."""
    port = free_port()
    command = [sys.executable, "-m", "deepinfer", "serve", "--model", str(tiny_models["llama"][0]),
               "--port", str(port), "--api-key", "k", "--served-model-name", "cli-model", "--device", "cpu",
               "--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory", "4MiB", "--log-level", "warning"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(process, base)
        client = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
        reply = client.chat.completions.create(model="cli-model", messages=QUESTION, max_tokens=3)
        assert reply.model == "cli-model" and reply.usage.completion_tokens <= 3
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
    finally:
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    assert process.returncode == 130 and "Traceback" not in stderr, stderr  # 130: stopped by SIGINT, cleanly


def test_deepinfer_serve_exits_when_the_model_cannot_load(tmp_path):
    command = [sys.executable, "-m", "deepinfer", "serve", "--model", str(tmp_path / "absent"),
               "--port", str(free_port()), "--device", "cpu", "--log-level", "error"]
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "error: cannot serve:" in result.stderr and "absent" in result.stderr
    assert "Traceback" not in result.stderr
