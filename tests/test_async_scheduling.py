"""Async scheduling (LLMEngine with EngineConfig.async_scheduling): step N+1 is scheduled and launched
before step N's tokens are read, its decodes taking N's sampled tokens on the device.

The reference is the same engine stepping synchronously (async_scheduling=False), itself checked
against HF transformers in test_engine.py: every scenario must give identical token ids, text,
logprobs, finish and stop reasons, cached-token counts and token counts in the stats, with
`check_invariants` after every step and no leaked block at the end. The tiny Llama's weights are
drawn with initializer_range 0.2 (as in test_engine.py), so greedy and seeded tokens do not depend
on the ~1e-6 float differences between batch shapes, which differ between the two modes.
"""

import random
from collections import defaultdict

import pytest
import torch
from conftest import save_tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer import SamplingParams
from deepinfer.core.config import EngineConfig
from deepinfer.core.engine.llm_engine import LLMEngine
from deepinfer.core.engine.sched.request import Request
from deepinfer.core.engine.sched.scheduler_output import ScheduledChunk, SchedulerOutput
from deepinfer.core.engine.worker.cuda_graphs import StaticStepBuffers
from deepinfer.core.engine.worker.inflight import InflightStep
from deepinfer.core.engine.worker.model_runner import ModelRunner
from deepinfer.core.engine.worker.sampler import Sampler, SamplingRow
from deepinfer.core.kv.cache import KVCache
from deepinfer.core.models.loader import load_model


@pytest.fixture(scope="module")
def loaded(tmp_path_factory, tiny_tokenizer):
    directory = tmp_path_factory.mktemp("async_llama")
    save_tiny_model("llama", directory, tiny_tokenizer, seed=7, initializer_range=0.2, num_hidden_layers=2)
    return load_model(EngineConfig(model=str(directory)), torch.device("cpu"), torch.float32)


def make_engine(loaded, async_scheduling, decode_mode=None, **overrides) -> LLMEngine:
    settings = {"num_gpu_blocks": 128, "block_size": 8, "max_num_seqs": 8, "max_num_batched_tokens": 32}
    config = EngineConfig(**{**settings, **overrides}, async_scheduling=async_scheduling)
    return LLMEngine(config, loaded_model=loaded, decode_mode=decode_mode)


def greedy(max_tokens, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def seeded(max_tokens, seed, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=seed, max_tokens=max_tokens,
                          ignore_eos=True, **kw)


def prompt(length, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 340) for _ in range(length)]


class Run:
    """What one drive of an engine produced."""

    def __init__(self):
        self.finals = {}  # request id -> final RequestOutput
        self.deltas = defaultdict(list)  # (request id, sample index) -> streamed token ids
        self.stats = []
        self.aborted_in_flight = {}  # request id -> whether a step in flight held it when aborted


def drive(engine, arrivals, abort_after=None, max_steps=2000) -> Run:
    """arrivals: [(step, prompt, params, request id)], added before that step() call; abort_after:
    {request id: n}, aborted as soon as an output shows n tokens."""
    run, queue, abort_after = Run(), sorted(arrivals, key=lambda a: a[0]), abort_after or {}

    def record(output):
        for completion in output.outputs:
            run.deltas[output.request_id, completion.index] += completion.delta_token_ids
        if output.finished:
            run.finals[output.request_id] = output

    for step in range(max_steps):
        if not (queue or engine.has_unfinished_requests()):
            break
        while queue and queue[0][0] <= step:
            _, prompt_ids, params, request_id = queue.pop(0)
            engine.add_request(prompt_ids, params, request_id)
        outputs, stats = engine.step()
        engine.scheduler.check_invariants()
        run.stats.append(stats)
        for output in outputs:
            record(output)
            limit = abort_after.get(output.request_id)
            if limit is not None and not output.finished and len(output.outputs[0].token_ids) >= limit:
                inflight = engine._inflight
                run.aborted_in_flight[output.request_id] = inflight is not None and output.request_id in {
                    c.request_id for c in inflight.scheduler_output.chunks}
                for final in engine.abort(output.request_id):
                    record(final)
    assert not engine.has_unfinished_requests(), "the engine does not make progress"
    run.stats.append(engine.step()[1])  # an abort after the last step is reported by the next one
    pool = engine.scheduler.kv.pool
    assert pool.num_free_blocks + pool.num_evictable_blocks == pool.num_blocks, "blocks leaked"
    return run


