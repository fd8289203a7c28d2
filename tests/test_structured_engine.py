"""Structured outputs inside the engine, on the tiny random Llama (CPU).

The masks of a constrained request are computed from the token the step in flight sampled, before
that step is applied (async scheduling, no synchronous fallback): the reference is the engine
stepping synchronously, which must give identical tokens, text and logprobs (test_async_scheduling's
`compare`), also with the padded step runner that CUDA graphs replay, and under preemption. Every
finished output must satisfy its constraint (jsonschema, re.fullmatch).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from conftest import save_tiny_model
from test_async_scheduling import compare, prompt

from deepinfer import SamplingParams
from deepinfer.core.config import EngineConfig
from deepinfer.core.engine.llm_engine import LLMEngine
from deepinfer.core.errors import InvalidRequestError
from deepinfer.core.models.loader import load_model
from deepinfer.core.structured.step_mask import StepMasks

SCHEMA = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}},
    "required": ["color", "count", "tags"], "additionalProperties": False}
PATTERN = r"(the|a) [a-z]{2,8}( [a-z]{2,8}){0,3}\."


@pytest.fixture(scope="module")
def loaded(tmp_path_factory, tiny_tokenizer):
    directory = tmp_path_factory.mktemp("structured_llama")
    save_tiny_model("llama", directory, tiny_tokenizer, seed=7, initializer_range=0.2, num_hidden_layers=2)
    return load_model(EngineConfig(model=str(directory)), torch.device("cpu"), torch.float32)


def constrained(max_tokens, constraint, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, structured_outputs=constraint, **kw)


def assert_satisfied(run, requests):
    """Every finished constrained sample follows its constraint; returns how many finished with "stop"."""
    num_stopped = 0
    for request_id, params in requests.items():
        for completion in run.finals[request_id].outputs:
            constraint = params.structured_outputs
            if constraint is None or completion.finish_reason != "stop":
                continue
            num_stopped += 1
            if constraint.json is not None:
                jsonschema.validate(json.loads(completion.text), constraint.json)
            elif constraint.regex is not None:
                assert re.fullmatch(constraint.regex, completion.text), completion.text
            elif constraint.choice is not None:
                assert completion.text in constraint.choice
    return num_stopped


def mixed_arrivals():
    """Constrained and plain requests side by side, greedy and seeded, n > 1, logprobs, staggered."""
    requests = {
        "json-greedy": constrained(96, {"json": SCHEMA}, temperature=0.0, logprobs=2),
        "json-seeded": constrained(96, {"json": SCHEMA}, temperature=1.0, seed=3, n=2),
        "regex-seeded": constrained(40, {"regex": PATTERN}, temperature=0.8, seed=11),
        "choice": constrained(8, {"choice": ["yes", "no", "maybe not"]}, temperature=1.0, seed=5),
        "plain-greedy": SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        "plain-penalty": SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
    }
    arrivals = [(step, prompt(9 + 3 * step, seed=step), params, request_id)
                for step, (request_id, params) in enumerate(requests.items())]
    return arrivals, requests


@pytest.mark.parametrize("decode_mode", [None, "padded"])
def test_constrained_requests_match_the_synchronous_engine(loaded, decode_mode):
    arrivals, requests = mixed_arrivals()
    sync_run, _ = compare(loaded, arrivals, decode_mode=decode_mode)
    assert assert_satisfied(sync_run, requests) >= 3
    for request_id in ("json-greedy", "json-seeded"):
        assert all(c.finish_reason == "stop" for c in sync_run.finals[request_id].outputs)


def test_constrained_requests_survive_preemption(loaded):
    """A pool too small for all of them: requests are preempted and recomputed mid-constraint."""
    arrivals = [(0, prompt(20, seed=i), constrained(72, {"json": SCHEMA}, temperature=1.0, seed=i), f"r{i}")
                for i in range(6)]
    _, async_run = compare(loaded, arrivals, num_gpu_blocks=16, max_num_batched_tokens=64)
    requests = {request_id: params for _, _, params, request_id in arrivals}
    assert assert_satisfied(async_run, requests) >= 4
    preemptions = sum(s.num_preemptions for s in async_run.stats)
    assert preemptions > 0, "the pool was large enough: the test does not exercise preemption"


def test_requests_without_constraints_build_no_mask(loaded, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("an unconstrained step applied a grammar mask")

    masks = []
    start = StepMasks.start

    def recording(self, *args, **kwargs):
        masks.append(start(self, *args, **kwargs))
        return masks[-1]

    monkeypatch.setattr("deepinfer.core.engine.worker.sampler.apply_grammar_mask", fail)
    monkeypatch.setattr(StepMasks, "start", recording)
    engine = LLMEngine(EngineConfig(num_gpu_blocks=64, block_size=8), loaded_model=loaded)
    engine.add_request(prompt(12, 0), SamplingParams(temperature=0.7, seed=1, max_tokens=6, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(masks) == 6 and all(mask is None for mask in masks)
    engine.add_request(prompt(12, 0), constrained(6, {"regex": "[a-z]+"}))
    with pytest.raises(AssertionError, match="applied a grammar mask"):
        while engine.has_unfinished_requests():
            outputs, _ = engine.step()
            if any(o.outputs[0].finish_reason == "error" for o in outputs):
                raise AssertionError(outputs[0].error)


def test_a_constrained_steps_sampling_is_enqueued_before_the_next_forward(loaded, monkeypatch):
    """A constrained step is sampled late (its mask is filled meanwhile); the next launch enqueues that sampling before
    its own forward, even when none of its rows reads the step's tokens (the sampling reads logits the next forward
    may overwrite: a CUDA graph's output buffer)."""
    from deepinfer.core.engine.worker.deferred_sample import DeferredSample

    engine = LLMEngine(EngineConfig(num_gpu_blocks=64, block_size=8), loaded_model=loaded)
    constrained_id = engine.add_request(prompt(12, 0), constrained(8, {"regex": "[a-z]+"}))
    engine.step()  # its prefill is launched and in flight
    in_flight = engine._inflight.sampled
    assert isinstance(in_flight, DeferredSample) and in_flight._output is None
    engine.abort(constrained_id)
    engine.add_request(prompt(10, 1), SamplingParams(temperature=0.0, max_tokens=2))  # no row reads its tokens
    forward = engine.runner.model.forward
    enqueued_at_forward = []

    def recording(*args, **kwargs):
        enqueued_at_forward.append(in_flight._output is not None)
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.runner.model, "forward", recording)
    engine.step()
    assert enqueued_at_forward and enqueued_at_forward[0]


