"""SamplingParams refuses what the sampler cannot honour, and a request whose sampling fails at run
time fails alone: its neighbours in the step finish with exactly the tokens they get by themselves.

References: torch.Generator.manual_seed for the seed range, float32 itself (numpy) for the ranges
that must survive the sampler's arithmetic, and each request run alone for the neighbours' tokens.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from conftest import save_tiny_model

from deepinfer import SamplingParams
from deepinfer.core.config import EngineConfig
from deepinfer.core.engine.llm_engine import LLMEngine
from deepinfer.core.engine.sampling_params import FLOAT32_TINY, MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY
from deepinfer.core.engine.worker import model_runner
from deepinfer.core.engine.worker.sampler import Sampler, SamplingRow, make_generator
from deepinfer.core.errors import InvalidRequestError
from deepinfer.core.models.loader import load_model


@pytest.mark.parametrize(("field", "value", "message"), [
    ("logprobs", True, "logprobs must be an integer, got bool"),
    ("prompt_logprobs", 1.5, "prompt_logprobs must be an integer, got float"),
    ("n", True, "n must be an integer, got bool"),
    ("max_tokens", 2.5, "max_tokens must be an integer, got float"),
    ("max_tokens", 2.0, "max_tokens must be an integer, got float"),
    ("max_tokens", 0, r"max_tokens must be >= 1"),
    ("top_k", 1.0, "top_k must be an integer"),
    ("top_k", -2, r"top_k must be >= -1"),
    ("top_p", 1e-46, r"top_p must be a finite number in \[1.17549e-38, 1\]"),
    ("top_p", 0.0, "top_p must be"),
    ("top_p", 1.5, "top_p must be"),
    ("top_p", math.nan, "top_p must be"),
    ("top_p", True, "top_p must be a number, got bool"),
    ("repetition_penalty", 1e-300, r"repetition_penalty must be a finite number in \[0.01, 100\]"),
    ("repetition_penalty", 0.0, "repetition_penalty must be"),
    ("repetition_penalty", 1e3, "repetition_penalty must be"),
    ("temperature", math.inf, "temperature must be a finite number"),
    ("temperature", 1e39, "temperature must be a finite number"),
    ("temperature", -0.5, "temperature must be"),
    ("temperature", "0.7", "temperature must be a number, got str"),
    ("min_p", 1.5, "min_p must be"),
    ("presence_penalty", 2.5, "presence_penalty must be"),
    ("frequency_penalty", -3, "frequency_penalty must be"),
    ("seed", 2**64, r"seed must be in \[-9223372036854775808, 18446744073709551615\]"),
    ("seed", -(2**63) - 1, "seed must be in"),
    ("seed", 3.0, "seed must be an integer, got float"),
    ("seed", True, "seed must be an integer, got bool"),
    ("stop", [""], "stop must be non-empty strings"),
    ("stop", ["ok", 3], "stop must be non-empty strings"),
    ("stop", ["a"] * 17, "stop holds 17 strings, more than the 16 allowed"),
    ("stop", ["\ud800"], "stop string .* is not valid Unicode"),
    ("stop", 7, "stop must be a string or a list of strings"),
    ("stop_token_ids", [True], "stop_token_ids must be an integer, got bool"),
    ("stop_token_ids", [-1], "stop_token_ids must be >= 0"),
    ("stop_token_ids", "12", "stop_token_ids must be a list of token ids"),
    ("ignore_eos", "yes", "ignore_eos must be true or false"),
    ("skip_special_tokens", 1, "skip_special_tokens must be true or false"),
    ("logprobs", 21, r"logprobs must be in \[0, 20\]"),
    ("prompt_logprobs", 21, r"prompt_logprobs must be in \[0, 20\]"),
])
def test_bad_values_are_refused_with_a_clear_value_error(field, value, message):
    with pytest.raises(ValueError, match=message) as err:
        SamplingParams(**{field: value})
    assert isinstance(err.value, InvalidRequestError) and "\n" not in str(err.value)


def test_each_sample_seed_must_fit_what_manual_seed_takes():
    generator = torch.Generator()
    with pytest.raises(ValueError):  # the reference: torch's own range ends at 2**64 - 1
        generator.manual_seed(2**64)
    for seed in (2**64 - 1, -(2**63), 0):
        generator.manual_seed(seed)
        assert SamplingParams(seed=seed).seed == seed
    assert SamplingParams(n=3, seed=2**64 - 3).seed == 2**64 - 3  # samples seeded 2**64 - 3 .. 2**64 - 1
    with pytest.raises(ValueError, match=r"seed \+ n - 1 must fit 64 bits"):
        SamplingParams(n=3, seed=2**64 - 2)


def test_accepted_values_are_normalized():
    params = SamplingParams(stop="x" * 1000, top_k=-1, temperature=1, seed=np.int64(5), max_tokens=np.int32(3))
    assert list(params.stop) == ["x" * 1000]  # a single stop string
    assert params.top_k == 0 and isinstance(params.temperature, float)
    assert type(params.seed) is int and type(params.max_tokens) is int
    assert len(SamplingParams(stop=["s"] * 16).stop) == 16


def test_float32_bounds_survive_the_sampler():
    """The smallest accepted top_p and repetition penalties stay non-zero and finite in float32, so
    the sampler still returns the most likely token instead of a NaN row's token 0."""
    assert np.float32(FLOAT32_TINY) > 0 and np.float32(1e-46) == 0  # why the bound is float32's tiny
    assert np.isfinite(np.float32(1.0) / np.float32(MIN_REPETITION_PENALTY))
    assert np.float32(1e-300) == 0  # what 1e-300 would have been
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    logits[:, 0] = -5.0  # token 0 is never the best
    for params in (SamplingParams(top_p=FLOAT32_TINY), SamplingParams(top_p=FLOAT32_TINY, temperature=2.0),
                   SamplingParams(top_p=FLOAT32_TINY, repetition_penalty=MIN_REPETITION_PENALTY),
                   SamplingParams(top_p=FLOAT32_TINY, repetition_penalty=MAX_REPETITION_PENALTY)):
        # Hand-computed: the seen tokens 1 and 2 have a positive logit divided by the penalty, a
        # negative one multiplied; top_p this small keeps only the most likely token of what is left.
        penalized = logits.clone()
        seen = penalized[:, 1:3]
        penalty = params.resolved().repetition_penalty  # 1 where the params leave it unset
        penalized[:, 1:3] = torch.where(seen > 0, seen / penalty, seen * penalty)
        rows = [SamplingRow(params, prompt_token_ids=[1, 2], output_token_ids=[]) for _ in range(4)]
        assert Sampler().sample(logits, rows).token_ids == penalized.argmax(dim=-1).tolist()


