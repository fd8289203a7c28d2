"""The default model's shipped sampling defaults answer short factual questions right and do not
loop: the real SmolLM2-135M-Instruct GGUF on the CPU, through LLM.chat with every sampling field
left to the model's defaults (core/weights/default_model.py), on a fixed seed set."""

from __future__ import annotations

import pytest
from default_model_questions import FACTUAL_QUESTIONS, OPEN_PROMPTS, has_loop, is_right

from deepinfer import LLM, SamplingParams
from deepinfer.core.weights.default_model import DEFAULT_MODEL_SAMPLING

SEEDS = range(5)


@pytest.fixture(scope="module")
def llm(smollm2_gguf):
    return LLM(device="cpu", max_num_seqs=64)


@pytest.mark.slow
def test_the_default_model_answers_factual_questions_right_at_its_defaults(llm):
    defaults = llm.sampling_defaults
    assert {k: defaults.values[k] for k in DEFAULT_MODEL_SAMPLING} == DEFAULT_MODEL_SAMPLING
    assert {defaults.sources[k] for k in DEFAULT_MODEL_SAMPLING} == {"model"}
    conversations = [[{"role": "user", "content": q}] for q, _ in FACTUAL_QUESTIONS for _ in SEEDS]
    params = [SamplingParams(seed=seed, max_tokens=32) for _ in FACTUAL_QUESTIONS for seed in SEEDS]
    answers = [out.outputs[0].text for out in llm.chat(conversations, params)]
    keywords = [k for _, k in FACTUAL_QUESTIONS for _ in SEEDS]
    wrong = [(c[0]["content"], a) for c, a, k in zip(conversations, answers, keywords) if not is_right(a, k)]
    assert len(FACTUAL_QUESTIONS) >= 10 and FACTUAL_QUESTIONS[0][0] == "What is the capital of France?"
    assert len(wrong) <= 0.1 * len(answers), wrong  # at least 90% right


@pytest.mark.slow
def test_the_default_model_does_not_loop_on_open_prompts(llm):
    conversations = [[{"role": "user", "content": p}] for p in OPEN_PROMPTS]
    outputs = llm.chat(conversations, SamplingParams(seed=0, max_tokens=200))
    loops = [o.outputs[0].text for o in outputs if has_loop(o.outputs[0].token_ids)]
    assert not loops, loops


def test_the_loop_check_finds_a_loop():
    assert has_loop([1, 2, 3, 4, 5, 6, 7, 8] * 3) and not has_loop(list(range(200)))
    assert not has_loop([1, 2, 3, 4, 5, 6, 7, 8] * 2 + [9])


def test_the_default_model_file_gets_deepinfers_defaults_and_a_conversion_would_carry_them(smollm2_gguf):
    from deepinfer.core.weights.convert.gguf import GGUFSource
    from deepinfer.core.weights.convert.source import ConvertOptions
    from deepinfer.core.weights.generation_defaults import read_gguf_sampling
    from deepinfer.core.weights.gguf_reader import open_gguf

    assert read_gguf_sampling(open_gguf(smollm2_gguf), smollm2_gguf).values == {}  # the file itself has none
    source = GGUFSource(smollm2_gguf, ConvertOptions())  # what `deepinfer convert` writes as generation_config.json
    try:
        assert source.generation_defaults().values == DEFAULT_MODEL_SAMPLING
    finally:
        source.close()