def assert_identical(reference: Run, other: Run, exact_cache: bool = True):
    """exact_cache=False: prefix-cache hits (cached tokens, hence computed prompt tokens) may differ:
    a block's K/V is cached when its step is applied, so what a request finds depends on which
    step admits it and on what the pool evicted by then, which differ between the modes."""
    assert set(other.finals) == set(reference.finals)
    for request_id, want in reference.finals.items():
        got = other.finals[request_id]
        assert (got.finish_reason, got.error) == (want.finish_reason, want.error), request_id
        if exact_cache:
            assert got.num_cached_tokens == want.num_cached_tokens, request_id
        for a, b in zip(want.outputs, got.outputs, strict=True):
            assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (
                a.token_ids, a.text, a.finish_reason, a.stop_reason), request_id
            assert other.deltas[request_id, b.index] == b.token_ids  # streamed once each, in order
            if a.logprobs is not None:
                for x, y in zip(a.logprobs, b.logprobs, strict=True):
                    assert (y.token_id, [t for t, _ in y.top]) == (x.token_id, [t for t, _ in x.top])
                    assert y.logprob == pytest.approx(x.logprob, abs=1e-5)

    def totals(run):
        return (sum(s.num_generation_tokens for s in run.stats),
                sum(s.num_prompt_tokens for s in run.stats) if exact_cache else None,
                sorted(f.finish_reason for s in run.stats for f in s.finished_requests))

    assert totals(other) == totals(reference)
    num_tokens = sum(len(c.token_ids) for out in reference.finals.values() for c in out.outputs)
    assert totals(reference)[0] == num_tokens  # stats count every kept token once


def compare(loaded, arrivals, abort_after=None, decode_mode=None, setup=None, exact_cache=True, **settings):
    """Drive a synchronous and an async engine alike; assert identical results. -> (sync, async) runs."""
    runs = []
    for async_scheduling in (False, True):
        engine = make_engine(loaded, async_scheduling, decode_mode, **settings)
        if setup is not None:
            setup(engine)
        runs.append(drive(engine, arrivals, abort_after))
    assert_identical(*runs, exact_cache=exact_cache)
    return runs


def mixed_requests():
    """Greedy and seeded top-k/top-p requests of different prompt and output lengths (1 and 2 too),
    some with logprobs, so requests finish at different steps while others go on."""
    shapes = [(5, 9), (17, 1), (40, 2), (2, 6)]  # (prompt length, max_tokens)
    requests = [(prompt(length, i), greedy(n)) for i, (length, n) in enumerate(shapes)]
    requests += [(prompt(9, 10), seeded(12, seed=3)), (prompt(23, 11), seeded(1, seed=4)),
                 (prompt(3, 12), seeded(2, seed=5, logprobs=2)), (prompt(12, 13), greedy(7, logprobs=3))]
    return [(0, p, params, f"r{i}") for i, (p, params) in enumerate(requests)]


def test_greedy_seeded_and_short_requests_are_identical(loaded):
    sync, _ = compare(loaded, mixed_requests())
    assert [len(sync.finals[f"r{i}"].outputs[0].token_ids) for i in range(8)] == [9, 1, 2, 6, 12, 1, 2, 7]


def test_requests_added_while_a_step_is_in_flight(loaded):
    arrivals = [(step, prompt(7 + step, 20 + i), params, f"late{i}")
                for i, (step, params) in enumerate([(0, greedy(8)), (1, seeded(6, seed=1)), (2, greedy(3)),
                                                    (4, seeded(9, seed=2, logprobs=1)), (7, greedy(1))])]
    compare(loaded, arrivals)


