"""GPTQ -> layered: bit-exact weights against AutoGPTQ-packed references, logits against HF, bad input."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import PagedRunner, save_tiny_model
from reference_packers import (
    LINEARS,
    gptq_dequantize,
    gptq_tensors,
    random_gptq_linear,
    reference_with_weights,
    save_quantized_checkpoint,
)

from deepinfer.core.config import EngineConfig
from deepinfer.core.errors import ConversionError, ModelLoadError, UnsupportedModelError
from deepinfer.core.models.loader import read_model
from deepinfer.core.quant.packing import dequantize
from deepinfer.core.weights.convert.gptq import gptq_to_packed
from deepinfer.core.weights.convert.run import convert_checkpoint
from deepinfer.core.weights.convert.source import ConvertOptions

TOLERANCE = 1e-4
DIMS = {"hidden_size": 128, "intermediate_size": 256, "head_dim": 32}


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
@pytest.mark.parametrize(("sym", "desc_act"), [(True, False), (False, True)])
def test_linear_dequantizes_exactly(bits, group_size, checkpoint_format, sym, desc_act):
    truth = random_gptq_linear(64, 256, bits, group_size, sym=sym, desc_act=desc_act, seed=bits * 7 + group_size)
    stored = gptq_tensors(truth, bits, checkpoint_format)
    packed = gptq_to_packed(**stored, bias=None, bits=bits, group_size=group_size,
                            zero_convention="v1" if checkpoint_format == "gptq" else "v2")
    assert torch.equal(dequantize(packed), gptq_dequantize(truth))
    assert packed.bits == bits and packed.scales.dtype == torch.float16
    assert packed.group_size == (256 if group_size == -1 else group_size)
    assert (packed.input_perm is not None) == (desc_act and group_size != -1)


def test_v1_and_v2_differ_by_the_stored_minus_one():
    """Reading a v1 checkpoint as v2 must give a different weight: the convention is not a no-op."""
    truth = random_gptq_linear(32, 64, 4, 32, sym=False, desc_act=False, seed=1)
    stored = gptq_tensors(truth, 4, "gptq")
    as_v1 = gptq_to_packed(**stored, bias=None, bits=4, group_size=32, zero_convention="v1")
    as_v2 = gptq_to_packed(**stored, bias=None, bits=4, group_size=32, zero_convention="v2")
    assert torch.equal(dequantize(as_v1), gptq_dequantize(truth))
    assert not torch.equal(dequantize(as_v2), gptq_dequantize(truth))


def write_gptq_model(hf_model, directory, *, bits, group_size, checkpoint_format, sym, desc_act, legacy=False):
    """A GPTQ checkpoint of `hf_model`'s shape; returns the dequantized weights (HF names)."""
    tensors, weights = {}, {}
    for layer in range(hf_model.config.num_hidden_layers):
        for index, linear in enumerate(LINEARS):
            module = f"model.layers.{layer}.{linear}"
            out_features, in_features = hf_model.get_submodule(module).weight.shape
            truth = random_gptq_linear(out_features, in_features, bits, group_size, sym=sym, desc_act=desc_act,
                                       seed=layer * 10 + index)
            tensors[module] = gptq_tensors(truth, bits, checkpoint_format)
            weights[f"{module}.weight"] = gptq_dequantize(truth)
            bias = hf_model.get_submodule(module).bias
            if bias is not None:
                tensors[module]["bias"] = bias.detach().to(torch.float16)
                weights[f"{module}.bias"] = bias.detach().to(torch.float16).float()
    quant_config = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act,
                    "sym": sym, "checkpoint_format": checkpoint_format}
    if legacy:
        quant_config.pop("quant_method")
        save_quantized_checkpoint(hf_model, directory, tensors, None, ("quantize_config.json", quant_config))
    else:
        save_quantized_checkpoint(hf_model, directory, tensors, quant_config)
    return weights


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("gptq_hf")
    return {family: save_tiny_model(family, root / family, tiny_tokenizer, seed=3, **DIMS)
            for family in ("llama", "qwen2")}


def logits_of(model, tokens):
    (logits,) = PagedRunner(model, seed=1).step([("a", tokens)])
    return logits


