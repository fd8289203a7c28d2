"""HF fp16/bf16/fp32 safetensors -> round-to-nearest layered: errors reported, logits against HF, flags."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import PagedRunner, save_tiny_model
from reference_packers import LINEARS

from deepinfer.core.config import EngineConfig
from deepinfer.core.errors import ConversionError, ModelLoadError
from deepinfer.core.models.loader import read_model
from deepinfer.core.quant.packing import dequantize
from deepinfer.core.weights.convert.run import convert_checkpoint
from deepinfer.core.weights.convert.source import ConvertOptions
from deepinfer.core.weights.layered import read_layer, read_manifest

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory, tiny_tokenizer):
    """fp32 llama and bf16 qwen2 (q/k/v biases) checkpoints with tokenizers."""
    root = tmp_path_factory.mktemp("hf_src")
    llama = save_tiny_model("llama", root / "llama", tiny_tokenizer, seed=5, hidden_size=128,
                            intermediate_size=256, head_dim=32)
    qwen2 = save_tiny_model("qwen2", root / "qwen2", tiny_tokenizer, seed=6, hidden_size=128, intermediate_size=256)
    qwen2_bf16 = qwen2.to(torch.bfloat16)
    qwen2_bf16.save_pretrained(root / "qwen2_bf16")
    tiny_tokenizer.save_pretrained(root / "qwen2_bf16")
    return {"llama": (root / "llama", llama), "qwen2_bf16": (root / "qwen2_bf16", qwen2_bf16.float())}


@pytest.mark.parametrize(("source", "bits", "group_size", "sym"), [
    ("llama", 4, 128, False), ("llama", 3, 32, True), ("qwen2_bf16", 4, -1, False), ("qwen2_bf16", 3, 64, False),
    ("llama", 8, 64, False),
])
def test_rtn_conversion(hf_dirs, tiny_tokenizer, tmp_path, source, bits, group_size, sym):
    directory, hf_model = hf_dirs[source]
    summary = convert_checkpoint(directory, tmp_path / "out", ConvertOptions(bits=bits, group_size=group_size, sym=sym))
    out = tmp_path / "out"
    manifest = read_manifest(out)
    assert manifest["source"]["kind"] == "hf" and manifest["tokenizer"] is True
    assert manifest["source"]["quant_scheme"]["method"] == "rtn"

    # every projection re-quantized, with its error against the source reported exactly
    source_state = hf_model.state_dict()
    requantized = {r.name: r for r in summary.records if r.method == "requantized"}
    assert len(requantized) == len(LINEARS) * hf_model.config.num_hidden_layers
    weights = {}
    for layer in range(manifest["num_layers"]):
        dense, packed = read_layer(out, layer, manifest)
        assert set(packed) == {f"model.layers.{layer}.{name}" for name in LINEARS}
        for module, weight in packed.items():
            assert weight.bits == bits and weight.group_size == (weight.in_features if group_size == -1 else group_size)
            dequantized = dequantize(weight)
            error = (dequantized - source_state[f"{module}.weight"].float()).abs()
            record = requantized[f"{module}.weight"]
            assert record.max_abs_error == pytest.approx(float(error.max()))
            assert record.mean_abs_error == pytest.approx(float(error.mean()))
            weights[f"{module}.weight"] = dequantized
        for name, tensor in dense.items():  # norms keep the source dtype and values
            assert tensor.dtype == (torch.bfloat16 if source == "qwen2_bf16" else torch.float32)
            assert torch.equal(tensor.float(), source_state[name].float())

    # the converted model computes what HF computes with the dequantized weights
    reference = copy.deepcopy(hf_model).float()
    with torch.no_grad():
        for name, value in weights.items():
            reference.state_dict()[name].copy_(value)
        tokens = list(range(4, 37))
        expected = reference(torch.tensor([tokens])).logits[0]
    loaded = read_model(EngineConfig(model=str(out)), "cpu", torch.float32)
    (logits,) = PagedRunner(loaded.model, seed=3).step([("a", tokens)])
    torch.testing.assert_close(logits, expected, atol=TOLERANCE, rtol=0)
    assert loaded.tokenizer.encode("The capital of France") == tiny_tokenizer.encode("The capital of France")


@pytest.mark.parametrize(("options", "message"), [
    (ConvertOptions(bits=5), "--bits 5 is not supported"),
    (ConvertOptions(bits=2), "--bits 2 is not supported"),
    (ConvertOptions(group_size=100), "--group-size 100 is not supported"),
    (ConvertOptions(keep_8bit=True), "--keep-8bit applies to GGUF sources only"),
])
def test_bad_options(hf_dirs, tmp_path, options, message):
    with pytest.raises(ConversionError, match=message):
        convert_checkpoint(hf_dirs["llama"][0], tmp_path / "out", options)
    assert list(tmp_path.iterdir()) == []


def test_group_that_does_not_divide_the_features(tmp_path, tiny_tokenizer):
    """intermediate 96 cannot be cut into groups of 64: a one-line error naming the tensor."""
    save_tiny_model("llama", tmp_path / "src", tiny_tokenizer)
    with pytest.raises(ConversionError, match=r"down_proj.weight: group size 64 does not divide the 96"):
        convert_checkpoint(tmp_path / "src", tmp_path / "out", ConvertOptions(group_size=64))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_default_group_fits_each_projection(tmp_path, tiny_tokenizer):
    """Hidden 64 and intermediate 96 are no multiples of 128: the default falls back to 64 (all of a
    64-wide input: per-channel) and 32."""
    save_tiny_model("llama", tmp_path / "src", tiny_tokenizer)
    summary = convert_checkpoint(tmp_path / "src", tmp_path / "out")
    groups = {r.name.rsplit(".", 2)[-2]: r.target_type for r in summary.records if r.method == "requantized"}
    assert groups == {"q_proj": "int4-channel", "k_proj": "int4-channel", "v_proj": "int4-channel",
                      "o_proj": "int4-channel", "gate_proj": "int4-channel", "up_proj": "int4-channel",
                      "down_proj": "int4-g32"}


def test_sharded_checkpoint_converts_like_a_single_file(hf_dirs, tmp_path):
    from safetensors.torch import load_file

    directory, hf_model = hf_dirs["llama"]
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="200KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    single = convert_checkpoint(directory, tmp_path / "single_out")
    sharded = convert_checkpoint(tmp_path / "sharded", tmp_path / "sharded_out")
    assert [(r.name, r.max_abs_error) for r in sharded.records] == [(r.name, r.max_abs_error) for r in single.records]
    for name in ("embeddings.safetensors", "layers/layer_00001.safetensors"):
        single_tensors = load_file(str(tmp_path / "single_out" / name))
        sharded_tensors = load_file(str(tmp_path / "sharded_out" / name))
        assert single_tensors.keys() == sharded_tensors.keys()
        assert all(torch.equal(single_tensors[key], sharded_tensors[key]) for key in single_tensors)


def test_quantized_tensors_without_config_are_not_taken_for_hf(hf_dirs, tmp_path):
    from safetensors.torch import save_file

    directory = tmp_path / "src"
    directory.mkdir()
    config = json.loads((hf_dirs["llama"][0] / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config))
    save_file({"model.layers.0.self_attn.q_proj.qweight": torch.zeros(16, 128, dtype=torch.int32)},
              str(directory / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"quantized \(\*\.qweight\) but there is no quantization config"):
        convert_checkpoint(directory, tmp_path / "out")
