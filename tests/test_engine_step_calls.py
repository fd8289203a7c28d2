"""The torch calls the host issues per steady decode step around the forward (core/bench/torch_ops.py),
counted by a dispatch mode on the CPU: the padded step (what a CUDA graph replays) and the real sampler,
the forward itself left out. A behaviour bound, not a timing one: on a GPU each of these calls costs the
host microseconds whatever its size, so a steady step must issue a fixed, small number of them, not
one per row or per parameter."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import save_tiny_model

from deepinfer import SamplingParams
from deepinfer.core.bench.torch_ops import TorchOpCounter, per_step
from deepinfer.core.config import EngineConfig
from deepinfer.core.engine.llm_engine import LLMEngine
from deepinfer.core.models.loader import load_model

STEPS = 4


@pytest.fixture(scope="module")
def loaded(tmp_path_factory, tiny_tokenizer):
    directory = tmp_path_factory.mktemp("step_calls_llama")
    save_tiny_model("llama", directory, tiny_tokenizer, seed=7, initializer_range=0.2, num_hidden_layers=2)
    return load_model(EngineConfig(model=str(directory)), torch.device("cpu"), torch.float32)


def steady_engine(loaded, params: SamplingParams, num_seqs: int) -> LLMEngine:
    """A padded async engine whose `num_seqs` streams all decode (their prompts are in)."""
    config = EngineConfig(num_gpu_blocks=256, block_size=8, max_num_seqs=16, max_num_batched_tokens=64)
    engine = LLMEngine(config, loaded_model=loaded, decode_mode="padded")
    rng = random.Random(0)
    for _ in range(num_seqs):
        engine.add_request([rng.randrange(3, 340) for _ in range(10)], params)
    for _ in range(4):
        engine.step()
    return engine


def count_steps(engine: LLMEngine, steps: int = STEPS) -> dict:
    """Per step: the torch calls of `steps` engine steps, the padded forward not counted."""
    counter = TorchOpCounter()
    counter.exclude(engine.runner.step_runner, "forward")
    try:
        with counter:
            for _ in range(steps):
                assert all(len(output.outputs[0].delta_token_ids) == 1 for output in engine.step()[0])
    finally:
        counter.close()
    return per_step(counter.take(), steps)


GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
RANDOM = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=40, ignore_eos=True)


@pytest.mark.parametrize("params", [GREEDY, RANDOM], ids=["greedy", "random"])
def test_a_steady_decode_step_issues_as_many_torch_calls_for_3_rows_as_for_12(loaded, params):
    """No per-row call: the staging is one copy, the sampling parameters are on the device already."""
    few, many = (count_steps(steady_engine(loaded, params, n)) for n in (3, 12))
    assert few == many, (few, many)


def test_a_steady_greedy_decode_step_is_one_copy_in_an_argmax_and_one_copy_out(loaded):
    """Staging: one host->device copy (the input ids are where the last step's sampler wrote them); sampling:
    an argmax (no sort, no draw) into those ids and the copy of the tokens back. On a GPU the step adds two
    event records and two waits (bench host's count there)."""
    calls = count_steps(steady_engine(loaded, GREEDY, 12))
    assert calls["device_calls"] <= 3, calls
    assert calls["total"] <= 12, calls
    random_calls = count_steps(steady_engine(loaded, RANDOM, 12))
    assert random_calls["device_calls"] <= calls["device_calls"] + 24, random_calls  # the draw's own kernels


def test_the_counter_sorts_calls_by_kind_and_phase():
    class Owner:
        def staging(self, x):
            return x[:2].clone()

        def forward(self, x):
            return x * 2

    owner, counter = Owner(), TorchOpCounter()
    counter.attribute(owner, "staging", "staging")
    counter.exclude(owner, "forward")
    x = torch.arange(4)
    with counter:
        owner.staging(x)
        owner.forward(x)
        x.add(1)
    counter.close()
    calls = per_step(counter.take(), 1)
    assert calls["views"] == 1 and calls["kernels"] == 2 and calls["device_calls"] == 2
    assert calls["by_phase"] == {"staging": 2, "other": 1}
    assert "staging" not in owner.__dict__ and "forward" not in owner.__dict__