@pytest.fixture(scope="module")
def loaded(tmp_path_factory, tiny_tokenizer):
    directory = tmp_path_factory.mktemp("sampling_llama")
    save_tiny_model("llama", directory, tiny_tokenizer, seed=11, initializer_range=0.2, num_hidden_layers=1)
    return load_model(EngineConfig(model=str(directory)), torch.device("cpu"), torch.float32)


def make_engine(loaded, **overrides) -> LLMEngine:
    settings = {"num_gpu_blocks": 128, "block_size": 8, "max_num_seqs": 8, "max_num_batched_tokens": 64}
    return LLMEngine(EngineConfig(**{**settings, **overrides}), loaded_model=loaded)


def run(engine, requests) -> dict:
    for prompt, params, request_id in requests:
        engine.add_request(prompt, params, request_id)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step()[0] if o.finished})
    pool = engine.scheduler.kv.pool
    assert pool.num_free_blocks + pool.num_evictable_blocks == pool.num_blocks
    return finals


def test_a_lone_surrogate_prompt_is_an_invalid_request(loaded):
    engine = make_engine(loaded)
    with pytest.raises(InvalidRequestError, match="not valid Unicode: a lone surrogate '\\\\ud83d' at character 3"):
        engine.add_request("abc\ud83d", SamplingParams(max_tokens=2))
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("field", ["logit_bias", "stop_token_ids"])
def test_token_ids_past_the_vocabulary_are_refused_when_the_request_is_made(loaded, field):
    engine = make_engine(loaded)
    vocab_size = engine.spec.vocab_size
    value = {vocab_size: 1.0} if field == "logit_bias" else [vocab_size]
    with pytest.raises(InvalidRequestError, match=f"{field} token id {vocab_size} is outside the vocabulary"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, **{field: value}))
    ok = {vocab_size - 1: 1.0} if field == "logit_bias" else [vocab_size - 1]
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, **{field: ok}))
    assert engine.has_unfinished_requests()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_request_whose_sampling_fails_fails_alone(loaded, monkeypatch, async_scheduling):
    """One request's row carries logprobs=True (what SamplingParams now refuses, forced past it): the
    sampler's batch raises, the row fails with the error, the greedy and seeded neighbours finish
    with the tokens each gets alone."""
    good = [([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), "greedy"),
            ([9, 10, 11], SamplingParams(temperature=0.9, top_k=20, seed=123, max_tokens=6, ignore_eos=True,
                                         logprobs=0), "seeded")]  # max(0, True) is True: topk(True) raises
    alone = {request_id: run(make_engine(loaded, async_scheduling=async_scheduling),
                             [(prompt, params, request_id)])[request_id] for prompt, params, request_id in good}
    real_row = model_runner.sampling_row

    def row_with_bool_logprobs(request):
        row = real_row(request)
        if request.request_id == "bad":
            row.params = copy.copy(row.params)
            object.__setattr__(row.params, "logprobs", True)  # bypasses __post_init__
        return row

    monkeypatch.setattr(model_runner, "sampling_row", row_with_bool_logprobs)
    engine = make_engine(loaded, async_scheduling=async_scheduling)
    bad = ([12, 13, 14, 15, 16], SamplingParams(temperature=0.7, max_tokens=6, ignore_eos=True), "bad")
    finals = run(engine, [good[0], bad, good[1]])
    assert finals["bad"].finish_reason == "error"
    assert "sampling failed" in finals["bad"].error and "topk" in finals["bad"].error
    for request_id in ("greedy", "seeded"):
        assert finals[request_id].finish_reason == "length"
        assert finals[request_id].outputs[0].token_ids == alone[request_id].outputs[0].token_ids
    assert [lp.token_id for lp in finals["seeded"].outputs[0].logprobs] == alone["seeded"].outputs[0].token_ids


def test_the_rowwise_fallback_restores_seeded_generators():
    """A batch that fails after drawing noise must not advance a seeded neighbour's generator."""
    torch.manual_seed(1)
    logits = torch.randn(2, 40)
    seeded = SamplingParams(temperature=1.0, seed=77)
    reference = Sampler().sample(logits[1:], [SamplingRow(seeded, [1], [], make_generator(seeded, "cpu"))])
    broken = copy.copy(SamplingParams(temperature=1.0))
    object.__setattr__(broken, "logprobs", True)  # fails in the logprob table, after every draw
    rows = [SamplingRow(broken, [1], []), SamplingRow(seeded, [1], [], make_generator(seeded, "cpu"))]
    out = Sampler().sample(logits, rows)
    assert list(out.failures) == [0] and out.token_ids[1] == reference.token_ids[0]
