"""The engine end to end on a tiny random Llama (fp32, CPU): HF greedy parity, batching, chunking,
prefix caching, preemption, INT8 KV, sampling wiring, isolation of failures, LLM and AsyncEngine.

The model's weights are drawn with initializer_range 0.2, so its top-2 logit gaps (>= 2e-3 on
sampled contexts) dwarf the ~1e-6 float differences between batch shapes: greedy comparisons
between runs are exact, not lucky.
"""

import asyncio
import gc
import random
import sys

import pytest
import torch
from conftest import save_tiny_model

from deepinfer import LLM, AsyncEngine, SamplingParams
from deepinfer.core.config import EngineConfig
from deepinfer.core.engine.interpreter import SERVING_SWITCH_INTERVAL_S
from deepinfer.core.engine.llm_engine import LLMEngine
from deepinfer.core.engine.worker.memory import DeviceMemory, plan_kv_budget
from deepinfer.core.errors import DeepInferError, InvalidRequestError, PromptTooLongError, QueueFullError
from deepinfer.core.models.loader import load_model

MiB = 1024**2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer):
    directory = tmp_path_factory.mktemp("engine_llama")
    save_tiny_model("llama", directory, tiny_tokenizer, seed=7, initializer_range=0.2, num_hidden_layers=2)
    return directory


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load_model(EngineConfig(model=str(model_dir)), torch.device("cpu"), torch.float32)


def make_engine(loaded, **overrides) -> LLMEngine:
    settings = {"num_gpu_blocks": 256, "block_size": 8, "max_num_seqs": 16, "max_num_batched_tokens": 64}
    return LLMEngine(EngineConfig(**{**settings, **overrides}), loaded_model=loaded)


def greedy(max_tokens=10, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def prompt(length, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 340) for _ in range(length)]


def run(engine, requests, max_steps=5000):
    """requests: [(prompt, params)] or [(prompt, params, request_id, cache_salt)] -> {id: final output}."""
    ids = [engine.add_request(*request) for request in requests]
    finals = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        outputs, _ = engine.step()
        engine.scheduler.check_invariants()
        finals.update({o.request_id: o for o in outputs if o.finished})
    assert not engine.has_unfinished_requests(), "the engine does not make progress"
    assert_no_leaks(engine)
    return [finals[i] for i in ids]


def assert_no_leaks(engine):
    pool = engine.scheduler.kv.pool
    assert pool.num_free_blocks + pool.num_evictable_blocks == pool.num_blocks