def test_padded_vocabulary_ids_are_never_sampled(loaded, tiny_tokenizer):
    """The model has 384 logits, the tokenizer 340 tokens: a constrained row never picks the padding."""
    engine = LLMEngine(EngineConfig(num_gpu_blocks=64, block_size=8), loaded_model=loaded)
    plain = SamplingParams(max_tokens=30, temperature=2.0, seed=0, ignore_eos=True)
    printable = constrained(30, {"regex": "[ -~]{200}"}, temperature=2.0, seed=0)  # nearly no mask
    for request_id, params in (("plain", plain), ("printable", printable)):
        engine.add_request(prompt(8, 1), params, request_id)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o.outputs[0] for o in engine.step()[0] if o.finished})
    assert max(finals["plain"].token_ids) >= len(tiny_tokenizer)  # unmasked, the padding does come up
    assert len(finals["printable"].token_ids) == 30
    assert max(finals["printable"].token_ids) < len(tiny_tokenizer)


def test_a_constraint_the_model_cannot_finish_ends_at_max_tokens(loaded):
    engine = LLMEngine(EngineConfig(num_gpu_blocks=64, block_size=8), loaded_model=loaded)
    engine.add_request(prompt(8, 2), constrained(6, {"regex": "a{60}"}, temperature=0.0), "r")
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step()[0] if o.finished), final)
    completion = final.outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 6
    assert set(completion.text) == {"a"}


def test_bad_constraints_are_refused_before_the_engine_runs(loaded):
    engine = LLMEngine(EngineConfig(num_gpu_blocks=64, block_size=8), loaded_model=loaded)
    with pytest.raises(InvalidRequestError, match="regex"):
        engine.add_request(prompt(8, 2), constrained(6, {"regex": "(unclosed"}))
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs={"regex": "a", "json": {}})
    assert not engine.has_unfinished_requests()


def test_bench_concurrency_with_a_json_schema_on_a_dummy_byte_vocabulary(tmp_path, monkeypatch):
    """The GPU benchmark's path on a tiny dummy model, whose byte tokenizer the grammar reads."""
    from conftest import tiny_hf_config
    from test_bench import _run_cli

    shape = tmp_path / "tiny.json"
    shape.write_text(tiny_hf_config("llama").to_json_string())
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    output = tmp_path / "out.json"
    _run_cli(["bench", "concurrency", "--dummy-weights", "--shape", str(shape), "--device", "cpu",
              "--concurrency", "1,2", "--num-requests", "2", "--prompt-len", "8", "--output-len", "24",
              "--json-schema", str(schema), "--output", str(output)], monkeypatch)
    data = json.loads(output.read_text())
    assert data["workload"]["json_schema"] == SCHEMA
    for level in data["levels"]:
        for run in level["repeats"]:
            assert run["num_failed"] == 0 and run["output_tokens"] == 2 * 24


