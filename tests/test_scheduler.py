"""Scheduler against a fake runner that stores tokens in a fake paged KV pool.

The fake runner writes each computed token (with its position) into the slot its block table
names, and "predicts" the next token from the context it reads back through the block table.
So a wrong block table, a prefix-cache hit on the wrong content, or a shared block written twice
changes the output or trips an assertion, with no model involved.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer.core.engine.sampling_params import SamplingParams
from deepinfer.core.engine.sched.request import Request, RequestStatus
from deepinfer.core.engine.sched.scheduler import Scheduler
from deepinfer.core.engine.sched.scheduler_output import ModelRunnerOutput, SchedulerOutput
from deepinfer.core.errors import QueueFullError
from deepinfer.core.kv.kv_manager import KVCacheManager

VOCAB = 50
EOS = 0


class FakeRunner:
    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        self.bs = kv.block_size
        self.slots: list[tuple[int, int] | None] = [None] * (kv.num_blocks * kv.block_size)

    def _slot(self, block_table, pos):
        return block_table[pos // self.bs] * self.bs + pos % self.bs

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        result = ModelRunnerOutput()
        for chunk in out.chunks:
            for offset, token in enumerate(chunk.token_ids):
                pos = chunk.start_pos + offset
                block = chunk.block_table[pos // self.bs]
                assert not self.kv.pool.is_cached(block), f"wrote into cached block {block}"
                self.slots[self._slot(chunk.block_table, pos)] = (token, pos)
            if chunk.sample:
                context = [self.slots[self._slot(chunk.block_table, p)] for p in range(chunk.seq_len)]
                assert context == [(t, p) for p, t in enumerate(chunk.request.all_token_ids[:chunk.seq_len])]
                result.sampled_token_ids[chunk.request_id] = next_token([t for t, _ in context])
        return result


def next_token(tokens):
    return (sum((i + 3) * t for i, t in enumerate(tokens)) * 7 + len(tokens)) % VOCAB


def reference_output(prompt, max_tokens, ignore_eos=True):
    tokens, out = list(prompt), []
    for _ in range(max_tokens):
        token = next_token(tokens)
        tokens.append(token)
        out.append(token)
        if token == EOS and not ignore_eos:
            break
    return out


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_waiting=100,
                   max_model_len=1000, prefix=True):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix)
    scheduler = Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          max_waiting_requests=max_waiting, max_model_len=max_model_len)
    return scheduler, FakeRunner(kv)


def make_request(request_id, prompt, max_tokens=5, ignore_eos=True, **params):
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, **params),
                   eos_token_ids=frozenset({EOS}))


def step(scheduler, runner):
    out = scheduler.schedule()
    assert out.num_batched_tokens == sum(c.num_tokens for c in out.chunks) <= scheduler.max_num_batched_tokens
    if not out.is_empty:
        scheduler.update(out, runner.execute(out))
    scheduler.check_invariants()
    return out


def run_all(scheduler, runner, max_steps=2000):
    steps = 0
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
        steps += 1
        assert steps < max_steps, "the scheduler does not make progress"
    pool = scheduler.kv.pool
    assert pool.num_free_blocks + pool.num_evictable_blocks == pool.num_blocks
    return steps


def prompt_of(length, seed=1):
    return [(seed * 13 + i * 7) % (VOCAB - 1) + 1 for i in range(length)]


def test_chunked_prefill_splits_the_prompt_and_samples_only_at_its_end():
    scheduler, runner = make_scheduler(budget=8)
    request = make_request("a", prompt_of(20), max_tokens=2)
    scheduler.add_request(request)
    shapes = []
    while scheduler.has_unfinished_requests():
        out = step(scheduler, runner)
        shapes.append([(c.start_pos, c.num_tokens, c.sample) for c in out.chunks])
    assert shapes == [[(0, 8, False)], [(8, 8, False)], [(16, 4, True)], [(20, 1, True)]]
    assert request.output_token_ids == reference_output(prompt_of(20), 2)
    assert request.finish_reason == "length"


def test_prefill_chunks_and_decodes_share_one_step():
    scheduler, runner = make_scheduler(budget=10)
    a, b = make_request("a", prompt_of(3, 1), max_tokens=4), make_request("b", prompt_of(15, 2))
    scheduler.add_request(a)
    step(scheduler, runner)  # a's whole prompt
    scheduler.add_request(b)
    out = step(scheduler, runner)
    assert [(c.request_id, c.start_pos, c.num_tokens, c.sample) for c in out.chunks] == [
        ("a", 3, 1, True), ("b", 0, 9, False)]
    out = step(scheduler, runner)
    assert [(c.request_id, c.start_pos, c.num_tokens, c.sample) for c in out.chunks] == [
        ("a", 4, 1, True), ("b", 9, 6, True)]


def test_max_num_seqs_bounds_the_running_set():
    scheduler, runner = make_scheduler(max_num_seqs=2)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", prompt_of(3, i)))
    out = step(scheduler, runner)
    assert [c.request_id for c in out.chunks] == ["r0", "r1"] and scheduler.num_waiting == 2
    run_all(scheduler, runner)


def test_waiting_queue_is_bounded():
    scheduler, _ = make_scheduler(max_waiting=2)
    scheduler.add_request(make_request("a", [1, 2]))
    scheduler.add_request(make_request("b", [1, 2]))
    with pytest.raises(QueueFullError, match="waiting queue is full"):
        scheduler.add_request(make_request("c", [1, 2]))


@pytest.mark.parametrize("budget", [1, 7, 16, 512])
def test_chunk_size_does_not_change_outputs(budget):
    scheduler, runner = make_scheduler(budget=budget, num_blocks=128)
    prompts = {f"r{i}": prompt_of(length, i) for i, length in enumerate([1, 5, 17, 33, 8, 2])}
    requests = [make_request(rid, prompt, max_tokens=6) for rid, prompt in prompts.items()]
    for request in requests:
        scheduler.add_request(request)
    run_all(scheduler, runner)
    for request in requests:
        assert request.output_token_ids == reference_output(prompts[request.request_id], 6)


def test_preemption_recomputes_the_newest_request_and_keeps_outputs():
    # 6 blocks of 4 tokens: two requests growing to 12 + 10 tokens cannot both stay.
    scheduler, runner = make_scheduler(num_blocks=6, block_size=4, budget=64, prefix=False)
    a = make_request("a", prompt_of(6, 1), max_tokens=10)
    b = make_request("b", prompt_of(6, 2), max_tokens=10)
    scheduler.add_request(a)
    scheduler.add_request(b)
    preempted = []
    steps = 0
    while scheduler.has_unfinished_requests():
        out = step(scheduler, runner)
        preempted += [r.request_id for r in out.preempted]
        if out.preempted:
            assert scheduler.waiting[0] is b and not scheduler.kv.block_table("b")
        steps += 1
        assert steps < 200
    assert preempted and set(preempted) == {"b"}  # always the newest
    assert b.num_preemptions >= 1
    assert a.output_token_ids == reference_output(prompt_of(6, 1), 10)
    assert b.output_token_ids == reference_output(prompt_of(6, 2), 10)


def test_prompt_that_can_never_fit_fails_alone_without_spinning():
    # with a 2-block pool a 100-token prompt must fail, not wait forever for blocks.
    scheduler, runner = make_scheduler(num_blocks=2, block_size=4)
    big = make_request("big", prompt_of(100))
    small = make_request("small", prompt_of(3), max_tokens=4)
    scheduler.add_request(big)
    scheduler.add_request(small)
    out = step(scheduler, runner)
    assert out.failed == [big]
    assert big.finish_reason == "error" and "needs 25 KV blocks" in big.error and "has 2" in big.error
    run_all(scheduler, runner, max_steps=20)
    assert small.output_token_ids == reference_output(prompt_of(3), 4)


def test_request_that_outgrows_the_pool_stops_with_an_error_instead_of_preempting_itself_forever():
    scheduler, runner = make_scheduler(num_blocks=2, block_size=4)
    request = make_request("a", prompt_of(5), max_tokens=10)  # would need 15 tokens, the pool holds 8
    scheduler.add_request(request)
    run_all(scheduler, runner, max_steps=20)
    assert request.finish_reason == "error" and request.output_token_ids == reference_output(prompt_of(5), 4)


@pytest.mark.parametrize("abort_after_steps", [0, 1, 2, 5])
def test_abort_at_any_point_frees_blocks(abort_after_steps):
    scheduler, runner = make_scheduler(budget=4)
    victim = make_request("victim", prompt_of(10), max_tokens=20)
    other = make_request("other", prompt_of(6, 3), max_tokens=8)
    scheduler.add_request(victim)
    scheduler.add_request(other)
    for _ in range(abort_after_steps):
        step(scheduler, runner)
    finished = scheduler.finish_requests(["victim", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert finished == [victim] and victim.finish_reason == "abort"
    assert not scheduler.kv.block_table("victim")
    scheduler.check_invariants()
    run_all(scheduler, runner)
    assert other.output_token_ids == reference_output(prompt_of(6, 3), 8)


def test_stop_rules():
    scheduler, runner = make_scheduler()
    prompt = prompt_of(4)
    expected = reference_output(prompt, 8)
    stop_at = expected[2]
    by_token = make_request("tok", prompt, max_tokens=8, stop_token_ids=[stop_at])
    by_length = make_request("len", prompt, max_tokens=3)
    eos_prompt = next(prompt_of(4, s) for s in range(100) if EOS in reference_output(prompt_of(4, s), 8))
    by_eos = make_request("eos", eos_prompt, max_tokens=8, ignore_eos=False)
    ignoring = make_request("ign", eos_prompt, max_tokens=8, ignore_eos=True)
    for request in (by_token, by_length, by_eos, ignoring):
        scheduler.add_request(request)
    run_all(scheduler, runner)
    first_stop = expected.index(stop_at)
    assert by_token.output_token_ids == expected[:first_stop + 1]
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", stop_at)
    assert by_length.output_token_ids == expected[:3] and by_length.finish_reason == "length"
    assert by_eos.output_token_ids == reference_output(eos_prompt, 8, ignore_eos=False)
    assert by_eos.output_token_ids[-1] == EOS
    assert (by_eos.finish_reason, by_eos.stop_reason) == ("stop", None)
    assert ignoring.output_token_ids == reference_output(eos_prompt, 8) and ignoring.finish_reason == "length"


def test_max_model_len_stops_with_length():
    scheduler, runner = make_scheduler(max_model_len=10)
    request = make_request("a", prompt_of(7), max_tokens=50)
    scheduler.add_request(request)
    run_all(scheduler, runner)
    assert request.num_tokens == 10 and request.finish_reason == "length"


def test_prefix_hit_skips_cached_blocks_and_gives_the_same_output():
    scheduler, runner = make_scheduler(block_size=4)
    prompt = prompt_of(14)
    first = make_request("first", prompt)
    scheduler.add_request(first)
    run_all(scheduler, runner)
    second = make_request("second", prompt)
    scheduler.add_request(second)
    out = step(scheduler, runner)
    assert (out.chunks[0].start_pos, out.chunks[0].num_tokens) == (12, 2)
    assert (out.prefix_cache_queries, out.prefix_cache_hits) == (14, 12)
    run_all(scheduler, runner)
    assert second.num_cached_tokens == 12 and first.num_cached_tokens == 0
    assert second.output_token_ids == first.output_token_ids == reference_output(prompt, 5)


def test_sibling_waits_for_the_leaders_prompt_blocks_then_shares_them():
    scheduler, runner = make_scheduler(block_size=4, budget=8)
    prompt = prompt_of(13)
    leader = make_request("p-0", prompt)
    sibling = make_request("p-1", prompt)
    sibling.wait_for = leader
    scheduler.add_request(leader)
    scheduler.add_request(sibling)
    late = make_request("late", prompt_of(3, 5))
    scheduler.add_request(late)
    out = step(scheduler, runner)
    # The sibling is skipped without blocking the queue behind it.
    assert [c.request_id for c in out.chunks] == ["p-0"]
    out = step(scheduler, runner)
    assert [c.request_id for c in out.chunks] == ["p-0", "late"]
    out = step(scheduler, runner)  # the leader's prompt is cached: the sibling computes only its last token
    chunk = next(c for c in out.chunks if c.request_id == "p-1")
    assert (chunk.start_pos, chunk.num_tokens) == (12, 1)
    assert scheduler.kv.block_table("p-1")[:3] == scheduler.kv.block_table("p-0")[:3]
    run_all(scheduler, runner)
    assert sibling.num_cached_tokens == 12
    assert sibling.output_token_ids == leader.output_token_ids == reference_output(prompt, 5)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(4, 24),
    block_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(1, 24),
    max_num_seqs=st.integers(1, 5),
    prefix=st.booleans(),
    plan=st.lists(st.tuples(st.integers(0, 4), st.integers(1, 14), st.integers(1, 6), st.integers(0, 3),
                            st.booleans()), min_size=1, max_size=8),
)
def test_random_schedules_keep_invariants_and_solo_outputs(num_blocks, block_size, budget, max_num_seqs,
                                                           prefix, plan):
    """Random arrivals (step, prompt length, max_tokens, shared-prefix seed, abort) over tiny pools."""
    scheduler, runner = make_scheduler(num_blocks=num_blocks, block_size=block_size, budget=budget,
                                       max_num_seqs=max_num_seqs, prefix=prefix)
    arrivals = sorted((arrive, i, length, max_tokens, seed, abort)
                      for i, (arrive, length, max_tokens, seed, abort) in enumerate(plan))
    requests = {}
    step_index = 0
    while arrivals or scheduler.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= step_index:
            _, i, length, max_tokens, seed, abort = arrivals.pop(0)
            requests[f"r{i}"] = (make_request(f"r{i}", prompt_of(length, seed), max_tokens=max_tokens), abort)
            scheduler.add_request(requests[f"r{i}"][0])
        step(scheduler, runner)
        for request, abort in requests.values():
            if abort and request.num_computed_tokens >= 2:
                scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)
        step_index += 1
        assert step_index < 3000
    assert scheduler.kv.pool.num_free_blocks + scheduler.kv.pool.num_evictable_blocks == num_blocks
    for request, abort in requests.values():
        assert request.is_finished
        if request.finish_reason == "abort":
            continue
        expected = reference_output(request.prompt_token_ids, request.params.max_tokens)
        if request.finish_reason == "error":  # only a request that outgrows the whole pool may fail
            assert scheduler.kv.blocks_needed(request.num_tokens) > num_blocks
            assert request.output_token_ids == expected[:request.num_output_tokens]
            continue
        assert request.output_token_ids == expected