def solo(loaded, prompt_ids, params):
    return run(make_engine(loaded), [(prompt_ids, params)])[0].token_ids


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_greedy_matches_hf_generate(loaded, hf_model):
    hf = hf_model
    engine = make_engine(loaded)
    text = "What is the capital of France?"
    prompts = [engine.tokenizer.encode(text), prompt(23, 1)]
    outputs = run(engine, [(p, greedy(12)) for p in prompts])
    for p, out in zip(prompts, outputs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        assert out.token_ids == ref[0, len(p):].tolist()
        assert out.finish_reason == "length"


def test_mixed_lengths_together_equal_each_alone(loaded):
    lengths = [1, 3, 9, 17, 30, 45, 64, 5]
    requests = [(prompt(length, i), greedy(3 + i % 5)) for i, length in enumerate(lengths)]
    together = run(make_engine(loaded, max_num_batched_tokens=32), requests)
    for (p, params), out in zip(requests, together):
        assert out.token_ids == solo(loaded, p, params)


@pytest.fixture(scope="module")
def chunk_reference(loaded):
    requests = [(prompt(length, 10 + i), greedy(6)) for i, length in enumerate([2, 13, 31])]
    return requests, [solo(loaded, p, params) for p, params in requests]


@pytest.mark.parametrize("budget", [1, 7, 16, 512])
def test_chunk_size_does_not_change_outputs(loaded, chunk_reference, budget):
    requests, expected = chunk_reference
    outputs = run(make_engine(loaded, max_num_batched_tokens=budget), requests)
    assert [o.token_ids for o in outputs] == expected


def test_prefix_cache_hit_gives_the_same_output_and_respects_the_tenant(loaded):
    engine = make_engine(loaded)
    p = prompt(30, 3)
    (first,) = run(engine, [(p, greedy(8))])
    (hit,) = run(engine, [(p, greedy(8))])
    (other_tenant,) = run(engine, [(p, greedy(8), None, "tenant-b")])
    assert first.num_cached_tokens == 0
    assert hit.num_cached_tokens == 24  # (30 - 1) // 8 blocks of 8
    assert other_tenant.num_cached_tokens == 0
    assert hit.token_ids == first.token_ids == other_tenant.token_ids == solo(loaded, p, greedy(8))
    stats = engine.health()["prefix_cache"]
    assert (stats["queried_tokens"], stats["hit_tokens"]) == (90, 24)


def test_preempted_requests_resume_with_identical_greedy_and_seeded_tokens(loaded):
    # 6 blocks of 8 tokens hold 48 tokens; three requests growing to 30 tokens each must take turns.
    requests = [(prompt(10, 20), greedy(20)), (prompt(10, 21), greedy(20)),
                (prompt(10, 22), SamplingParams(temperature=1.0, seed=5, max_tokens=20, ignore_eos=True))]
    engine = make_engine(loaded, num_gpu_blocks=6, max_num_batched_tokens=16)
    outputs = run(engine, requests)
    assert engine.scheduler.num_preemptions_total > 0
    for (p, params), out in zip(requests, outputs):
        assert out.token_ids == solo(loaded, p, params)


class LogitsRecorder:
    """Wraps the runner's sampler and keeps every step's logits per request."""

    def __init__(self, sampler):
        self.sampler, self.logits = sampler, {}

    def sample(self, logits, rows, grammar_mask=None, out=None):
        for row_logits, row in zip(logits, rows):
            key = tuple(row.prompt_token_ids)
            self.logits.setdefault(key, []).append(row_logits.clone())
        return self.sampler.sample(logits, rows, grammar_mask, out)


# e4m3 keeps 3 mantissa bits; the random model's near-flat logits turn its small errors into other greedy picks
@pytest.mark.parametrize("kv_dtype,bound,agreement", [("int8", 0.02, 0.9), ("fp8", 0.06, 0.6)])
def test_quantized_kv_stays_close_to_fp16(loaded, kv_dtype, bound, agreement):
    prompts = [prompt(length, 30 + i) for i, length in enumerate([5, 12, 24, 40, 57, 80])]
    runs = {}
    for dtype in ("float16", kv_dtype):
        engine = make_engine(loaded, kv_cache_dtype=dtype)
        engine.runner.sampler = LogitsRecorder(engine.runner.sampler)
        outputs = run(engine, [(p, greedy(16)) for p in prompts])
        runs[dtype] = ([o.token_ids for o in outputs], engine.runner.sampler.logits)
    (tokens16, logits16), (tokens8, logits8) = runs["float16"], runs[kv_dtype]
    max_diff, agree, total = 0.0, 0, 0
    for p, t16, t8 in zip(prompts, tokens16, tokens8):
        steps = next((i for i, (a, b) in enumerate(zip(t16, t8)) if a != b), len(t16)) + 1
        for a, b in zip(logits16[tuple(p)][:steps], logits8[tuple(p)][:steps]):  # same contexts only
            max_diff = max(max_diff, (a - b).abs().max().item())
        agree += sum(a == b for a, b in zip(t16, t8))
        total += len(t16)
    logit_scale = max(x.abs().max().item() for xs in logits16.values() for x in xs)
    print(f"{kv_dtype} vs FP16 KV: max |logit diff| {max_diff:.4f} (logits up to {logit_scale:.2f}), "
          f"greedy token agreement {agree}/{total}")
    assert max_diff < bound * logit_scale
    assert agree >= agreement * total


def test_sampling_parameters_are_wired_through(loaded):
    engine = make_engine(loaded)
    p = prompt(9, 40)
    (reference,) = run(engine, [(p, greedy(16))])
    tokens, text = reference.token_ids, reference.text
    stop_token = tokens[5]
    (by_token,) = run(engine, [(p, greedy(16, stop_token_ids=[stop_token]))])
    assert by_token.token_ids == tokens[:tokens.index(stop_token) + 1]
    assert (by_token.finish_reason, by_token.outputs[0].stop_reason) == ("stop", stop_token)

    stop = text[len(text) // 2:len(text) // 2 + 2]
    (by_string,) = run(engine, [(p, greedy(16, stop=[stop]))])
    assert by_string.text == text[:text.index(stop)] and stop not in by_string.text
    assert (by_string.finish_reason, by_string.outputs[0].stop_reason) == ("stop", stop)

    (six,) = run(engine, [(p, greedy(6))])
    last_stop = six.text[-2:]  # completed by the 6th token, the one that also reaches max_tokens
    (at_the_end,) = run(engine, [(p, greedy(6, stop=[last_stop]))])
    assert (at_the_end.finish_reason, at_the_end.outputs[0].stop_reason) == ("stop", last_stop)
    assert at_the_end.text == six.text[:six.text.index(last_stop)]

    (with_logprobs,) = run(engine, [(p, greedy(4, logprobs=3))])
    entries = with_logprobs.outputs[0].logprobs
    assert [e.token_id for e in entries] == tokens[:4]
    assert all(len(e.top) == 3 and e.top[0][0] == e.token_id and e.logprob == e.top[0][1] for e in entries)

    seeded = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True)
    a, _, alone_other_seed = run(engine, [(p, seeded), (prompt(33, 41), greedy(5)), (p, SamplingParams(
        temperature=0.9, top_k=50, top_p=0.9, seed=12, max_tokens=12, ignore_eos=True))])
    (again,) = run(make_engine(loaded), [(p, seeded)])
    assert a.token_ids == again.token_ids != alone_other_seed.token_ids
    assert a.token_ids != tokens[:12]


def penalized_greedy(hf_model, prompt_ids, num_tokens, prompt_counts=True):
    """HF logits of each context, penalized by hand (repetition 1.8 over prompt + output, frequency 0.7
    and presence 0.4 over the output), then argmax."""
    context, output = list(prompt_ids), []
    for _ in range(num_tokens):
        with torch.no_grad():
            logits = hf_model(torch.tensor([context])).logits[0, -1].clone()
        for token in set(context if prompt_counts else output):
            logits[token] = logits[token] / 1.8 if logits[token] > 0 else logits[token] * 1.8
        for token in set(output):
            logits[token] -= 0.7 * output.count(token) + 0.4
        output.append(int(logits.argmax()))
        context.append(output[-1])
    return output


def test_penalties_see_the_prompt_and_output_history(loaded, hf_model):
    params = greedy(8, repetition_penalty=1.8, frequency_penalty=0.7, presence_penalty=0.4)
    # A prompt where penalizing its own tokens changes the answer, so the prompt history must arrive.
    p = next(p for p in (prompt(12, seed) for seed in range(100))
             if penalized_greedy(hf_model, p, 8) != penalized_greedy(hf_model, p, 8, prompt_counts=False))
    (out,) = run(make_engine(loaded), [(p, params)])
    assert out.token_ids == penalized_greedy(hf_model, p, 8)
    assert out.token_ids != solo(loaded, p, greedy(8))


def test_n_samples_share_the_prompt_blocks(loaded):
    engine = make_engine(loaded)
    p = prompt(21, 50)
    (out,) = run(engine, [(p, SamplingParams(n=3, seed=1, temperature=1.0, max_tokens=6, ignore_eos=True))])
    assert len(out.outputs) == 3 and [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3  # seeds 1, 2, 3
    assert out.num_cached_tokens == 16  # the later samples hit the first one's (21 - 1) // 8 blocks
    assert engine.health()["prefix_cache"]["hit_tokens"] == 32
    for index, completion in enumerate(out.outputs):
        alone = SamplingParams(seed=1 + index, temperature=1.0, max_tokens=6, ignore_eos=True)
        assert completion.token_ids == solo(loaded, p, alone)


def test_bad_requests_are_refused_when_added(loaded):
    engine = make_engine(loaded, num_gpu_blocks=4, max_waiting_requests=2)  # pool: 32 tokens = max_model_len
    assert engine.max_model_len == 32
    with pytest.raises(PromptTooLongError,
                       match="25 tokens and max_tokens is 10: 35 tokens exceed max_model_len 32"):
        engine.add_request(prompt(25, 1), greedy(10))
    with pytest.raises(InvalidRequestError, match=r"prompt token 999 is not a token id in \[0, 384\)"):
        engine.add_request([1, 999], greedy())
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request([], greedy())
    with pytest.raises(InvalidRequestError, match="SamplingParams"):
        engine.add_request([1, 2], {"max_tokens": 3})
    with pytest.raises(InvalidRequestError, match="n=3 samples exceed max_waiting_requests 2"):
        engine.add_request([5, 6], SamplingParams(n=3))
    engine.add_request([5, 6], greedy(), "a")
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request([5, 6], greedy(), "a")
    engine.add_request([5, 6], greedy())
    with pytest.raises(QueueFullError):
        engine.add_request([5, 6], greedy())
    run(engine, [])


def test_explicit_max_model_len_beyond_the_pool_is_a_clear_error(loaded):
    with pytest.raises(DeepInferError,
                       match="max_model_len 100 does not fit the KV pool, which holds 32 tokens"):
        make_engine(loaded, num_gpu_blocks=4, max_model_len=100)


@pytest.mark.parametrize("abort_after_steps", [0, 1, 3, 8])
def test_abort_at_any_point_frees_blocks_and_spares_the_others(loaded, abort_after_steps):
    engine = make_engine(loaded, max_num_batched_tokens=8)
    other_prompt = prompt(12, 61)
    engine.add_request(prompt(20, 60), greedy(10), "victim")
    engine.add_request(other_prompt, greedy(10), "other")
    for _ in range(abort_after_steps):
        engine.step()
    (final,) = engine.abort("victim")
    assert final.finished and final.finish_reason == "abort"
    assert not engine.scheduler.kv.block_table("victim")
    engine.scheduler.check_invariants()
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step()[0]})
    assert finals["other"].token_ids == solo(loaded, other_prompt, greedy(10))
    assert engine.step()[1].finished_requests == []  # the abort was counted once, in an earlier step
    assert_no_leaks(engine)