def test_python_api_generate_and_chat_with_tools(tmp_path, tiny_tokenizer):
    from deepinfer import LLM

    # The tiny tokenizer spends about one token per character: the tools' description needs room.
    save_tiny_model("llama", tmp_path, tiny_tokenizer, seed=3, max_position_embeddings=1024)
    llm = LLM(str(tmp_path), device="cpu", num_gpu_blocks=128, block_size=8)
    outputs = llm.generate(["Hello", "The capital"], SamplingParams(
        max_tokens=40, temperature=1.0, seed=1, structured_outputs={"regex": PATTERN}))
    for output in outputs:
        assert output.outputs[0].finish_reason != "stop" or re.fullmatch(PATTERN, output.text)
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"word": {"type": "string", "maxLength": 3}},
        "required": ["word"], "additionalProperties": False}, "strict": True}}
    conversation = [{"role": "user", "content": "Look up a word."}]
    for tool_choice in ("required", {"type": "function", "function": {"name": "lookup"}}):
        [output] = llm.chat(conversation, SamplingParams(max_tokens=120, temperature=0.0), tools=[tool],
                            tool_choice=tool_choice, parallel_tool_calls=False)
        content, calls = llm.parse_tool_calls(output)
        assert output.outputs[0].finish_reason == "stop", output.text
        assert content is None and [c.name for c in calls] == ["lookup"]
        jsonschema.validate(json.loads(calls[0].arguments), tool["function"]["parameters"])
    with pytest.raises(InvalidRequestError, match="not among the tools"):
        llm.chat(conversation, tools=[tool], tool_choice={"type": "function", "function": {"name": "other"}})


# GPU: constrained rows under CUDA graphs and async scheduling; the mask path never syncs -------------------


@pytest.fixture(scope="module")
def loaded_cuda(tmp_path_factory, tiny_tokenizer):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    directory = tmp_path_factory.mktemp("structured_llama_cuda")
    save_tiny_model("llama", directory, tiny_tokenizer, seed=7, initializer_range=0.2, num_hidden_layers=2)
    return load_model(EngineConfig(model=str(directory)), torch.device("cuda"), torch.float32)


@pytest.mark.gpu
def test_cuda_graphs_with_constrained_requests_match_the_synchronous_engine(loaded_cuda):
    arrivals, requests = mixed_arrivals()
    sync_run, _ = compare(loaded_cuda, arrivals, decode_mode="graphs")
    assert assert_satisfied(sync_run, requests) >= 3


@pytest.mark.gpu
def test_cuda_grammar_mask_and_sampling_make_no_sync(loaded_cuda):
    from deepinfer.core.engine.sched.request import Request
    from deepinfer.core.engine.sched.scheduler_output import ScheduledChunk
    from deepinfer.core.engine.worker.sampler import Sampler, SamplingRow
    from deepinfer.core.structured.compiler import GrammarCompiler

    tokenizer = loaded_cuda.tokenizer
    compiler = GrammarCompiler(tokenizer, loaded_cuda.spec.vocab_size, tokenizer.eos_token_ids)
    params = [constrained(8, {"json": SCHEMA}, temperature=0.0), SamplingParams(temperature=0.7, seed=1),
              constrained(8, {"regex": PATTERN}, temperature=0.9, seed=2)]
    chunks = []
    for i, p in enumerate(params):
        request = Request(f"r{i}", [5, 6, 7], p)
        if p.structured_outputs is not None:
            request.grammar = compiler.compile(p.structured_outputs).new_request_grammar()
        chunks.append(ScheduledChunk(request, 2, 1, [0], sample=True))
    logits = torch.randn(3, loaded_cuda.spec.vocab_size, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mask = StepMasks(torch.device("cuda")).start(chunks, None, logits.shape[1]).result()
        out = Sampler().sample(logits, [SamplingRow(c.request.params, [5, 6, 7], []) for c in chunks], mask)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokenizer.decode([out.token_ids[0]]).startswith("{")  # the JSON row
    assert mask.rows.tolist() == [0, 2]