def test_stops_by_eos_stop_token_and_stop_string_at_different_steps(loaded):
    probe = make_engine(loaded, async_scheduling=False)
    base = [(prompt(6 + i, 30 + i), greedy(12)) for i in range(3)]
    reference = drive(probe, [(0, p, params, f"s{i}") for i, (p, params) in enumerate(base)])
    tokens = [reference.finals[f"s{i}"].outputs[0].token_ids for i in range(3)]
    text = reference.finals["s2"].outputs[0].text
    eos = tokens[0][3]  # s0 stops at its 4th token (or earlier, where the same token comes first)
    arrivals = [
        (0, base[0][0], SamplingParams(temperature=0.0, max_tokens=12), "eos"),
        (0, base[1][0], greedy(12, stop_token_ids=[tokens[1][6]]), "stop-token"),
        (0, base[2][0], greedy(12, stop=[text[len(text) // 3:len(text) // 3 + 2]]), "stop-string"),
        (0, prompt(11, 40), greedy(14), "runs-on"),
        (0, prompt(5, 41), seeded(14, seed=9), "runs-on-seeded"),
    ]

    def use_eos(engine):
        engine.eos_token_ids = frozenset({eos})

    sync, _ = compare(loaded, arrivals, setup=use_eos)
    reasons = {rid: (out.finish_reason, out.outputs[0].stop_reason) for rid, out in sync.finals.items()}
    assert reasons["eos"] == ("stop", None) and reasons["stop-token"] == ("stop", tokens[1][6])
    assert reasons["stop-string"][0] == "stop" and isinstance(reasons["stop-string"][1], str)
    assert len({len(sync.finals[r].outputs[0].token_ids) for r in ("eos", "stop-token", "stop-string")}) > 1


def test_n_samples_share_prompt_blocks_through_the_prefix_cache(loaded):
    """Samples 1 and 2 wait for sample 0's prompt blocks to be cached, which happens when its step is
    applied, in both modes. (A separate request with that prompt added one step after it would hit
    them synchronously but not with async scheduling, where that step is still in flight: the one
    documented difference, in cached-token counts only; here it comes later, when both hit.)"""
    n3 = SamplingParams(n=3, seed=1, temperature=1.0, max_tokens=6, ignore_eos=True)
    arrivals = [(0, prompt(21, 50), n3, "n3"), (0, prompt(9, 51), greedy(5), "other"),
                (4, prompt(21, 50), greedy(4), "same-prompt-later")]
    sync, _ = compare(loaded, arrivals)
    assert sync.finals["n3"].num_cached_tokens == 16  # later samples hit the first one's 2 full blocks
    assert sync.finals["same-prompt-later"].num_cached_tokens == 16


def test_preemption_keeps_the_pending_token(loaded, monkeypatch):
    """6 blocks of 8 tokens: requests growing to 30 tokens must take turns. With a step in flight,
    the preempted requests have a pending token; it is kept (appended when its step is applied),
    so greedy and seeded outputs match the synchronous engine's exactly."""
    from deepinfer.core.engine.sched.scheduler import Scheduler

    pending_at_preemption = []
    real_preempt = Scheduler._preempt

    def recording_preempt(self, request):
        pending_at_preemption.append(request.num_pending_tokens)
        real_preempt(self, request)

    monkeypatch.setattr(Scheduler, "_preempt", recording_preempt)
    arrivals = [(0, prompt(10, 60 + i), params, f"p{i}") for i, params in enumerate(
        [greedy(20), seeded(20, seed=6), seeded(20, seed=7), greedy(20, logprobs=1)])]
    compare(loaded, arrivals, num_gpu_blocks=6, max_num_batched_tokens=16)
    assert 1 in pending_at_preemption  # the async engine preempted requests with a token in flight


def test_abort_while_the_request_is_in_flight(loaded):
    arrivals = [(0, prompt(12, 70), greedy(20), "victim"), (0, prompt(8, 71), seeded(10, seed=2), "other"),
                (1, prompt(30, 72), greedy(6), "later")]
    sync, async_run = compare(loaded, arrivals, abort_after={"victim": 3})
    final = async_run.finals["victim"]
    assert (final.finish_reason, len(final.outputs[0].token_ids)) == ("abort", 3)
    assert async_run.aborted_in_flight == {"victim": True} and sync.aborted_in_flight == {"victim": False}


def test_padded_steps_take_the_pending_tokens_on_the_device(loaded):
    """decode_mode="padded" runs the CUDA graphs' static buffers eagerly: their device-side fill of
    pending tokens gives the unpadded synchronous engine's outputs."""
    _, async_padded = compare(loaded, mixed_requests(), decode_mode="padded")
    eager = drive(make_engine(loaded, async_scheduling=False), mixed_requests())
    for request_id, want in eager.finals.items():
        assert async_padded.finals[request_id].outputs[0].token_ids == want.outputs[0].token_ids


# The overlap itself -------------------------------------------------------------------------------------


def record_launches_and_reads(engine, monkeypatch) -> list:
    """Events ("launch", k, sampled request ids) when the runner launches step k and ("read", k, None)
    when the host waits for step k's tokens."""
    events, numbers, launched = [], {}, []
    real_launch, real_result = engine.runner.launch, InflightStep.result

    def launch(*args):
        step = real_launch(*args)
        launched.append(step)  # kept alive, so no later step can take a finished one's id()
        numbers[id(step)] = len(numbers)
        events.append(("launch", numbers[id(step)], {c.request_id for c in step.sampling_chunks}))
        return step

    def result(step):
        events.append(("read", numbers[id(step)], None))
        return real_result(step)

    engine.runner.launch = launch
    monkeypatch.setattr(InflightStep, "result", result)
    return events


def overlapped_steps(events) -> set[int]:
    """Steps k whose successor was launched before k's tokens were read."""
    order = {event[:2]: i for i, event in enumerate(events)}
    return {k for kind, k in order
            if kind == "read" and order.get(("launch", k + 1), len(events)) < order[kind, k]}


def test_the_next_step_is_launched_before_the_tokens_of_the_last_are_read(loaded, monkeypatch):
    arrivals = [(0, prompt(5, 90), greedy(6), "a"), (0, prompt(9, 91), seeded(4, seed=1), "b")]
    for async_scheduling in (True, False):
        engine = make_engine(loaded, async_scheduling)
        events = record_launches_and_reads(engine, monkeypatch)
        engine.add_request(prompt(5, 90), greedy(6), "a")
        first_outputs, _ = engine.step()
        engine.scheduler.check_invariants()
        if async_scheduling:
            assert first_outputs == [] and engine.has_unfinished_requests()  # the prefill is in flight
        drive(engine, arrivals[1:])
        num_steps = sum(kind == "launch" for kind, _, _ in events)
        if async_scheduling:  # every step but the last overlaps the one after it
            assert overlapped_steps(events) == set(range(num_steps - 1))
        else:
            assert overlapped_steps(events) == set()


def test_no_step_is_launched_past_max_tokens(loaded, monkeypatch):
    """A request whose pending token reaches max_tokens is not scheduled again: each length-finished
    request samples in exactly max_tokens launched steps. One that stops on a token's value may be
    in one more step, whose token is discarded."""
    engine = make_engine(loaded, async_scheduling=True)
    events = record_launches_and_reads(engine, monkeypatch)
    run = drive(engine, mixed_requests())
    launches = defaultdict(int)
    for kind, _, ids in events:
        for request_id in ids or ():
            launches[request_id] += kind == "launch"
    assert launches == {rid: len(out.outputs[0].token_ids) for rid, out in run.finals.items()}


def test_a_request_awaiting_its_last_token_gives_up_its_seat(loaded):
    """max_num_seqs=1: while the step in flight samples a request's last token, the next request is
    admitted into the step launched beside it, so async stepping needs no more step() calls than
    synchronous stepping (plus the last one that applies the step in flight)."""
    arrivals = [(0, prompt(3 + i, 95 + i), greedy(2), f"q{i}") for i in range(4)]
    sync, async_run = compare(loaded, arrivals, max_num_seqs=1)
    assert len(async_run.stats) == len(sync.stats) + 1


# Input staging: the device-side fill, on exact buffers ---------------------------------------------------


class FakeSampled:
    def __init__(self, tokens):
        self.sampled = torch.tensor(tokens, dtype=torch.int64)


def pending_decode(request_id, tokens, table):
    """A decode of the token after `tokens`, which the step in flight samples."""
    return ScheduledChunk(Request(request_id, tokens, greedy(4)), len(tokens), 1, table, sample=True,
                          last_token_pending=True)


def in_flight_step(request_ids, tokens):
    chunks = [ScheduledChunk(Request(r, [1], greedy(4)), 0, 1, [0], sample=True) for r in request_ids]
    return InflightStep(SchedulerOutput(chunks=chunks), chunks, FakeSampled(tokens))


def test_static_buffers_fill_pending_tokens_from_the_step_in_flight():
    buffers = StaticStepBuffers(max_tokens=16, max_rows=4, max_model_len=64, block_size=4, dummy_block=99,
                                device=torch.device("cpu"))
    known = Request("k", [5, 6, 7], greedy(4))
    chunks = [pending_decode("x", [3, 4, 5, 6, 7], [2, 8]), ScheduledChunk(known, 2, 1, [4], sample=True),
              pending_decode("y", [1, 2], [6])]
    previous = in_flight_step(["y", "z", "x"], [301, 302, 303])
    buffers.load(chunks, tokens=4, bound=16, previous=previous)
    input_ids, positions, _, meta = buffers.views(4, 16)
    assert input_ids.tolist() == [303, 7, 301, 0]  # x's and y's tokens from the device, padding last
    assert positions.tolist() == [5, 2, 2, 0]
    assert meta.slot_mapping.tolist() == [8 * 4 + 1, 4 * 4 + 2, 6 * 4 + 2, 99 * 4]
    with pytest.raises(RuntimeError, match="'y' has a pending token but no step is in flight"):
        buffers.load(chunks[2:], tokens=1, bound=16)


def test_static_buffers_take_pending_tokens_the_last_padded_step_sampled_into_them():
    """A padded step's sampler writes its tokens into the static input ids (`sampled_ids`): the next step
    finds them in place when its rows are the same requests in the same order, and reads them before its
    copy overwrites the ids when they are not."""
    buffers = StaticStepBuffers(max_tokens=16, max_rows=4, max_model_len=64, block_size=4, dummy_block=99,
                                device=torch.device("cpu"))

    def sampled_in_place(request_ids, tokens):
        previous = in_flight_step(request_ids, tokens)
        previous.sampled.sampled = buffers.sampled_ids(len(tokens)).copy_(torch.tensor(tokens))
        return previous

    steady = [pending_decode("y", [1, 2], [6]), pending_decode("z", [1, 2, 3], [7]), pending_decode("x", [3, 4], [2])]
    buffers.load(steady, tokens=4, bound=16, previous=sampled_in_place(["y", "z", "x"], [301, 302, 303]))
    input_ids, positions, _, meta = buffers.views(4, 16)
    assert input_ids.tolist() == [301, 302, 303, 0] and positions.tolist() == [2, 3, 2, 0]
    assert meta.slot_mapping.tolist() == [6 * 4 + 2, 7 * 4 + 3, 2 * 4 + 2, 99 * 4]
    known = Request("k", [5, 6, 7], greedy(4))
    joined = [pending_decode("x", [3, 4, 5, 6, 7], [2, 8]), ScheduledChunk(known, 2, 1, [4], sample=True),
              pending_decode("y", [1, 2], [6])]
    buffers.load(joined, tokens=4, bound=16, previous=sampled_in_place(["y", "z", "x"], [401, 402, 403]))
    assert buffers.views(4, 16)[0].tolist() == [403, 7, 401, 0]


def test_eager_inputs_fill_pending_tokens_from_the_step_in_flight(loaded):
    spec = loaded.spec
    cache = KVCache(spec.num_layers, 16, 8, spec.num_kv_heads, spec.head_dim, torch.float32, "cpu")
    runner = ModelRunner(loaded.model, cache, torch.device("cpu"), block_size=8, max_num_batched_tokens=64,
                         max_num_seqs=4, max_model_len=128)
    prefill = Request("p", list(range(10, 22)), greedy(4))
    out = SchedulerOutput(chunks=[ScheduledChunk(prefill, 8, 4, [3, 7], sample=True),
                                  pending_decode("d", list(range(60, 69)), [5, 6]),
                                  pending_decode("e", [40, 41], [9])])
    inputs = runner.prepare_inputs(out, in_flight_step(["e", "d"], [77, 88]))
    assert inputs.input_ids.tolist() == [88, 77, 18, 19, 20, 21]  # decodes first, filled on the device
    assert inputs.positions.tolist() == [9, 2, 8, 9, 10, 11]
    with pytest.raises(RuntimeError, match="'d' has a pending token, but the step in flight did not"):
        runner.prepare_inputs(out, in_flight_step(["e"], [77]))


def test_the_chunk_says_which_input_token_is_pending_not_the_request(loaded):
    """Both stagers take a chunk's last input token from the step in flight exactly when the chunk says it
    is pending, whatever the live Request holds: here the request already knows that token (42), and a
    prompt chunk's last token is pending too."""
    spec = loaded.spec
    cache = KVCache(spec.num_layers, 16, 8, spec.num_kv_heads, spec.head_dim, torch.float32, "cpu")
    runner = ModelRunner(loaded.model, cache, torch.device("cpu"), block_size=8, max_num_batched_tokens=64,
                         max_num_seqs=4, max_model_len=128)
    buffers = StaticStepBuffers(max_tokens=16, max_rows=4, max_model_len=64, block_size=8, dummy_block=15,
                                device=torch.device("cpu"))
    previous = in_flight_step(["d", "p"], [77, 88])
    for pending, expected in ((True, [77, 30, 31, 88]), (False, [42, 30, 31, 32])):
        decode = ScheduledChunk(Request("d", [40, 41, 42], greedy(4)), 2, 1, [5], sample=True,
                                last_token_pending=pending)
        prompt = ScheduledChunk(Request("p", [30, 31, 32], greedy(4)), 0, 3, [6], sample=True,
                                last_token_pending=pending)
        inputs = runner.prepare_inputs(SchedulerOutput(chunks=[decode, prompt]), previous)
        assert inputs.input_ids.tolist() == expected
        buffers.load([decode, prompt], tokens=4, bound=16, previous=previous)
        assert buffers.views(4, 16)[0].tolist() == expected


# GPU: the launch path must not make the host wait for the device ------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sampling_starts_its_copies_without_a_sync():
    torch.manual_seed(0)
    logits = torch.randn(6, 5000, device="cuda")
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=1),
              SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=1.0, min_p=0.1, seed=2),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=3, logprobs=0)]

    def rows():
        from deepinfer.core.engine.worker.sampler import make_generator

        return [SamplingRow(p, [1, 2], [3], make_generator(p, "cuda")) for p in params]

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = Sampler().sample(logits, rows())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    reference = Sampler().sample(logits.cpu(), [SamplingRow(p, [1, 2], [3]) for p in params])
    assert out.sampled.device.type == "cuda"
    greedy_rows = [0, 2, 4]
    assert [out.token_ids[i] for i in greedy_rows] == [reference.token_ids[i] for i in greedy_rows]
    assert out.logprobs[2].token_id == out.token_ids[2] and len(out.logprobs[2].top) == 3
    assert out.logprobs[5].top == [] and out.logprobs[0] is None


