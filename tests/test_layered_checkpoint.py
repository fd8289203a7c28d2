"""The layered checkpoint format (docs/FORMAT.md): files, manifest, integrity checks, atomic writes, and
loading through the model loader / LLM."""

from __future__ import annotations

import copy
import hashlib
import json

import pytest
import torch
from conftest import FAMILIES, PagedRunner, save_tiny_model
from reference_packers import LINEARS
from safetensors import safe_open

from deepinfer.core.config import EngineConfig
from deepinfer.core.errors import ModelLoadError
from deepinfer.core.models.loader import load_model, read_model
from deepinfer.core.models.spec import ModelSpec
from deepinfer.core.quant.packing import dequantize
from deepinfer.core.quant.quant_linear import QuantLinear
from deepinfer.core.weights.convert.hf import HFSource
from deepinfer.core.weights.convert.run import convert_checkpoint
from deepinfer.core.weights.convert.source import ConvertOptions
from deepinfer.core.weights.layered import FORMAT_NAME, read_layer, read_manifest


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tiny_tokenizer):
    """(layered dir, HF model with the dequantized weights) of a tiny untied llama, 4-bit g64."""
    root = tmp_path_factory.mktemp("layered")
    hf_model = save_tiny_model("llama", root / "src", tiny_tokenizer, seed=9, hidden_size=128,
                               intermediate_size=256, head_dim=32, tie_word_embeddings=False)
    convert_checkpoint(root / "src", root / "out", ConvertOptions(bits=4, group_size=64))
    return root / "out", dequantized_reference(hf_model, root / "out")


@torch.no_grad()
def dequantized_reference(hf_model, out):
    """A copy of `hf_model` whose projections hold the dequantized weights of the checkpoint `out`."""
    manifest = read_manifest(out)
    reference = copy.deepcopy(hf_model)
    for layer in range(manifest["num_layers"]):
        for name, packed in read_layer(out, layer, manifest)[1].items():
            reference.get_submodule(name).weight.copy_(dequantize(packed))
    return reference


def test_directory_layout_and_manifest(converted):
    out, _ = converted
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == FORMAT_NAME and manifest["format_version"] == 1
    assert manifest["num_layers"] == 3 and manifest["architecture"] == "LlamaForCausalLM"
    assert manifest["source"]["kind"] == "hf"
    assert manifest["source"]["quant_scheme"] == {"method": "rtn", "bits": 4, "group_size": 64, "sym": False,
                                                  "source_dtype": "float32"}
    files = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(manifest["files"]) == files
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "embeddings.safetensors",
            "layers/layer_00000.safetensors", "layers/layer_00002.safetensors"} <= files
    for name, entry in manifest["files"].items():
        data = (out / name).read_bytes()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    spec = ModelSpec.from_hf_config(json.loads((out / "config.json").read_text()))
    assert (spec.family, spec.num_layers, spec.tie_word_embeddings) == ("llama", 3, False)
    with safe_open(str(out / "embeddings.safetensors"), "pt") as f:
        assert set(f.keys()) == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    with safe_open(str(out / "layers/layer_00001.safetensors"), "pt") as f:
        metadata, keys = f.metadata(), set(f.keys())
    assert metadata["layer_index"] == "1"
    for linear in LINEARS:
        name = f"model.layers.1.{linear}"
        fields = json.loads(metadata[name])
        assert (fields["bits"], fields["group_size"], fields["zero_mode"]) == (4, 64, "zero")
        assert {f"{name}.qweight", f"{name}.scales", f"{name}.zeros"} <= keys
        assert f"{name}.weight" not in keys
    assert {"model.layers.1.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight"} <= keys


