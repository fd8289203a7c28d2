"""The engine at tensor_parallel_size 2 on the CPU (gloo): the same greedy tokens and logprobs as one rank.

Rank 0 runs the scheduler, the paged KV manager and the sampler; rank 1 is a process of its own
(core/distributed/rank_worker.py) that gets each step's inputs. The model: a tiny random Llama with 6 query /
3 KV heads (uneven at TP=2: rank 0 computes heads 0..2, rank 1 heads 3..5, and KV head 1 is on both).
"""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import save_tiny_model

from deepinfer.core.config import EngineConfig
from deepinfer.core.engine.frontend.data_parallel_client import DataParallelClient
from deepinfer.core.engine.llm_engine import LLMEngine
from deepinfer.core.engine.sampling_params import SamplingParams
from deepinfer.core.errors import DeepInferError
from deepinfer.core.llm import LLM

PROMPTS = [
    [5, 17, 200, 3, 99, 42, 7],
    [5, 17, 200, 3, 99, 42, 7, 311, 64, 150, 8, 1, 250, 77, 19, 300, 2, 45, 123, 9, 31, 88, 14],  # shares a prefix
    [250, 77],
    list(range(40, 80)),  # chunked: longer than a step's token budget
]
MARGIN = 1e-3  # top-2 logprob gap below which fp32 rounding may pick either token


@pytest.fixture(scope="module")
def uneven_llama(tmp_path_factory, tiny_tokenizer):
    directory = tmp_path_factory.mktemp("uneven_llama")
    save_tiny_model("llama", directory, tiny_tokenizer, seed=3, num_attention_heads=6, num_key_value_heads=3,
                    head_dim=32, hidden_size=192, num_hidden_layers=2)
    return str(directory)


def generate(model: str, tensor_parallel_size: int, **engine_args) -> list:
    llm = LLM(model, device="cpu", tensor_parallel_size=tensor_parallel_size, max_num_batched_tokens=16,
              max_model_len=128, **engine_args)
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True)] * 3 + [
            SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, prompt_logprobs=1, ignore_eos=True)]
        return llm.generate(PROMPTS, params)
    finally:
        llm.shutdown()


def assert_same_greedy(parallel: list, whole: list) -> None:
    """Token by token, while the reference's top-2 gap is clear of fp32 noise: the same token and logprobs."""
    compared = 0
    for got, want in zip(parallel, whole):
        got_out, want_out = got.outputs[0], want.outputs[0]
        for got_step, want_step in zip(got_out.logprobs, want_out.logprobs):
            (_, best), (_, second) = want_step.top[:2]
            if best - second < MARGIN:
                break
            assert got_step.token_id == want_step.token_id
            assert got_step.logprob == pytest.approx(want_step.logprob, abs=1e-4)
            compared += 1
        if want.prompt_logprobs is not None:
            for got_entry, want_entry in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
                assert got_entry.logprob == pytest.approx(want_entry.logprob, abs=1e-4)
    assert compared >= len(whole) * 5  # most tokens clear the margin


@pytest.mark.parametrize("tensor_parallel_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_tp_engine_generates_what_one_rank_does(uneven_llama, tensor_parallel_size):
    """At TP=4 the 6 heads split 2/2/1/1 and every rank holds one or two of the 3 KV heads."""
    whole = generate(uneven_llama, 1)
    assert_same_greedy(generate(uneven_llama, tensor_parallel_size), whole)


@pytest.mark.parametrize("engine_args", [{"quantization": "w4a16"}, {"kv_cache_dtype": "int8"}],
                         ids=["w4a16", "int8-kv"])
def test_tp2_quantized_engine_generates_what_one_rank_does(uneven_llama, engine_args):
    """Packed weights cut per rank; an int8 KV pool's per-head scales held by the rank that holds the head."""
    whole = generate(uneven_llama, 1, **engine_args)
    assert_same_greedy(generate(uneven_llama, 2, **engine_args), whole)


def test_a_rank_that_dies_ends_the_engine_with_an_error(uneven_llama, caplog):
    engine = LLMEngine(EngineConfig(uneven_llama, device="cpu", tensor_parallel_size=2, max_model_len=64))
    try:
        rank = engine.model.ranks[0].process
        rank.kill()
        rank.wait()
        engine.add_request([5, 17, 200], SamplingParams(temperature=0.0, max_tokens=2))
        with caplog.at_level(logging.ERROR):
            while engine.has_unfinished_requests():
                outputs, _ = engine.step()
        assert outputs[0].outputs[0].finish_reason == "error"
        assert "tensor-parallel rank 1 exited (status -9)" in caplog.text
        with pytest.raises(DeepInferError, match="closed"):
            engine.model.compute_logits(torch.zeros(1, engine.spec.hidden_size))
    finally:
        engine.close()


def test_what_tensor_parallelism_does_not_build_is_refused(uneven_llama, tmp_path, tiny_tokenizer):
    with pytest.raises(ValueError, match="fp8"):
        EngineConfig(uneven_llama, tensor_parallel_size=2, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(uneven_llama, tensor_parallel_size=0)
    with pytest.raises(DeepInferError, match="eager"):
        LLMEngine(EngineConfig(uneven_llama, device="cpu", tensor_parallel_size=2), decode_mode="padded")
    save_tiny_model("llama", tmp_path, tiny_tokenizer, num_attention_heads=6, num_key_value_heads=3, head_dim=16,
                    hidden_size=96, num_hidden_layers=1)
    with pytest.raises(DeepInferError, match="32-column boundary"):  # 3 heads of 16: o_proj cut inside a word run
        LLM(str(tmp_path), device="cpu", tensor_parallel_size=2, quantization="w4a16")
    with pytest.raises(DeepInferError, match="data_parallel_size"):
        DataParallelClient(EngineConfig(uneven_llama, device="cpu", tensor_parallel_size=2), 2)
