"""GPTQ, AWQ and GGUF checkpoints run directly (`--model X`, no `deepinfer convert`): converted into memory
by the converters at load, the same weights as their conversion, logits against HF transformers; lossy
GGUF conversions (Q5_K / Q6_K to 8 bits) cached once, read back, never half-written, or not written at all."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import PagedRunner, save_tiny_model
from reference_packers import reference_with_weights, write_tiny_gguf
from test_convert_awq import write_awq_model
from test_convert_gptq import write_gptq_model

from deepinfer.core.config import EngineConfig
from deepinfer.core.models.loader import read_model
from deepinfer.core.quant.packing import dequantize
from deepinfer.core.quant.quant_linear import QuantLinear
from deepinfer.core.weights.convert import cache as convert_cache
from deepinfer.core.weights.convert.run import convert_checkpoint
from deepinfer.core.weights.convert.source import ConvertOptions

TOLERANCE = 1e-4
TOKENS = list(range(6, 40))
EXACT = {"self_attn.q_proj": "Q4_0", "self_attn.k_proj": "Q4_1", "self_attn.v_proj": "Q8_0",
         "self_attn.o_proj": "Q4_1", "mlp.gate_proj": "Q4_K", "mlp.up_proj": "Q4_K", "mlp.down_proj": "Q4_K"}
# a Q4_K_M-like mix: more-bits types beside the 4-bit ones, and a float projection
MIXED = {"self_attn.q_proj": "Q4_K", "self_attn.k_proj": "Q6_K", "self_attn.v_proj": "Q5_K",
         "self_attn.o_proj": "F16", "mlp.gate_proj": "Q4_K", "mlp.up_proj": "Q8_0", "mlp.down_proj": "Q6_K"}


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("direct_hf")
    return save_tiny_model("llama", root / "llama", tiny_tokenizer, seed=3, hidden_size=256, intermediate_size=512,
                           head_dim=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / convert_cache.CACHE_SUBDIR


@pytest.fixture
def packed_cpu(monkeypatch):
    """GGUFs run directly on the CPU's packed layout (the suite's default, dense, dequantizes them)."""
    monkeypatch.setenv("DEEPINFER_CPU_WEIGHTS", "packed")


def logits_of(model, tokens=TOKENS):
    (logits,) = PagedRunner(model, seed=1).step([("a", tokens)])
    return logits


def reference_logits(hf_model, weights):
    with torch.no_grad():
        return reference_with_weights(hf_model, weights)(torch.tensor([TOKENS])).logits[0]


@pytest.mark.parametrize("kind", ["gptq", "awq"])
def test_quantizer_export_runs_directly(tiny_hf, tmp_path, kind, capfd):
    if kind == "gptq":  # act-order, asymmetric, v1 zero points: the conventions a repack must undo
        weights = write_gptq_model(tiny_hf, tmp_path / "src", bits=4, group_size=64, checkpoint_format="gptq",
                                   sym=False, desc_act=True)
    else:
        weights = write_awq_model(tiny_hf, tmp_path / "src", group_size=64, zero_point=True)
    loaded = read_model(EngineConfig(model=str(tmp_path / "src")), "cpu", torch.float32)
    assert (loaded.source_kind, loaded.name) == (kind, "src")
    q_proj = loaded.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, QuantLinear) and q_proj.bits == 4
    assert (q_proj.input_perm is not None) == (kind == "gptq")
    torch.testing.assert_close(logits_of(loaded.model), reference_logits(tiny_hf, weights), atol=TOLERANCE, rtol=0)
    line = capfd.readouterr().err
    assert f"src runs as W4A16 ({kind.upper()}, 4-bit, group 64" in line and "re-packed exactly" in line
    assert not (tmp_path / "cache").exists()


def test_exact_gguf_runs_directly_as_its_conversion(tiny_hf, tmp_path, cache_dir, packed_cpu, capfd):
    """Q4_0/Q4_1/Q4_K at 4 bits and Q8_0 at 8, bit for bit gguf-py's values, computing what `deepinfer
    convert`'s checkpoint computes; exact conversions are never cached."""
    weights = write_tiny_gguf(tiny_hf, tmp_path / "tiny.gguf", EXACT, seed=2)
    loaded = read_model(EngineConfig(model=str(tmp_path / "tiny.gguf")), "cpu", torch.float32)
    assert loaded.source_kind == "gguf"
    layer = loaded.model.model.layers[1]
    for linear, type_name in EXACT.items():
        module = layer.get_submodule(linear)
        assert isinstance(module, QuantLinear) and module.bits == (8 if type_name == "Q8_0" else 4), linear
        assert torch.equal(dequantize(module.packed), torch.from_numpy(weights[f"model.layers.1.{linear}.weight"]))
    convert_checkpoint(tmp_path / "tiny.gguf", tmp_path / "converted", ConvertOptions(keep_8bit=True))
    converted = read_model(EngineConfig(model=str(tmp_path / "converted")), "cpu", torch.float32)
    assert torch.equal(logits_of(loaded.model), logits_of(converted.model))
    err = capfd.readouterr().err
    assert "tiny.gguf runs as: projections 9 Q4_K -> W4A16, exact; 6 Q4_1 -> W4A16, exact; 3 Q4_0 -> W4A16, " \
           "exact; 3 Q8_0 -> W8A16, exact; embeddings and norms dense" in err
    assert not cache_dir.exists()


def test_lossy_gguf_is_cached_once_and_read_back(tiny_hf, tmp_path, cache_dir, packed_cpu, capfd, monkeypatch):
    gguf = tmp_path / "mixed.gguf"
    weights = write_tiny_gguf(tiny_hf, gguf, MIXED, seed=4)
    first = read_model(EngineConfig(model=str(gguf)), "cpu", torch.float32)
    err = capfd.readouterr().err
    (entry,) = cache_dir.iterdir()
    assert f"conversion cached in {entry}" in err and "6 Q6_K -> W8A16, round-to-nearest group 32" in err
    assert "3 F16 -> dense" in err
    layer = first.model.model.layers[0]
    assert type(layer.self_attn.o_proj) is torch.nn.Linear  # F16: kept dense, never quantized
    assert torch.equal(layer.self_attn.o_proj.weight, torch.from_numpy(weights["model.layers.0.self_attn.o_proj.weight"]))
    assert [layer.get_submodule(n).bits for n in ("self_attn.q_proj", "self_attn.k_proj", "mlp.up_proj")] == [4, 8, 8]
    k_error = dequantize(layer.self_attn.k_proj.packed) - torch.from_numpy(weights["model.layers.0.self_attn.k_proj.weight"])
    assert 0 < float(k_error.abs().max()) < 1e-2 * float(layer.self_attn.k_proj.scales.float().max()) * 255

    def no_conversion(*args, **kwargs):
        raise AssertionError("the cached conversion was not used")

    monkeypatch.setattr(convert_cache, "convert_checkpoint", no_conversion)
    second = read_model(EngineConfig(model=str(gguf)), "cpu", torch.float32)
    assert second.source_kind == "gguf" and "conversion cached" not in capfd.readouterr().err
    assert torch.equal(logits_of(first.model), logits_of(second.model))
    monkeypatch.undo()
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(cache_dir.parent))
    monkeypatch.setenv("DEEPINFER_CPU_WEIGHTS", "packed")

    uncached = read_model(EngineConfig(model=str(gguf), convert_cache=False), "cpu", torch.float32)
    assert torch.equal(logits_of(uncached.model), logits_of(first.model))
    assert list(cache_dir.iterdir()) == [entry]  # --no-convert-cache wrote nothing

    os.utime(gguf, ns=(gguf.stat().st_atime_ns, gguf.stat().st_mtime_ns + 10**9))  # a changed file: a new entry
    read_model(EngineConfig(model=str(gguf)), "cpu", torch.float32)
    assert len(list(cache_dir.iterdir())) == 2


def test_interrupted_cache_write_is_never_read(tiny_hf, tmp_path, cache_dir, packed_cpu, capfd):
    """A first load killed while writing leaves a temp directory beside the entry: the next load converts
    again (and removes it) instead of reading it."""
    gguf = tmp_path / "mixed.gguf"
    write_tiny_gguf(tiny_hf, gguf, MIXED, seed=4)
    entry = convert_cache.cache_entry(gguf, ConvertOptions(keep_8bit=True, dense_float=True))
    leftover = entry.parent / f".{entry.name}.tmp-999999999-dead"  # a pid no process has
    (leftover / "layers").mkdir(parents=True)
    (leftover / "config.json").write_text("{}")
    read_model(EngineConfig(model=str(gguf)), "cpu", torch.float32)
    assert sorted(p.name for p in cache_dir.iterdir()) == [entry.name]
    assert f"conversion cached in {entry}" in capfd.readouterr().err


def test_no_room_for_the_cache_loads_in_memory(tiny_hf, tmp_path, cache_dir, packed_cpu, capfd, monkeypatch):
    gguf = tmp_path / "mixed.gguf"
    write_tiny_gguf(tiny_hf, gguf, MIXED, seed=4)
    monkeypatch.setattr(convert_cache, "free_bytes", lambda directory: 1000)
    loaded = read_model(EngineConfig(model=str(gguf)), "cpu", torch.float32)
    assert loaded.model.model.layers[0].self_attn.k_proj.bits == 8
    assert "not enough free space" in capfd.readouterr().err
    assert not cache_dir.exists() or not list(cache_dir.iterdir())

