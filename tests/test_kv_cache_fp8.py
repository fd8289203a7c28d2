"""The FP8 (e4m3) KV cache on the CPU reference path: codes against hand-computed e4m3 bytes, saturation, the
reference attention over the codes against explicit attention over their dequantized values, the per-head scales
calibrated at engine start against the amax of the K/V the model's layers produce, and SmolLM2's next-token choices
over quantized caches against the unquantized one.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.core.attention.torch_backend import TorchPagedAttention
from deepinfer.core.config import EngineConfig
from deepinfer.core.engine.worker.fp8_calibration import SCALE_MARGIN
from deepinfer.core.engine.worker.step_inputs import SequenceChunk, build_attention_metadata
from deepinfer.core.kv.cache import FP8_DEFAULT_SCALE, KVCache

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 8, 4


def test_values_are_stored_as_e4m3_codes_of_x_over_the_head_scale_and_saturate():
    cache = KVCache(1, 2, BLOCK, KV_HEADS, HEAD_DIM, torch.float32, "cpu", quantized="fp8")
    assert cache.key_caches[0].dtype == torch.float8_e4m3fn
    assert cache.key_scales[0].tolist() == [FP8_DEFAULT_SCALE] * KV_HEADS
    cache.value_scales[0][1] = 2.0
    key = torch.zeros(1, KV_HEADS, HEAD_DIM)
    key[0, 0, :4] = torch.tensor([0.3, -1000.0, 1.0, 0.0])
    value = key.clone()
    cache.write(0, key, value, torch.tensor([5]))  # block 1, offset 1
    # 0.3 = 1.2 * 2^-2 rounds to 1.25 * 2^-2 (3 mantissa bits): sign 0, exponent 5, mantissa 010 -> 0x2A;
    # -1000 saturates at -448 = -1.75 * 2^8: 1 1111 110 -> 0xFE; 1.0: 0 0111 000 -> 0x38
    assert cache.key_caches[0][1, 0, 1, :4].view(torch.uint8).tolist() == [0x2A, 0xFE, 0x38, 0x00]
    keys, values = cache.read_blocks(0, torch.tensor([1]))
    assert keys[0, 0, 1, :4].tolist() == [0.3125, -448.0, 1.0, 0.0]
    assert values[0, 0, 1, :4].tolist() == [0.3125, -448.0, 1.0, 0.0]  # head 0 keeps scale 1


def test_block_bytes_and_unknown_storages():
    assert KVCache.bytes_per_block(2, 16, 2, 64, torch.float16, "fp8") == 2 * 2 * 2 * 16 * 64
    assert KVCache.bytes_per_block(2, 16, 2, 64, torch.float16, None) == 2 * 2 * 2 * 16 * 64 * 2
    with pytest.raises(ValueError, match="fp4"):
        KVCache(1, 2, BLOCK, KV_HEADS, HEAD_DIM, torch.float32, "cpu", quantized="fp4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="e5m2")
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"


@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 10.0)])
def test_reference_attention_over_fp8_codes_is_attention_over_their_values(window, softcap):
    gen = torch.Generator().manual_seed(3)
    cache = KVCache(1, 16, BLOCK, KV_HEADS, HEAD_DIM, torch.float32, "cpu", quantized="fp8")
    cache.key_scales[0].copy_(torch.tensor([0.5, 2.0]))
    cache.value_scales[0].copy_(torch.tensor([1.5, 0.25]))
    tables, lengths = [[5, 2, 9], [0, 11, 3, 7]], [11, 14]
    chunks = [SequenceChunk(t, 0, n) for t, n in zip(tables, lengths)]
    meta, _ = build_attention_metadata(chunks, BLOCK, "cpu")
    tokens = sum(lengths)
    query = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen)
    key = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen) * 3
    value = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen) * 3
    out = TorchPagedAttention().forward(0, query, key, value, meta, cache, 0.4, window, softcap)
    offset = 0
    for length in lengths:
        rows = slice(offset, offset + length)
        # the values the codes hold, rounded here by torch's own e4m3 cast
        k = (key[rows] / cache.key_scales[0][:, None]).to(torch.float8_e4m3fn).float() * cache.key_scales[0][:, None]
        v = (value[rows] / cache.value_scales[0][:, None]).to(torch.float8_e4m3fn).float() * cache.value_scales[0][:, None]
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)  # [n, H, D]
        scores = torch.einsum("qhd,khd->hqk", query[rows], k) * 0.4
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        p = torch.arange(length)
        visible = p[None, :] <= p[:, None]
        if window:
            visible &= p[None, :] > p[:, None] - window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        torch.testing.assert_close(out[rows], torch.einsum("hqk,khd->qhd", probs, v), rtol=1e-5, atol=1e-5)
        offset += length


def test_engine_start_calibrates_fp8_scales_to_each_heads_amax_over_448(tiny_llama_dir, monkeypatch):
    from deepinfer.core.engine.llm_engine import LLMEngine
    from deepinfer.core.engine.worker import fp8_calibration
    from deepinfer.core.models import layers
    from deepinfer.core.models.loader import load_model

    loaded = load_model(EngineConfig(model=str(tiny_llama_dir)), torch.device("cpu"), torch.float32)
    spec = loaded.spec
    # what the layers hand the cache write: the rotated key and the value [T, KVH, D] of each layer in turn
    written = []
    original = layers.rotary_and_cache_write

    def recording(query, key, value, *args, **kwargs):
        query, rotated = original(query, key, value, *args, **kwargs)
        written.append((rotated.clone(), value.clone()))
        return query, rotated

    monkeypatch.setattr(layers, "rotary_and_cache_write", recording)
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), kv_cache_dtype="fp8", num_gpu_blocks=16,
                                    block_size=8), loaded_model=loaded)
    prompt = fp8_calibration.calibration_prompt(loaded.tokenizer)[:engine.max_model_len]
    assert len(written) == spec.num_layers  # one prefill through every layer, before any request
    cache = engine.kv_cache
    for layer, (key, value) in enumerate(written):
        assert key.shape == (len(prompt), spec.num_kv_heads, spec.head_dim)
        for head in range(spec.num_kv_heads):
            want_k = float(key[:, head].abs().max()) * fp8_calibration.SCALE_MARGIN / 448
            want_v = float(value[:, head].abs().max()) * fp8_calibration.SCALE_MARGIN / 448
            assert cache.key_scales[layer][head].item() == pytest.approx(want_k, rel=1e-6)
            assert cache.value_scales[layer][head].item() == pytest.approx(want_v, rel=1e-6)
    assert cache.key_scales[0].dtype == torch.float32 and cache.key_scales[0].shape == (spec.num_kv_heads,)


def test_a_head_of_zeros_keeps_the_default_scale():
    from deepinfer.core.engine.worker.fp8_calibration import head_scales

    pool = torch.zeros(3, 2, 4, 8)
    pool[1, 0, 2, 5] = -89.6  # head 0's amax: scale 0.2
    assert head_scales(pool).tolist() == pytest.approx([89.6 / 448 * SCALE_MARGIN, FP8_DEFAULT_SCALE])


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    from deepinfer.core.models.loader import load_model

    return load_model(EngineConfig(model=str(smollm2_gguf)), torch.device("cpu"), torch.float32)


@torch.no_grad()
def _next_token_choices(loaded, quantized, ids: list[int]) -> torch.Tensor:
    """Argmax of the logits at every position of one prefill of `ids` over a fresh cache -> [len(ids)]."""
    spec, model = loaded.spec, loaded.model
    blocks = len(ids) // BLOCK + 1
    cache = KVCache(spec.num_layers, blocks, BLOCK, spec.num_kv_heads, spec.head_dim, torch.float32, "cpu",
                    quantized=quantized)
    meta, positions = build_attention_metadata([SequenceChunk(list(range(blocks)), 0, len(ids))], BLOCK, "cpu")
    return model.compute_logits(model(torch.tensor(ids), positions, meta, cache)).argmax(-1)


@pytest.mark.slow
def test_smollm2_next_tokens_over_quantized_caches_agree_with_the_unquantized_cache(smollm2):
    from deepinfer import SamplingParams
    from deepinfer.core.engine.llm_engine import LLMEngine

    prompt = smollm2.tokenizer.encode_chat([{"role": "user", "content": "Describe the water cycle in a few sentences."}])
    engine = LLMEngine(EngineConfig(num_gpu_blocks=32, block_size=8), loaded_model=smollm2)
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), request_id="r")
    finished = []
    while engine.has_unfinished_requests():
        finished += [out for out in engine.step()[0] if out.finished]
    generated = finished[0].outputs[0].token_ids
    ids = prompt + generated
    reference = _next_token_choices(smollm2, None, ids)[len(prompt) - 1:-1]
    assert reference.tolist() == generated  # the same model and cache rule as the engine's greedy run
    for quantized in ("int8", "fp8"):
        # teacher-forced: every position sees the unquantized run's context, stored in the quantized cache
        choices = _next_token_choices(smollm2, quantized, ids)[len(prompt) - 1:-1]
        agree = int((choices == reference).sum())
        print(f"{quantized}: top-1 agreement {agree}/{len(generated)}")
        assert agree >= len(generated) - 2, quantized