@pytest.mark.parametrize(("family", "bits", "group_size", "checkpoint_format", "sym", "desc_act", "legacy"), [
    ("llama", 4, 32, "gptq", False, True, False),
    ("llama", 3, 64, "gptq_v2", True, True, False),
    ("llama", 4, -1, "gptq", True, False, True),
    ("qwen2", 3, 128, "gptq", False, False, False),
])
def test_converted_model_logits_match_reference(tiny_hf, tmp_path, family, bits, group_size, checkpoint_format,
                                                sym, desc_act, legacy):
    hf_model = tiny_hf[family]
    weights = write_gptq_model(hf_model, tmp_path / "src", bits=bits, group_size=group_size,
                               checkpoint_format=checkpoint_format, sym=sym, desc_act=desc_act, legacy=legacy)
    summary = convert_checkpoint(tmp_path / "src", tmp_path / "out")
    assert summary.source_kind == "gptq"
    assert sum(r.method == "exact" for r in summary.records) == len(weights) - sum(n.endswith("bias") for n in weights)
    loaded = read_model(EngineConfig(model=str(tmp_path / "out")), "cpu", torch.float32)
    assert loaded.source_kind == "layered"
    assert type(loaded.model.model.layers[0].self_attn.q_proj).__name__ == "QuantLinear"
    reference = reference_with_weights(hf_model, weights)
    tokens = list(range(3, 40))
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(logits_of(loaded.model, tokens), expected, atol=TOLERANCE, rtol=0)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["source"]["quant_scheme"] == {"method": "gptq", "bits": bits, "group_size": group_size,
                                                  "desc_act": desc_act, "sym": sym,
                                                  "checkpoint_format": checkpoint_format}


@pytest.fixture
def gptq_dir(tiny_hf, tmp_path):
    write_gptq_model(tiny_hf["llama"], tmp_path / "src", bits=4, group_size=64, checkpoint_format="gptq",
                     sym=False, desc_act=False)
    return tmp_path / "src"


def leftovers(parent, name):
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.tmp-")]


def edit_config(directory, **quant_changes):
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"].update(quant_changes)
    (directory / "config.json").write_text(json.dumps(config))


def test_missing_quantization_config(gptq_dir, tmp_path):
    config = json.loads((gptq_dir / "config.json").read_text())
    del config["quantization_config"]
    (gptq_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="no quantization config"):
        convert_checkpoint(gptq_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path, "out")


@pytest.mark.parametrize(("change", "error", "message"), [
    ({"bits": 8}, UnsupportedModelError, "8-bit is not supported"),
    ({"checkpoint_format": "marlin"}, UnsupportedModelError, "checkpoint_format 'marlin'"),
    ({"group_size": 48}, ModelLoadError, "group size 48 does not divide"),
    ({"group_size": 32}, ModelLoadError, r"down_proj.scales has shape \(4, 128\), expected \(8, 128\)"),
])
def test_wrong_quantization_config(gptq_dir, tmp_path, change, error, message):
    edit_config(gptq_dir, **change)
    with pytest.raises(error, match=message):
        convert_checkpoint(gptq_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path, "out")


def test_truncated_safetensors(gptq_dir, tmp_path):
    shard = gptq_dir / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        convert_checkpoint(gptq_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path, "out")


def test_output_that_exists_is_left_alone(gptq_dir, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep me")
    with pytest.raises(ConversionError, match="already exists"):
        convert_checkpoint(gptq_dir, tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["mine.txt"]


def test_rtn_flags_are_refused(gptq_dir, tmp_path):
    with pytest.raises(ConversionError, match="--bits: not for GPTQ"):
        convert_checkpoint(gptq_dir, tmp_path / "out", ConvertOptions(bits=3))


def run_cli(monkeypatch, *args):
    from deepinfer.cli.main import main

    monkeypatch.setattr(sys, "argv", ["deepinfer", *map(str, args)])
    with pytest.raises(SystemExit) as exit_info:
        main()
    return exit_info.value.code


def test_cli_converts_and_fails_cleanly(gptq_dir, tmp_path, monkeypatch, capsys):
    assert run_cli(monkeypatch, "convert", gptq_dir, tmp_path / "out") in (0, None)
    printed = capsys.readouterr().out
    assert "exact" in printed and "gptq-int4" in printed and "int4-g64" in printed
    assert run_cli(monkeypatch, "convert", gptq_dir, tmp_path / "out") == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: output") and "already exists" in err and "\n" not in err
    assert run_cli(monkeypatch, "convert", tmp_path / "nowhere", tmp_path / "out2") == 1
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out2").exists() and not leftovers(tmp_path, "out2")
