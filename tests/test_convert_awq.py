"""AWQ GEMM -> layered: bit-exact weights against AutoAWQ-packed references, logits against HF, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import PagedRunner, save_tiny_model
from reference_packers import (
    LINEARS,
    awq_dequantize,
    awq_tensors,
    random_awq_linear,
    reference_with_weights,
    save_quantized_checkpoint,
)

from deepinfer.core.config import EngineConfig
from deepinfer.core.errors import ModelLoadError, UnsupportedModelError
from deepinfer.core.models.loader import read_model
from deepinfer.core.quant.packing import dequantize, unpack_codes
from deepinfer.core.weights.convert.awq import awq_to_packed, unpack_awq
from deepinfer.core.weights.convert.run import convert_checkpoint

TOLERANCE = 1e-4


def test_interleaved_order_by_hand():
    """One word holding columns 0..7 = codes 0..7: AWQ puts column order[i] in nibble i."""
    word = sum(column << (4 * nibble) for nibble, column in enumerate([0, 2, 4, 6, 1, 3, 5, 7]))
    packed = torch.tensor([[word - 2**32 if word >= 2**31 else word]], dtype=torch.int32)
    assert unpack_awq(packed).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert unpack_codes(packed, 4).tolist() == [[0, 2, 4, 6, 1, 3, 5, 7]]  # the plain stream differs


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("zero_point", [True, False])
def test_linear_dequantizes_exactly(group_size, zero_point):
    truth = random_awq_linear(64, 256, group_size, zero_point=zero_point, seed=group_size)
    stored = awq_tensors(truth, with_qzeros=zero_point)
    packed = awq_to_packed(stored["qweight"], stored.get("qzeros"), stored["scales"], None, group_size=group_size)
    assert torch.equal(dequantize(packed), awq_dequantize(truth))
    assert packed.zero_mode == "zero" and packed.input_perm is None


def write_awq_model(hf_model, directory, *, group_size, zero_point, legacy=False):
    tensors, weights = {}, {}
    for layer in range(hf_model.config.num_hidden_layers):
        for index, linear in enumerate(LINEARS):
            module = f"model.layers.{layer}.{linear}"
            out_features, in_features = hf_model.get_submodule(module).weight.shape
            truth = random_awq_linear(out_features, in_features, group_size, zero_point=zero_point,
                                      seed=layer * 10 + index)
            tensors[module] = awq_tensors(truth, with_qzeros=zero_point)
            weights[f"{module}.weight"] = awq_dequantize(truth)
    if legacy:  # AutoAWQ's own quant_config.json
        save_quantized_checkpoint(hf_model, directory, tensors, None, (
            "quant_config.json", {"w_bit": 4, "q_group_size": group_size, "zero_point": zero_point, "version": "GEMM"}))
    else:
        save_quantized_checkpoint(hf_model, directory, tensors, {
            "quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": zero_point, "version": "gemm"})
    return weights


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, tiny_tokenizer):
    return save_tiny_model("llama", tmp_path_factory.mktemp("awq_hf") / "llama", tiny_tokenizer, seed=4,
                           hidden_size=128, intermediate_size=256, head_dim=32)


@pytest.mark.parametrize(("group_size", "zero_point", "legacy"), [(64, True, False), (128, False, True)])
def test_converted_model_logits_match_reference(tiny_llama, tmp_path, group_size, zero_point, legacy):
    weights = write_awq_model(tiny_llama, tmp_path / "src", group_size=group_size, zero_point=zero_point,
                              legacy=legacy)
    summary = convert_checkpoint(tmp_path / "src", tmp_path / "out")
    assert summary.source_kind == "awq"
    assert {r.source_type for r in summary.records if r.method == "exact"} == {"awq-int4"}
    loaded = read_model(EngineConfig(model=str(tmp_path / "out")), "cpu", torch.float32)
    tokens = list(range(5, 41))
    (logits,) = PagedRunner(loaded.model, seed=2).step([("a", tokens)])
    with torch.no_grad():
        expected = reference_with_weights(tiny_llama, weights)(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(logits, expected, atol=TOLERANCE, rtol=0)


@pytest.fixture
def awq_dir(tiny_llama, tmp_path):
    write_awq_model(tiny_llama, tmp_path / "src", group_size=64, zero_point=True)
    return tmp_path / "src"


@pytest.mark.parametrize(("change", "error", "message"), [
    ({"version": "gemv"}, UnsupportedModelError, "version 'gemv' is not supported"),
    ({"bits": 3}, UnsupportedModelError, "AWQ 3-bit is not supported"),
    ({"quant_method": "bitsandbytes"}, ModelLoadError, "quant_method 'bitsandbytes'"),
    ({"group_size": 128}, ModelLoadError, r"scales has shape \(4, 128\), expected \(2, 128\)"),
])
def test_wrong_quantization_config(awq_dir, tmp_path, change, error, message):
    config = json.loads((awq_dir / "config.json").read_text())
    config["quantization_config"].update(change)
    (awq_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(error, match=message):
        convert_checkpoint(awq_dir, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_missing_qzeros_with_zero_point(awq_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(awq_dir / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.qzeros"]
    save_file(tensors, str(awq_dir / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="up_proj has no qzeros but zero_point is true"):
        convert_checkpoint(awq_dir, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
