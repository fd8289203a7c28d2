"""The SmolLM2-135M-Instruct GGUF (Q4_1, llama arch, GQA 9/3) against transformers' own GGUF loader.

- every dequantized weight equals the one transformers loads (gguf-py dequantize + its Q/K un-permute);
- the spec matches transformers' config, the tokenizer and chat template match its tokenizer;
- greedy decoding of several chat prompts, run as ONE flat batch through the paged cache,
  equals `generate(do_sample=False)` token for token for 32 tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import PagedRunner

from core.config import EngineConfig
from core.models.loader import load_model
from core.weights.gguf_reader import open_gguf

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for staying focused.",
    "What is 12 times 7?",
]
MAX_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def ours(smollm2_gguf):
    return load_model(EngineConfig(model=str(smollm2_gguf)), "cpu", torch.float32)


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    model = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                                 dtype=torch.float32)
    return model.eval(), tokenizer


def test_spec_matches_transformers_config(ours, reference):
    config = reference[0].config
    spec = ours.spec
    assert ours.source_kind == "gguf"
    assert (spec.family, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (
        "llama", config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    assert (spec.hidden_size, spec.intermediate_size, spec.vocab_size) == (
        config.hidden_size, config.intermediate_size, config.vocab_size)
    assert spec.rope_theta == config.rope_parameters["rope_theta"]
    assert spec.rms_norm_eps == pytest.approx(config.rms_norm_eps)
    assert spec.tie_word_embeddings and config.tie_word_embeddings
    assert ours.tokenizer.eos_token_ids == {config.eos_token_id}


def test_weights_equal_transformers_dequantized(ours, reference):
    expected = reference[0].state_dict()
    ours_params = dict(ours.model.named_parameters())
    assert set(ours_params) == set(expected) - {"lm_head.weight"}  # tied: computed from the embedding
    for name, param in ours_params.items():
        assert torch.equal(param, expected[name]), name


def test_unpermuted_query_matches_gguf_py(ours, smollm2_gguf):
    """Independent of transformers: gguf-py's dequantize, then llama.cpp's permutation applied forward."""
    from gguf.quants import dequantize

    reader = open_gguf(smollm2_gguf)
    tensor = next(t for t in reader.tensors if t.name == "blk.3.attn_k.weight")
    stored = dequantize(tensor.data, tensor.tensor_type)  # [kv_heads * head_dim, hidden], permuted rows
    ours_k = ours.model.model.layers[3].self_attn.k_proj.weight.numpy()
    heads, head_dim = ours.spec.num_kv_heads, ours.spec.head_dim
    # llama.cpp convert: w.reshape(heads, 2, head_dim // 2, ...).swapaxes(1, 2)
    permuted = ours_k.reshape(heads, 2, head_dim // 2, -1).swapaxes(1, 2).reshape(ours_k.shape)
    np.testing.assert_array_equal(permuted, stored)


def test_chat_template_and_tokens_match(ours, reference):
    hf_tokenizer = reference[1]
    messages = [{"role": "user", "content": PROMPTS[0]}]
    text = ours.tokenizer.apply_chat_template(messages)
    assert text == hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert ours.tokenizer.encode_chat(messages) == hf_tokenizer(text, add_special_tokens=False).input_ids


def greedy_batch(loaded, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """All prompts prefill in one flat batch, then every step decodes all unfinished ones together."""
    runner = PagedRunner(loaded.model, num_blocks=64, block_size=16, seed=1)
    generated: list[list[int]] = [[] for _ in prompts]
    chunks = list(enumerate(prompts))
    while chunks:
        step_logits = runner.step(chunks)
        next_chunks = []
        for (index, _), logits in zip(chunks, step_logits):
            token = int(logits[-1].argmax())
            generated[index].append(token)
            if token not in loaded.tokenizer.eos_token_ids and len(generated[index]) < max_new_tokens:
                next_chunks.append((index, [token]))
        chunks = next_chunks
    return generated


def test_greedy_matches_transformers(ours, reference):
    hf_model, hf_tokenizer = reference
    prompts = [ours.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    ours_tokens = greedy_batch(ours, prompts, MAX_NEW_TOKENS)
    for prompt, tokens in zip(prompts, ours_tokens):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                    pad_token_id=hf_tokenizer.pad_token_id)
        assert tokens == out[0, len(prompt):].tolist(), hf_tokenizer.decode(out[0, len(prompt):])
    assert ours.tokenizer.decode(ours_tokens[0]) == "The capital of France is Paris."
