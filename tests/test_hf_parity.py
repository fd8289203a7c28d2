"""deepinfer's decoder + paged torch attention reproduce HF transformers' logits, family by family.

Each tiny checkpoint is loaded through `load_model` (the HF safetensors path) and compared in
fp32 with the HF model that wrote it, on sequences longer than every sliding window, run as
(a) one prefill, (b) prefill chunks then token-by-token decode through shuffled blocks, and
(c) one flat batch mixing several requests' decodes and prefill chunks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import FAMILIES, TINY_WINDOWS, PagedRunner

from deepinfer.core.config import EngineConfig
from deepinfer.core.models.decoder import DecoderModel
from deepinfer.core.models.loader import load_model

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def loaded(tiny_models):
    """family -> (LoadedModel, HF model)."""
    return {family: (load_model(EngineConfig(model=str(directory)), "cpu", torch.float32), hf_model)
            for family, (directory, hf_model) in tiny_models.items()}


def random_tokens(length: int, seed: int) -> list[int]:
    return torch.randint(3, 330, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([token_ids])).logits[0].float()  # [len, vocab]


@pytest.mark.parametrize("family", FAMILIES)
def test_spec_of_loaded_model(loaded, family):
    result, hf_model = loaded[family]
    assert result.source_kind == "hf"
    assert result.spec.family == family
    assert result.tokenizer.eos_token_ids >= {2}
    config = hf_model.config
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    expected_windows = tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    assert result.spec.sliding_windows == expected_windows
    if family in TINY_WINDOWS:
        assert TINY_WINDOWS[family] in expected_windows


@pytest.mark.parametrize("family", FAMILIES)
def test_single_prefill(loaded, family):
    result, hf_model = loaded[family]
    tokens = random_tokens(29, seed=1)
    (logits,) = PagedRunner(result.model, seed=3).step([("a", tokens)])
    torch.testing.assert_close(logits, hf_logits(hf_model, tokens), atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_then_decode(loaded, family):
    result, hf_model = loaded[family]
    tokens = random_tokens(31, seed=2)
    runner = PagedRunner(result.model, seed=4)
    pieces = [tokens[:7], tokens[7:12], tokens[12:21]] + [[t] for t in tokens[21:]]
    logits = torch.cat([runner.step([("a", piece)])[0] for piece in pieces])
    torch.testing.assert_close(logits, hf_logits(hf_model, tokens), atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_flat_batch(loaded, family):
    """Four requests arrive at different steps; every step is one forward of decodes + prefill chunks."""
    result, hf_model = loaded[family]
    prompts = {name: random_tokens(length, seed=10 + i)
               for i, (name, length) in enumerate([("a", 23), ("b", 17), ("c", 30), ("d", 9)])}
    arrivals = {"a": 0, "b": 0, "c": 2, "d": 4}
    decode_lengths = {"a": 8, "b": 11, "c": 5, "d": 12}  # teacher-forced continuation tokens
    full = {name: prompt + random_tokens(decode_lengths[name], seed=50 + i)
            for i, (name, prompt) in enumerate(prompts.items())}
    runner = PagedRunner(result.model, num_blocks=128, seed=5)
    done = {name: 0 for name in full}
    outputs: dict[str, list[torch.Tensor]] = {name: [] for name in full}
    chunk_budget = 6  # prompt tokens per request per step, so prompts take several steps
    step = 0
    while any(done[name] < len(full[name]) for name in full):
        active = [n for n in full if arrivals[n] <= step and done[n] < len(full[n])]
        decodes = [(n, [full[n][done[n]]]) for n in active if done[n] >= len(prompts[n])]
        prefills = [(n, full[n][done[n]:min(done[n] + chunk_budget, len(prompts[n]))])
                    for n in active if done[n] < len(prompts[n])]
        chunks = decodes + prefills
        if chunks:
            for (name, piece), logits in zip(chunks, runner.step(chunks)):
                outputs[name].append(logits)
                done[name] += len(piece)
        step += 1
    for name, tokens in full.items():
        torch.testing.assert_close(torch.cat(outputs[name]), hf_logits(hf_model, tokens), atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("family", sorted(TINY_WINDOWS))
def test_sliding_window_changes_the_answer(loaded, family):
    """Guards the parity tests themselves: the prompts are long enough that the window matters."""
    result, hf_model = loaded[family]
    no_window = dataclasses.replace(result.spec, sliding_windows=(None,) * result.spec.num_layers)
    model = DecoderModel(no_window)
    model.load_weights(hf_model.state_dict().items())
    tokens = random_tokens(29, seed=1)
    (logits,) = PagedRunner(model, seed=3).step([("a", tokens)])
    assert (logits - hf_logits(hf_model, tokens))[-1].abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_close_to_fp32(loaded, dtype):
    result, hf_model = loaded["gemma2"]
    model = DecoderModel(result.spec, dtype=dtype)
    model.load_weights(hf_model.state_dict().items())
    tokens = random_tokens(21, seed=7)
    runner = PagedRunner(model, seed=6)
    logits = torch.cat([runner.step([("a", tokens[:15])])[0]] + [runner.step([("a", [t])])[0] for t in tokens[15:]])
    assert logits.dtype == torch.float32
    reference = hf_logits(hf_model, tokens)
    assert (logits - reference).abs().max() < 0.05 * reference.abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_mixed_batch_matches_hf(loaded, family, dtype):
    """Same model on the GPU: a batch of one prefill chunk and a decode, vs HF fp32 on the CPU."""
    result, hf_model = loaded[family]
    model = DecoderModel(result.spec, dtype=dtype, device="cuda")
    model.load_weights(hf_model.state_dict().items())
    first, second = random_tokens(26, seed=20), random_tokens(19, seed=21)
    runner = PagedRunner(model, seed=8)
    runner.step([("a", first[:20])])
    decode, prefill = runner.step([("a", first[20:21]), ("b", second)])
    logits = torch.cat([decode, prefill]).cpu()
    expected = torch.cat([hf_logits(hf_model, first[:21])[-1:], hf_logits(hf_model, second)])
    if dtype == torch.float32:
        torch.testing.assert_close(logits, expected, atol=1e-3, rtol=0)
    else:
        assert (logits - expected).abs().max() < 0.05 * expected.abs().max()