def test_a_failing_step_fails_its_requests_only_and_the_engine_goes_on(loaded):
    engine = make_engine(loaded)
    real_launch = engine.runner.launch
    calls = {"n": 0}

    def flaky_launch(*args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device fell over")
        return real_launch(*args)

    engine.runner.launch = flaky_launch
    engine.add_request(prompt(6, 70), greedy(5), "early")
    engine.step()
    outputs, stats = engine.step()
    (failed,) = outputs
    assert (failed.request_id, failed.finish_reason, failed.finished) == ("early", "error", True)
    assert failed.error == "RuntimeError: device fell over"
    assert [f.finish_reason for f in stats.finished_requests] == ["error"]
    assert_no_leaks(engine)
    late_prompt = prompt(6, 71)
    (late,) = run(engine, [(late_prompt, greedy(5))])
    assert late.token_ids == solo(loaded, late_prompt, greedy(5))


def test_a_request_whose_detokenization_fails_fails_alone(loaded):
    engine = make_engine(loaded)
    engine.add_request(prompt(6, 80), greedy(5), "bad")
    engine.add_request(prompt(6, 81), greedy(5), "good")

    detokenizer = engine.output_processor.groups["bad"].detokenizers[0]

    class Exploding(type(detokenizer)):  # the same slots: the instance becomes one
        __slots__ = ()

        def append_text(self, token_id):
            raise UnicodeError("cannot decode")

    detokenizer.__class__ = Exploding
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step()[0] if o.finished})
    assert finals["bad"].finish_reason == "error" and "cannot decode" in finals["bad"].error
    assert finals["good"].finish_reason == "length" and len(finals["good"].token_ids) == 5
    assert_no_leaks(engine)


