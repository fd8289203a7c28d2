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
    assert len(answers) >= 50 and len(wrong) <= 0.1 * len(answers), wrong
    france = [a for c, a in zip(conversations, answers) if c[0]["content"] == "What is the capital of France?"]
    assert len(france) == 5 and all(is_right(a, ("paris",)) for a in france), france


@pytest.mark.slow
def test_the_default_model_does_not_loop_on_open_prompts(llm):
    conversations = [[{"role": "user", "content": p}] for p in OPEN_PROMPTS]
    outputs = llm.chat(conversations, SamplingParams(seed=0, max_tokens=200))
    loops = [o.outputs[0].text for o in outputs if has_loop(o.outputs[0].token_ids)]
    assert not loops, loops


def test_the_loop_check_finds_a_loop():
    assert has_loop([1, 2, 3, 4, 5, 6, 7, 8] * 3) and not has_loop(list(range(200)))
    assert not has_loop([1, 2, 3, 4, 5, 6, 7, 8] * 2 + [9])
