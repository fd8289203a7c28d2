"""The SmolLM2-135M-Instruct GGUF (Q4_1, llama arch, GQA 9/3) against transformers' own GGUF loader.

- every dequantized weight equals the one transformers loads (gguf-py dequantize + its Q/K un-permute);
- the spec matches transformers' config, the tokenizer and chat template match its tokenizer;
- greedy decoding of several chat prompts, run as ONE flat batch through the paged cache,
  equals `generate(do_sample=False)` token for token for 32 tokens.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import PagedRunner

from deepinfer.core.config import EngineConfig
from deepinfer.core.models.loader import read_model
from deepinfer.core.weights.gguf_reader import open_gguf

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for staying focused.",
    "What is 12 times 7?",
]
MAX_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def ours(smollm2_gguf):
    return read_model(EngineConfig(model=str(smollm2_gguf)), "cpu", torch.float32)


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



def test_lm_eval_loglikelihood_through_the_server_matches_transformers(ours, reference):
    """lm-evaluation-harness's local-completions loglikelihood requests against a server of this GGUF, whose
    prefill runs in chunks of 8 tokens: the continuations' summed logprobs and greediness equal HF's."""
    from local_completions import check_against_hf
    from server_helpers import ServerThread

    from deepinfer.core.engine.frontend.async_engine import AsyncEngine
    from deepinfer.core.server.config import ServerConfig

    hf_model, hf_tokenizer = reference
    config = EngineConfig(device="cpu", dtype="float32", max_model_len=128, num_gpu_blocks=32,
                          max_num_batched_tokens=8, max_num_seqs=4)
    server = ServerThread(config, ServerConfig(served_model_name="smollm2", shutdown_timeout_s=1.0),
                          engine_factory=lambda engine_config: AsyncEngine(engine_config, ours)).start()
    try:
        context = hf_tokenizer.encode("The capital of France is")
        cases = [(context, hf_tokenizer.encode(" Paris", add_special_tokens=False)),
                 (context, hf_tokenizer.encode(" a city in Europe", add_special_tokens=False))]
        check_against_hf(server.base_url, "smollm2", hf_model, cases,
                         lambda ids: hf_tokenizer.decode(ids, skip_special_tokens=False))
    finally:
        server.stop()

# --- GGUF files of other architectures, written the way llama.cpp's convert_hf_to_gguf.py does ---

_GGUF_ARCH = {"llama": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "gemma": "GEMMA", "gemma2": "GEMMA2"}


def write_gguf_like_llama_cpp(hf_model, family: str, path) -> None:
    """F32 GGUF of `hf_model`: gguf-py's own HF->GGUF tensor names, llama Q/K rows permuted and
    Gemma norms stored as 1 + weight (both as convert_hf_to_gguf.py does), llama.cpp's metadata keys."""
    import gguf

    config = hf_model.config
    arch = getattr(gguf.MODEL_ARCH, _GGUF_ARCH[family])
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if family == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)
    if config.rope_parameters["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", llama_cpp_rope_factors(config))
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, _, kind = name.rpartition(".")
        data = tensor.float().numpy().copy()
        if family == "llama" and base.endswith(("q_proj", "k_proj")):
            heads = config.num_attention_heads if base.endswith("q_proj") else config.num_key_value_heads
            data = data.reshape(heads, 2, data.shape[0] // heads // 2, *data.shape[1:]).swapaxes(1, 2)
            data = data.reshape(tensor.shape)
        if family in ("gemma", "gemma2") and base.endswith("norm"):
            data = data + 1
        writer.add_tensor(f"{names.get_name(base)}.{kind}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama_cpp_rope_factors(config) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.generate_extra_tensors: Llama 3 scaling as one factor per frequency."""
    params = config.rope_parameters
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    dim = config.head_dim
    freqs = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


@pytest.mark.parametrize(("family", "overrides"), [
    ("llama", {}),  # llama3 RoPE scaling -> rope_freqs tensor
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}, "tie_word_embeddings": False}),
    ("qwen2", {"use_sliding_window": False}),  # llama.cpp keeps no Qwen2 window in GGUF
    ("qwen3", {}),
    ("gemma", {}),
    ("gemma2", {"query_pre_attn_scalar": 16}),  # GGUF carries no scalar; llama.cpp uses head_dim
])
def test_converted_gguf_matches_hf_logits(family, overrides, tmp_path):
    from conftest import tiny_hf_config
    from transformers import AutoModelForCausalLM

    from deepinfer.core.models.decoder import DecoderModel
    from deepinfer.core.models.layers import rope_inverse_frequencies
    from deepinfer.core.models.spec import ModelSpec
    from deepinfer.core.weights.gguf_reader import gguf_spec, iter_gguf_weights

    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(tiny_hf_config(family, **overrides), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.3)
    write_gguf_like_llama_cpp(hf_model, family, tmp_path / "tiny.gguf")

    reader = open_gguf(tmp_path / "tiny.gguf")
    spec = gguf_spec(reader)
    hf_spec = ModelSpec.from_hf_config(hf_model.config.to_dict())
    assert spec.rms_norm_eps == pytest.approx(hf_spec.rms_norm_eps)  # GGUF stores float32
    assert replace(spec, rms_norm_eps=0.0, rope_scaling=None) == replace(
        hf_spec, rms_norm_eps=0.0, rope_scaling=None, torch_dtype=None)
    torch.testing.assert_close(rope_inverse_frequencies(spec.head_dim, spec.rope_theta, spec.rope_scaling),
                               rope_inverse_frequencies(spec.head_dim, spec.rope_theta, hf_spec.rope_scaling))
    model = DecoderModel(spec)
    model.load_weights(iter_gguf_weights(reader, spec))
    tokens = torch.randint(3, 300, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    (logits,) = PagedRunner(model).step([("a", tokens)])
    with torch.no_grad():
        expected = hf_model(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