def test_llm_generate_and_chat(model_dir, loaded):
    llm = LLM(str(model_dir), num_gpu_blocks=64, block_size=8)
    p = prompt(7, 90)
    expected = solo(loaded, p, greedy(6))
    params = greedy(6)
    assert llm.generate(p, params)[0].token_ids == expected
    assert [o.token_ids for o in llm.generate([p, p], params)] == [expected, expected]
    texts = llm.generate(["Hello world", "the quick brown fox"], [greedy(3), greedy(4)])
    assert [len(o.token_ids) for o in texts] == [3, 4] and texts[0].prompt == "Hello world"
    assert texts[0].prompt_token_ids == llm.tokenizer.encode("Hello world")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    (chat,) = llm.chat(messages, greedy(5))
    assert chat.prompt_token_ids == llm.tokenizer.encode_chat(messages)
    assert chat.token_ids == solo(loaded, llm.tokenizer.encode_chat(messages), greedy(5))
    with pytest.raises(InvalidRequestError, match="2 sampling params for 1 prompts"):
        llm.generate([p], [params, params])


def test_async_engine_streams_aborts_and_counts_every_token_once(model_dir, loaded):
    p_stream, p_abort = prompt(11, 100), prompt(9, 101)
    expected = solo(loaded, p_stream, greedy(12))

    async def scenario():
        engine = AsyncEngine(EngineConfig(model=str(model_dir), num_gpu_blocks=64, block_size=8,
                                          max_waiting_requests=4))
        stats = []
        engine.add_stats_listener(stats.append)
        switch_before = sys.getswitchinterval()
        await engine.start()
        frozen_while_serving = gc.get_freeze_count()  # the start-up heap, out of the collector's passes
        switch_while_serving = sys.getswitchinterval()
        stream = engine.add_request(p_stream, greedy(12), request_id="s")
        victim = engine.add_request(p_abort, greedy(500 - 9), request_id="v")
        with pytest.raises(PromptTooLongError):
            engine.add_request(prompt(10, 1), greedy(1000))
        deltas, last = [], None
        async for out in stream:
            deltas.append(out.outputs[0].delta_token_ids)
            last = out
        victim_outputs = []
        async for out in victim:
            victim_outputs.append(out)
            if len(victim_outputs) == 3:
                victim.abort()
        await asyncio.sleep(0.05)
        health = engine.health()

        real_launch = engine.engine.runner.launch

        def broken_launch(*args):
            engine.engine.runner.launch = real_launch  # fails once
            raise RuntimeError("device fell over")

        engine.engine.runner.launch = broken_launch
        failed = [out async for out in engine.add_request(p_stream, greedy(3))]
        recovered = [out async for out in engine.generate(p_stream, greedy(12))]
        await engine.shutdown()
        assert frozen_while_serving > 0 and gc.get_freeze_count() == 0  # thawed: the engine's memory can go
        assert switch_while_serving == pytest.approx(SERVING_SWITCH_INTERVAL_S) and sys.getswitchinterval() == switch_before
        with pytest.raises(DeepInferError, match="shutting down"):
            engine.add_request(p_stream, greedy(3))
        assert failed[-1].finish_reason == "error" and "device fell over" in failed[-1].error
        assert recovered[-1].token_ids == expected
        return stats, deltas, last, victim_outputs, health

    stats, deltas, last, victim_outputs, health = asyncio.run(scenario())
    assert last.finished and last.token_ids == expected
    assert [t for d in deltas for t in d] == expected  # deltas add up to the whole, none repeated
    assert victim_outputs[-1].finish_reason == "abort" and victim_outputs[-1].finished
    # Counted once each: tokens of "s", "v" and the recovered run (the failed request sampled none).
    num_tokens = 2 * len(expected) + len(victim_outputs[-1].token_ids)
    assert sum(s.num_generation_tokens for s in stats) == num_tokens
    assert sorted(f.finish_reason for s in stats for f in s.finished_requests) == [
        "abort", "error", "length", "length"]
    # The recovered run hits the prefix cache: (11 - 1) // 8 blocks were not computed again.
    assert sum(s.num_prompt_tokens for s in stats) == len(p_stream) + len(p_abort) + 3
    assert health["blocks"]["num_used"] == 0 and health["engine_alive"]
    assert set(health) >= {"model", "attention_backend", "max_model_len", "scheduler", "blocks", "kv_budget",
                           "prefix_cache"}
    assert health["kv_budget"]["num_blocks"] == 64


