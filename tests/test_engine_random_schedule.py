"""Random schedules on the real engine (tiny Llama, fp32, CPU): arrivals, aborts, tenants, n > 1 and
tiny KV pools chosen by hypothesis.

After every step the scheduler and block pool must agree (ref counts match block tables); at the
end every request has finished, no block leaked, and every request that was not aborted produced
exactly the tokens of its solo run (greedy, or seeded sampling: same seed, same tokens, whatever
the batch and however often it was preempted).
"""

import random

import pytest
import torch
from conftest import save_tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer.core.config import EngineConfig
from deepinfer.core.engine.llm_engine import LLMEngine
from deepinfer.core.engine.sampling_params import SamplingParams
from deepinfer.core.models.loader import load_model

MAX_TOKENS = 8


def _prompt(length, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 340) for _ in range(length)]


_BASE = _prompt(23, 5)
# Shared prefixes, so prefix-cache hits, partial hits and block-aligned prompts all occur.
PROMPTS = [_BASE[:1], _BASE[:9], _BASE[:16], _BASE, _prompt(16, 6), _BASE[:8] + _prompt(10, 7)]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory, tiny_tokenizer):
    directory = tmp_path_factory.mktemp("random_schedule_llama")
    save_tiny_model("llama", directory, tiny_tokenizer, seed=7, initializer_range=0.2, num_hidden_layers=2)
    return load_model(EngineConfig(model=str(directory)), torch.device("cpu"), torch.float32)


def sampling(kind: str, max_tokens: int) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    n = 2 if kind == "n2" else 1
    return SamplingParams(n=n, temperature=1.0, top_k=40, seed=3, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def solo_outputs(loaded):
    """(prompt index, seed or None) -> the first MAX_TOKENS tokens of a solo run."""
    cache = {}

    def get(prompt_index: int, seed: int | None) -> list[int]:
        key = (prompt_index, seed)
        if key not in cache:
            engine = LLMEngine(EngineConfig(num_gpu_blocks=64, block_size=8), loaded_model=loaded)
            params = SamplingParams(temperature=0.0 if seed is None else 1.0, top_k=40, seed=seed,
                                    max_tokens=MAX_TOKENS, ignore_eos=True)
            engine.add_request(PROMPTS[prompt_index], params, "solo")
            while engine.has_unfinished_requests():
                for output in engine.step()[0]:
                    if output.finished:
                        cache[key] = output.token_ids
        return cache[key]

    return get


request_plan = st.tuples(
    st.integers(0, 6),  # arrival step
    st.integers(0, len(PROMPTS) - 1),  # prompt
    st.integers(1, MAX_TOKENS),  # max_tokens
    st.sampled_from(["greedy", "greedy", "seeded", "n2"]),
    st.one_of(st.none(), st.integers(0, 12)),  # abort at this step, if still running
    st.sampled_from([None, None, "tenant-a"]),  # cache_salt
)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    num_blocks=st.integers(4, 12),  # 32..96 tokens: every request fits alone, several rarely do
    budget=st.integers(1, 40),
    max_num_seqs=st.integers(1, 6),
    prefix_caching=st.booleans(),
    plan=st.lists(request_plan, min_size=1, max_size=7),
)
def test_random_schedules(loaded, solo_outputs, num_blocks, budget, max_num_seqs, prefix_caching, plan):
    engine = LLMEngine(EngineConfig(num_gpu_blocks=num_blocks, block_size=8, max_num_batched_tokens=budget,
                                    max_num_seqs=max_num_seqs, enable_prefix_caching=prefix_caching),
                       loaded_model=loaded)
    arrivals = sorted((arrive, i) for i, (arrive, *_) in enumerate(plan))
    finals, added = {}, set()
    step = 0
    while arrivals or engine.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= step:
            _, i = arrivals.pop(0)
            _, prompt_index, max_tokens, kind, _, salt = plan[i]
            engine.add_request(PROMPTS[prompt_index], sampling(kind, max_tokens), f"r{i}", salt)
            added.add(f"r{i}")
        for i, (*_, abort_at, _) in enumerate(plan):
            if abort_at == step and f"r{i}" in added:
                finals.update({o.request_id: o for o in engine.abort(f"r{i}")})
        outputs, _ = engine.step()
        finals.update({o.request_id: o for o in outputs if o.finished})
        engine.scheduler.check_invariants()
        step += 1
        assert step < 2000, "the engine does not make progress"

    pool = engine.scheduler.kv.pool
    assert pool.num_free_blocks + pool.num_evictable_blocks == pool.num_blocks
    assert set(finals) == {f"r{i}" for i in range(len(plan))}
    for i, (_, prompt_index, max_tokens, kind, _, _) in enumerate(plan):
        output = finals[f"r{i}"]
        assert output.finished
        for index, completion in enumerate(output.outputs):
            expected = solo_outputs(prompt_index, None if kind == "greedy" else 3 + index)[:max_tokens]
            if completion.finish_reason == "abort":
                assert completion.token_ids == expected[:len(completion.token_ids)]
            else:
                assert (completion.finish_reason, completion.token_ids) == ("length", expected)