# Random schedules ------------------------------------------------------------------------------------------


def random_params(kind, max_tokens, seed):
    kinds = {
        "greedy": greedy(max_tokens),
        "seeded": seeded(max_tokens, seed=seed),
        "logprobs": seeded(max_tokens, seed=seed, logprobs=2),
        "penalty": greedy(max_tokens, presence_penalty=0.5),
        "eos": SamplingParams(temperature=0.0, max_tokens=max_tokens),
        "stop": greedy(max_tokens, stop=["e", "a"]),
        "n2": SamplingParams(n=2, temperature=1.0, top_k=40, seed=seed, max_tokens=max_tokens, ignore_eos=True),
    }
    return kinds[kind]


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    num_blocks=st.integers(5, 12),
    budget=st.integers(1, 40),
    max_num_seqs=st.integers(1, 5),
    prefix_caching=st.booleans(),
    decode_mode=st.sampled_from(["eager", "padded"]),
    plan=st.lists(st.tuples(
        st.integers(0, 5),  # arrival step
        st.integers(1, 20),  # prompt length
        st.integers(1, 8),  # max_tokens
        st.sampled_from(["greedy", "seeded", "logprobs", "penalty", "eos", "stop", "n2"]),
        st.one_of(st.none(), st.integers(1, 6)),  # abort once this many tokens were delivered
    ), min_size=1, max_size=6),
)
def test_random_schedules_are_identical(loaded, num_blocks, budget, max_num_seqs, prefix_caching, decode_mode,
                                        plan):
    """Arrivals, aborts, n = 2, stops and EOS, penalties and logprobs, tiny pools (preemption) and
    budgets (chunked prefill), eager or padded steps: identical results, prefix-cache hits aside."""
    arrivals = [(step, prompt(length, 100 + i), random_params(kind, max_tokens, seed=i), f"r{i}")
                for i, (step, length, max_tokens, kind, _) in enumerate(plan)]
    # An abort of n = 2 samples would depend on how far sample 1 got when sample 0 showed its
    # tokens, which is timing, not a result: such requests run to the end.
    abort_after = {f"r{i}": abort for i, (*_, kind, abort) in enumerate(plan) if abort is not None and kind != "n2"}

    def frequent_eos(engine):
        engine.eos_token_ids = frozenset(range(0, 384, 7))

    compare(loaded, arrivals, abort_after, decode_mode=decode_mode, setup=frequent_eos,
            exact_cache=not prefix_caching, num_gpu_blocks=num_blocks, max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs, enable_prefix_caching=prefix_caching)