def test_kv_budget_arithmetic():
    block = 2 * MiB
    cpu = plan_kv_budget(EngineConfig(cpu_kv_cache_memory="64MiB"), block, None)
    assert (cpu.source, cpu.num_blocks) == ("cpu_kv_cache_memory", 32)
    fixed = plan_kv_budget(EngineConfig(num_gpu_blocks=7, kv_cache_memory="1GiB"), block, None)
    assert (fixed.source, fixed.num_blocks) == ("num_gpu_blocks", 7)
    gpu = DeviceMemory(total=4096 * MiB, free=3000 * MiB, torch_reserved=700 * MiB, torch_allocated=600 * MiB,
                       peak_allocated=900 * MiB)
    # max_vram 4GiB: 4096 - 900 (weights + activations peak) = 3196 MiB, but only
    # 3000 free + 100 cached - 300 activation headroom - 256 reserve = 2544 MiB exist.
    vram = plan_kv_budget(EngineConfig(max_vram="4GiB", reserve_memory_mb=256), block, gpu)
    assert (vram.source, vram.budget_bytes, vram.num_blocks) == ("max_vram", 2544 * MiB, 1272)
    # 2GiB: 2048 - 900 - the 100 MiB torch reserves beyond its allocations (holes between the weights).
    small = plan_kv_budget(EngineConfig(max_vram="2GiB"), block, gpu)
    assert small.budget_bytes == (2048 - 900 - 100) * MiB
    assert (small.weights_bytes, small.activation_peak_bytes) == (600 * MiB, 300 * MiB)
    # utilization 0.5: 2048 - 900 peak - (4096 - 3000 - 700 = 396 outside torch) = 752 MiB.
    util = plan_kv_budget(EngineConfig(gpu_memory_utilization=0.5), block, gpu)
    assert (util.source, util.budget_bytes) == ("gpu_memory_utilization", 752 * MiB)
    with pytest.raises(DeepInferError, match="no room for the KV cache"):
        plan_kv_budget(EngineConfig(max_vram="800MiB"), block, gpu)