def test_read_model_and_llm_run_the_layered_checkpoint(converted):
    from deepinfer import LLM, SamplingParams

    out, reference = converted
    loaded = read_model(EngineConfig(model=str(out)), "cpu", torch.float32)
    assert loaded.source_kind == "layered" and loaded.name == "out"
    for layer in loaded.model.model.layers:
        for linear in LINEARS:
            assert isinstance(layer.get_submodule(linear), QuantLinear)
    assert isinstance(loaded.model.lm_head, torch.nn.Linear)
    prompt = [5, 17, 42, 99, 3, 250]
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(model=str(out), dtype="float32", device="cpu")
    output = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert output.outputs[0].token_ids == expected


def test_half_precision_load_keeps_fp16_scales(converted):
    out, _ = converted
    loaded = read_model(EngineConfig(model=str(out), dtype="bfloat16"), "cpu", torch.bfloat16)
    q_proj = loaded.model.model.layers[0].self_attn.q_proj
    assert q_proj.scales.dtype == torch.float16 and loaded.model.model.norm.weight.dtype == torch.bfloat16


def copy_checkpoint(converted, tmp_path):
    import shutil

    shutil.copytree(converted[0], tmp_path / "ckpt")
    return tmp_path / "ckpt"


@pytest.mark.parametrize(("damage", "message"), [
    ("flip", r"layer_00001.safetensors: size or sha256 does not match the manifest"),
    ("truncate", r"embeddings.safetensors: size or sha256 does not match the manifest"),
    ("delete", r"layers/layer_00002.safetensors: checkpoint file is missing"),
    ("version", r"format version 2 is not supported"),
    ("wrong_layer", r"layer_00001.safetensors: holds layer '0', expected 1"),
])
def test_damaged_checkpoint_is_a_clear_error(converted, tmp_path, damage, message):
    ckpt = copy_checkpoint(converted, tmp_path)
    manifest_path = ckpt / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    if damage == "flip":
        path = ckpt / "layers/layer_00001.safetensors"
        data = bytearray(path.read_bytes())
        data[-7] ^= 0x10
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path = ckpt / "embeddings.safetensors"
        path.write_bytes(path.read_bytes()[:-100])
    elif damage == "delete":
        (ckpt / "layers/layer_00002.safetensors").unlink()
    elif damage == "version":
        manifest["format_version"] = 2
        manifest_path.write_text(json.dumps(manifest))
    else:  # a layer file in another's place, with a manifest that vouches for it
        (ckpt / "layers/layer_00001.safetensors").write_bytes((ckpt / "layers/layer_00000.safetensors").read_bytes())
        manifest["files"]["layers/layer_00001.safetensors"] = manifest["files"]["layers/layer_00000.safetensors"]
        manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ModelLoadError, match=message):
        load_model(EngineConfig(model=str(ckpt)), "cpu", torch.float32)


def test_failed_conversion_leaves_nothing(converted, tmp_path, tiny_tokenizer, monkeypatch):
    save_tiny_model("llama", tmp_path / "src", tiny_tokenizer)
    original = HFSource.convert_layer

    def fail_on_layer_one(self, index, summary):
        if index == 1:
            raise RuntimeError("disk full")
        return original(self, index, summary)

    monkeypatch.setattr(HFSource, "convert_layer", fail_on_layer_one)
    with pytest.raises(RuntimeError, match="disk full"):
        convert_checkpoint(tmp_path / "src", tmp_path / "out", ConvertOptions(group_size=32))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_runs_from_a_layered_checkpoint(tiny_models, tmp_path, family):
    """Each family's own layers (qk-norm, sandwich norms, Gemma's scaled embedding, sliding windows)
    survive conversion: logits equal HF's with the dequantized projections swapped in."""
    directory, hf_model = tiny_models[family]
    convert_checkpoint(directory, tmp_path / "out", ConvertOptions(bits=3, group_size=32))
    reference = dequantized_reference(hf_model, tmp_path / "out")
    tokens = list(range(3, 33))
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0].float()
    loaded = load_model(EngineConfig(model=str(tmp_path / "out")), "cpu", torch.float32)
    (logits,) = PagedRunner(loaded.model, seed=6).step([("a", tokens)])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
