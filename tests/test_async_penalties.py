"""Penalties under async scheduling: a request with a repetition, frequency or presence penalty runs
overlapped steps (its token counts live on the device, core/engine/worker/token_counts.py) and gets exactly
the tokens of synchronous stepping, itself checked against HF transformers' penalties in
test_engine.py and against hand-computed logits in test_sampler.py."""

from __future__ import annotations

import torch
from test_async_scheduling import (  # the async-vs-sync harness and its tiny Llama
    compare,
    drive,
    greedy,
    loaded,  # noqa: F401 - the module's model fixture
    make_engine,
    prompt,
    seeded,
)

from deepinfer import SamplingParams
from deepinfer.core.engine.worker.sampler import Sampler, SamplingRow, apply_penalties
from deepinfer.core.engine.worker.token_counts import TokenCounts


def penalized_arrivals():
    return [
        (0, prompt(12, 80), greedy(14, repetition_penalty=1.8), "repetition"),
        (0, prompt(7, 81), greedy(14, frequency_penalty=1.5), "frequency"),
        (0, prompt(9, 82), greedy(14, presence_penalty=1.5), "presence"),
        (1, prompt(10, 83), seeded(14, seed=5, repetition_penalty=1.3, frequency_penalty=0.6,
                                   presence_penalty=-0.8), "seeded"),
        (2, prompt(6, 84), greedy(10), "plain"),
        (3, prompt(5, 85), SamplingParams(n=2, seed=9, temperature=1.0, max_tokens=9, ignore_eos=True,
                                          repetition_penalty=1.5, presence_penalty=1.0), "n2"),
    ]


def test_penalized_requests_give_the_synchronous_tokens(loaded):  # noqa: F811
    sync, _ = compare(loaded, penalized_arrivals())
    # The penalties acted: without them the greedy requests answer otherwise.
    plain = drive(make_engine(loaded, async_scheduling=False),
                  [(0, prompt(12, 80), greedy(14), "repetition"), (0, prompt(7, 81), greedy(14), "frequency"),
                   (0, prompt(9, 82), greedy(14), "presence")])
    for request_id, out in plain.finals.items():
        assert out.outputs[0].token_ids != sync.finals[request_id].outputs[0].token_ids, request_id


def test_penalized_requests_give_the_synchronous_tokens_through_preemption(loaded):  # noqa: F811
    """A pool too small for all of them: requests are preempted and recomputed mid-answer (with a
    token in flight), and their counts must neither lose nor double a token."""
    _, async_run = compare(loaded, penalized_arrivals(), num_gpu_blocks=9, exact_cache=False)
    assert sum(stats.num_preemptions for stats in async_run.stats) > 0


def launches_over_a_penalized_step(engine) -> list[int]:
    """Counts, in a list of one, the steps launched while a step that samples a penalized request is
    in flight, its tokens not read yet (the runner's `previous`)."""
    count, real_launch = [0], engine.runner.launch

    def launch(scheduler_output, previous=None):
        if previous is not None and any(c.request.params.repetition_penalty != 1.0 for c in previous.sampling_chunks):
            count[0] += 1
        return real_launch(scheduler_output, previous)

    engine.runner.launch = launch
    return count


def test_the_engine_overlaps_steps_while_a_penalized_request_is_in_flight(loaded):  # noqa: F811
    arrivals = [(0, prompt(12, 80), greedy(12, repetition_penalty=1.8, frequency_penalty=0.7), "penalized")]
    for async_scheduling, expected in ((True, 11), (False, 0)):
        engine = make_engine(loaded, async_scheduling=async_scheduling)
        count = launches_over_a_penalized_step(engine)
        run = drive(engine, arrivals)
        assert len(run.finals["penalized"].outputs[0].token_ids) == 12
        # async: every launch after the prefill's went out with the previous step still in flight
        assert count[0] == expected


def test_device_counts_hold_the_drawn_tokens_before_the_host_has_them():
    """A row carrying TokenCounts is penalized for the token the previous call drew even though its
    host list does not hold that token yet (what an overlapped step sees)."""
    torch.manual_seed(0)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.0, frequency_penalty=2.0)
    counts, sampler = TokenCounts(), Sampler()
    logits = torch.randn(1, 30)
    first = sampler.sample(logits, [SamplingRow(params, [1, 2], [], token_counts=counts)]).token_ids[0]
    second = sampler.sample(logits, [SamplingRow(params, [1, 2], [], token_counts=counts)]).token_ids[0]
    # the reference: the host lists with the first token applied
    expected = apply_penalties(logits, [SamplingRow(params, [1, 2], [first])]).argmax(-1).item()
    assert second == expected != first
    assert counts.num_counted == 2 and counts.output[first] == 1 and counts.output[second] == 1
