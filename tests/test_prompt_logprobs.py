"""Prompt logprobs against HF transformers on the tiny random Llama: `SamplingParams(prompt_logprobs=k)`
through `LLM.generate`, completions' `echo` + `logprobs` driven as lm-evaluation-harness's
`local-completions` drives it for loglikelihood tasks (tests/local_completions.py; SmolLM2's GGUF is
driven the same way in tests/test_gguf.py), vLLM's `prompt_logprobs` on both endpoints.

The reference is `log_softmax` of HF's fp32 logits at every prompt position. The engine runs chunked
prefill (a step budget smaller than the prompts) and a prefix cache, so the chunk gathering and the
disabled cache hit are what is checked, not one forward over the whole prompt.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from local_completions import TOLERANCE, check_against_hf, hf_prompt_logprobs
from server_helpers import ServerThread

from deepinfer import LLM, SamplingParams
from deepinfer.core.config import EngineConfig
from deepinfer.core.server.config import ServerConfig


def assert_matches_hf(entries, token_ids: list[int], reference: torch.Tensor, num_top: int) -> None:
    assert len(entries) == len(token_ids) and entries[0] is None
    for position, entry in enumerate(entries[1:], start=1):
        row = reference[position - 1]
        assert entry.token_id == token_ids[position]
        assert entry.logprob == pytest.approx(row[token_ids[position]].item(), abs=TOLERANCE)
        assert entry.rank == int((row > row[token_ids[position]]).sum()) + 1
        top = torch.topk(row, num_top)
        assert [token for token, _ in entry.top] == top.indices.tolist()
        assert [value for _, value in entry.top] == pytest.approx(top.values.tolist(), abs=TOLERANCE)


@pytest.fixture(scope="module")
def tiny_llm(tiny_models):
    model_dir, hf_model = tiny_models["llama"]
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=256, num_gpu_blocks=64, block_size=8,
              max_num_batched_tokens=16, max_num_seqs=4)
    return llm, hf_model


def test_prompt_logprobs_of_a_chunked_prefill_match_hf(tiny_llm):
    llm, hf_model = tiny_llm
    token_ids = [(7 * i + 3) % 300 + 3 for i in range(45)]  # 45 tokens: three chunks of 16
    reference = hf_prompt_logprobs(hf_model, token_ids)
    (out,) = llm.generate([token_ids], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))
    assert_matches_hf(out.prompt_logprobs, token_ids, reference, 3)
    assert out.num_cached_tokens == 0


def test_a_cached_prompt_is_scored_again_and_samples_share_one_score(tiny_llm):
    """The second request's prompt is in the prefix cache (a plain request hits it), yet one that asks
    for prompt logprobs computes and scores every position; n = 2 samples carry the same list."""
    llm, hf_model = tiny_llm
    token_ids = [(11 * i + 5) % 300 + 3 for i in range(40)]
    reference = hf_prompt_logprobs(hf_model, token_ids)
    (plain,) = llm.generate([token_ids], SamplingParams(temperature=0, max_tokens=1))
    (hit,) = llm.generate([token_ids], SamplingParams(temperature=0, max_tokens=1))
    assert hit.num_cached_tokens > 0 and plain.prompt_logprobs is None
    (scored,) = llm.generate([token_ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))
    assert scored.num_cached_tokens == 0
    assert_matches_hf(scored.prompt_logprobs, token_ids, reference, 2)
    (sampled,) = llm.generate([token_ids], SamplingParams(temperature=0.8, seed=3, max_tokens=2, n=2,
                                                          prompt_logprobs=0))
    assert_matches_hf(sampled.prompt_logprobs, token_ids, reference, 0)
    assert len(sampled.outputs) == 2


@pytest.fixture(scope="module")
def tiny_server(tiny_models):
    model_dir, hf_model = tiny_models["llama"]
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=256,
                          num_gpu_blocks=64, block_size=8, max_num_batched_tokens=16, max_num_seqs=4)
    server = ServerThread(config, ServerConfig(served_model_name="tiny")).start()
    yield server, hf_model
    server.stop()


def test_local_completions_loglikelihood_matches_hf(tiny_server, tiny_tokenizer):
    server, hf_model = tiny_server
    context = tiny_tokenizer.encode("The capital of France is")
    cases = [(context, tiny_tokenizer.encode(" Paris.")), (context, tiny_tokenizer.encode(" the quick brown fox")),
             ([(5 * i + 1) % 300 + 3 for i in range(30)], [17, 42, 99])]
    check_against_hf(server.base_url, "tiny", hf_model, cases,
                     lambda ids: tiny_tokenizer.decode(ids, skip_special_tokens=False))


def test_echo_without_generation_and_vllm_prompt_logprobs(tiny_server, tiny_tokenizer):
    """`max_tokens: 0` with echo returns the prompt's logprobs only (vLLM's answer); `prompt_logprobs: k` on
    completions and chat is vLLM's shape: per prompt token a map of token id to logprob, rank and text."""
    server, hf_model = tiny_server
    token_ids = tiny_tokenizer.encode("Hello world, how are you today?")
    reference = hf_prompt_logprobs(hf_model, token_ids)
    answer = httpx.post(server.base_url + "/v1/completions", json={
        "model": "tiny", "prompt": token_ids, "max_tokens": 0, "echo": True, "logprobs": 2, "prompt_logprobs": 2,
        "temperature": 0}, timeout=60).json()
    (choice,) = answer["choices"]
    assert choice["text"] == tiny_tokenizer.decode(token_ids, skip_special_tokens=False)
    assert len(choice["logprobs"]["tokens"]) == len(token_ids)
    assert answer["usage"]["completion_tokens"] == 0
    prompt_logprobs = choice["prompt_logprobs"]
    assert len(prompt_logprobs) == len(token_ids) and prompt_logprobs[0] is None
    for position, entry in enumerate(prompt_logprobs[1:], start=1):
        row, token = reference[position - 1], token_ids[position]
        assert entry[str(token)]["logprob"] == pytest.approx(row[token].item(), abs=TOLERANCE)
        assert entry[str(token)]["rank"] == int((row > row[token]).sum()) + 1
        top = torch.topk(row, 2).indices.tolist()
        assert set(entry) == {str(t) for t in top} | {str(token)}
        assert choice["logprobs"]["token_logprobs"][position] == pytest.approx(row[token].item(), abs=TOLERANCE)

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = httpx.post(server.base_url + "/v1/chat/completions", json={
        "model": "tiny", "messages": messages, "max_tokens": 1, "prompt_logprobs": 1}, timeout=60).json()
    text = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    chat_ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    chat_reference = hf_prompt_logprobs(hf_model, chat_ids)
    assert len(chat["prompt_logprobs"]) == len(chat_ids) and chat["prompt_logprobs"][0] is None
    last = chat["prompt_logprobs"][-1][str(chat_ids[-1])]
    assert last["logprob"] == pytest.approx(chat_reference[-1, chat_ids[-1]].item(), abs=TOLERANCE)


def test_a_streamed_echo_carries_the_prompt_logprobs_in_its_first_chunk(tiny_server, tiny_tokenizer):
    """The stream's logprobs, joined, are the non-streamed answer's: prompt tokens first, text offsets continued."""
    server, _ = tiny_server
    body = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 4, "echo": True, "logprobs": 1,
            "temperature": 0, "ignore_eos": True}
    whole = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    joined = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    text = ""
    with httpx.stream("POST", server.base_url + "/v1/completions", json={**body, "stream": True}, timeout=60) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[len("data: "):])["choices"][0]
                text += choice["text"]
                for key in joined:
                    joined[key] += choice["logprobs"][key]
    assert text == whole["text"]
    assert joined == whole["logprobs"]