def test_runner_builds_one_flat_batch_decodes_first(loaded):
    from deepinfer.core.engine.sched.request import Request
    from deepinfer.core.engine.sched.scheduler_output import ScheduledChunk, SchedulerOutput
    from deepinfer.core.engine.worker.model_runner import ModelRunner
    from deepinfer.core.kv.cache import KVCache

    spec = loaded.spec
    cache = KVCache(spec.num_layers, 16, 8, spec.num_kv_heads, spec.head_dim, torch.float32, "cpu")
    runner = ModelRunner(loaded.model, cache, torch.device("cpu"), block_size=8, max_num_batched_tokens=64,
                         max_num_seqs=4, max_model_len=128)
    prefill = Request("p", list(range(10, 30)), greedy())  # 20 tokens, chunk 8..19 reaches the end
    partial = Request("q", list(range(40, 52)), greedy())  # 12 tokens, chunk 0..4 does not
    decode = Request("d", list(range(60, 70)), greedy())  # 10 tokens, position 9 is the new one
    out = SchedulerOutput(chunks=[
        ScheduledChunk(prefill, 8, 12, [3, 7, 1], sample=True),
        ScheduledChunk(partial, 0, 5, [9, 2], sample=False),
        ScheduledChunk(decode, 9, 1, [5, 6], sample=True),
    ])
    inputs = runner.prepare_inputs(out)
    meta = inputs.attn_metadata
    assert inputs.input_ids.tolist() == [69] + list(range(18, 30)) + list(range(40, 45))
    assert inputs.positions.tolist() == [9] + list(range(8, 20)) + list(range(5))
    slots = [6 * 8 + 1] + [7 * 8 + i for i in range(8)] + [1 * 8 + i for i in range(4)]
    assert meta.slot_mapping.tolist() == slots + [9 * 8 + i for i in range(5)]
    assert meta.query_start_loc.tolist() == [0, 1, 13, 18]
    assert meta.seq_lens.tolist() == meta.seq_lens_host == [10, 20, 5]
    assert meta.block_tables.tolist() == [[5, 6, 0], [3, 7, 1], [9, 0, 0]]
    assert meta.query_lens == [1, 12, 5]
    assert (meta.num_decodes, meta.max_query_len, meta.max_seq_len) == (1, 12, 20)
    assert inputs.logits_indices.tolist() == [0, 12]  # the decode and the prefill's last token; not "q"
    assert [c.request_id for c in inputs.sampling_chunks] == ["d", "p"]


def test_warmup_step_is_the_largest_step_and_runs(loaded):
    from deepinfer.core.engine.worker.model_runner import ModelRunner
    from deepinfer.core.engine.worker.startup import warmup_requests
    from deepinfer.core.kv.cache import KVCache

    step, num_blocks = warmup_requests(num_tokens=40, max_num_seqs=6, block_size=8, max_model_len=100)
    assert [(c.start_pos, c.num_tokens) for c in step.chunks] == [(65, 35)] + [(0, 1)] * 5
    assert num_blocks == 6 + 5 and all(c.sample for c in step.chunks)
    prefill_table = step.chunks[0].block_table  # 13 logical blocks cycling over 6 physical ones
    assert prefill_table == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0]
    written = {prefill_table[p // 8] for p in range(65, 100)}
    assert len(written) == 5  # the chunk's logical blocks 8..12 land on distinct physical blocks
    spec = loaded.spec
    cache = KVCache(spec.num_layers, num_blocks, 8, spec.num_kv_heads, spec.head_dim, torch.float32, "cpu")
    runner = ModelRunner(loaded.model, cache, torch.device("cpu"), block_size=8, max_num_batched_tokens=40,
                         max_num_seqs=6, max_model_len=100)
    assert len(runner.execute(step).sampled_token_ids) == 6
