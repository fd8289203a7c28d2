"""Merged q/k/v and gate/up projections (core/models/merged_projections.py) keep HF's logits.

Every family's tiny checkpoint runs with its projections merged, dense and W4-quantized, and is
compared with HF transformers (dense) or with the same quantized model before merging; the merge
refuses projections whose layouts differ.
"""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, PagedRunner

from deepinfer.core.config import EngineConfig
from deepinfer.core.models.loader import read_model
from deepinfer.core.models.merged_projections import merge_linears, merge_projections
from deepinfer.core.quant.quant_linear import QuantLinear
from deepinfer.core.quant.quantize_model import quantize_projections
from deepinfer.core.quant.rtn import quantize_rtn


def _tokens(length: int, seed: int) -> list[int]:
    return torch.randint(3, 330, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _logits(model) -> list[torch.Tensor]:
    """A prefill of two requests, then a step mixing a decode with a new prefill chunk."""
    runner = PagedRunner(model, seed=5)
    first = runner.step([("a", _tokens(19, 1)), ("b", _tokens(7, 2))])
    second = runner.step([("a", [11]), ("c", _tokens(13, 3))])
    return first + second


@torch.no_grad()
def _hf_logits(hf_model) -> list[torch.Tensor]:
    def run(tokens):
        return hf_model(torch.tensor([tokens])).logits[0].float()

    a, b, c = _tokens(19, 1), _tokens(7, 2), _tokens(13, 3)
    return [run(a), run(b), run(a + [11])[-1:], run(c)]


@pytest.mark.parametrize("family", FAMILIES)
def test_merged_dense_model_matches_hf(tiny_models, family):
    directory, hf_model = tiny_models[family]
    loaded = read_model(EngineConfig(model=str(directory)), "cpu", torch.float32)
    assert merge_projections(loaded.model) == 2 * loaded.spec.num_layers
    layer = loaded.model.model.layers[0]
    assert layer.self_attn.q_proj is None and layer.mlp.gate_proj is None
    spec = loaded.spec
    assert layer.self_attn.qkv_proj.out_features == (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    assert layer.mlp.gate_up_proj.out_features == 2 * spec.intermediate_size
    for ours, theirs in zip(_logits(loaded.model), _hf_logits(hf_model)):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    assert merge_projections(loaded.model) == 0  # already merged: nothing to do


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_merged_quantized_model_equals_the_unmerged_one(tiny_models, family):
    directory, _ = tiny_models[family]
    loaded = read_model(EngineConfig(model=str(directory)), "cpu", torch.float32)
    quantize_projections(loaded.model, bits=4, group_size=32)
    unmerged = _logits(loaded.model)
    assert merge_projections(loaded.model) == 2 * loaded.spec.num_layers
    qkv = loaded.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and (qkv.bias is not None) == (family == "qwen2")
    for merged, separate in zip(_logits(loaded.model), unmerged):
        torch.testing.assert_close(merged, separate, atol=1e-5, rtol=0)


def test_merged_bias_fills_zeros_where_a_projection_has_none():
    torch.manual_seed(0)
    linears = [torch.nn.Linear(8, 4, bias=True), torch.nn.Linear(8, 2, bias=False)]
    merged = merge_linears(linears)
    x = torch.randn(3, 8)
    torch.testing.assert_close(merged(x), torch.cat([linears[0](x), linears[1](x)], dim=-1))


def test_projections_with_different_layouts_stay_separate():
    torch.manual_seed(0)
    weight = torch.randn(64, 64)
    w4 = QuantLinear(quantize_rtn(weight, 4, 32))
    assert merge_linears([w4, QuantLinear(quantize_rtn(weight, 3, 32))]) is None  # bits
    assert merge_linears([w4, QuantLinear(quantize_rtn(weight, 4, 64))]) is None  # group size
    assert merge_linears([w4, torch.nn.Linear(64, 64)]) is None  # dense beside packed
    permuted = quantize_rtn(weight, 4, 32)
    permuted.input_perm = torch.randperm(64, dtype=torch.int32)
    assert merge_linears([w4, QuantLinear(permuted)]) is None  # act-order permutations differ
    assert merge_linears([w4, QuantLinear(quantize_rtn(weight, 4, 32))]) is not None
