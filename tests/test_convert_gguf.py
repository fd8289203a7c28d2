"""GGUF -> layered: Q4_0/Q4_1/Q4_K (and Q8_0 at 8 bits with --keep-8bit) bit-exact against gguf-py's dequantize,
other types re-quantized (4, 3 or 8 bits) with their error reported, logits of tiny llama GGUFs against HF, and
the real SmolLM2 Q4_1 giving the GGUF path's tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import PagedRunner, save_tiny_model
from reference_packers import (
    LINEARS,
    gguf_dequantize,
    gguf_quantized,
    llama_cpp_permute,
    reference_with_weights,
    write_tiny_gguf,
)

from deepinfer.core.config import EngineConfig
from deepinfer.core.errors import ConversionError, ModelLoadError
from deepinfer.core.models.loader import read_model
from deepinfer.core.quant.packing import dequantize
from deepinfer.core.weights.convert.gguf import gguf_exact_to_packed, qk_row_order
from deepinfer.core.weights.convert.run import convert_checkpoint
from deepinfer.core.weights.convert.source import ConvertOptions
from deepinfer.core.weights.layered import read_layer, read_manifest

TOLERANCE = 1e-4
EXACT = {"self_attn.q_proj": "Q4_0", "self_attn.k_proj": "Q4_1", "self_attn.v_proj": "Q4_0",
         "self_attn.o_proj": "Q4_1", "mlp.gate_proj": "Q4_K", "mlp.up_proj": "Q4_K", "mlp.down_proj": "Q4_K"}
REQUANTIZED = {"self_attn.q_proj": "Q8_0", "self_attn.k_proj": "Q6_K", "self_attn.v_proj": "Q5_K",
               "self_attn.o_proj": "F16", "mlp.gate_proj": "Q4_0", "mlp.up_proj": "Q6_K", "mlp.down_proj": "Q5_K"}


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K", "Q8_0"])
def test_exact_types_dequantize_exactly(type_name):
    rng = np.random.default_rng(1)
    weight = rng.normal(0, 0.05, size=(48, 512)).astype(np.float32)
    data = gguf_quantized(weight, type_name, rng)
    reference = torch.from_numpy(gguf_dequantize(data, type_name).reshape(48, 512))
    packed = gguf_exact_to_packed(data, type_name, 48, 512)
    assert torch.equal(dequantize(packed), reference)
    assert packed.group_size == 32 and packed.zero_mode == ("zero" if type_name in ("Q4_0", "Q8_0") else "min")
    assert packed.bits == (8 if type_name == "Q8_0" else 4)
    if type_name == "Q4_K":  # d * sub-scale is not fp16-exact, which is why the scales are fp32
        assert packed.scales.dtype == torch.float32
        assert not torch.equal(packed.scales.half().float(), packed.scales)
    order = qk_row_order(48, 4)
    assert torch.equal(dequantize(gguf_exact_to_packed(data, type_name, 48, 512, row_order=order)), reference[order])


def test_qk_row_order_undoes_llama_cpp_permutation():
    weight = np.arange(24 * 3).reshape(24, 3)
    for heads in (1, 2, 3):
        permuted = torch.from_numpy(llama_cpp_permute(weight, heads))
        assert torch.equal(permuted[qk_row_order(24, heads)], torch.from_numpy(weight))


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """Llama and Qwen2 (q/k/v biases) of hidden 256 and intermediate 512 (Q4_K blocks hold 256
    weights), GQA 4/2 heads of 64, plain RoPE and no sliding window, as their GGUF metadata says."""
    root = tmp_path_factory.mktemp("gguf_hf")
    dims = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    return {"llama": save_tiny_model("llama", root / "llama", seed=8, **dims),
            "qwen2": save_tiny_model("qwen2", root / "qwen2", seed=9, use_sliding_window=False, **dims)}


@pytest.fixture(scope="module")
def tiny_llama(tiny_models):
    return tiny_models["llama"]


def logits_of(model, tokens):
    (logits,) = PagedRunner(model, seed=5).step([("a", tokens)])
    return logits


TOKENS = list(range(6, 45))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_exact_types_model_logits(tiny_models, tmp_path, family):
    hf_model = tiny_models[family]
    weights = write_tiny_gguf(hf_model, tmp_path / "tiny.gguf", EXACT, seed=2)
    summary = convert_checkpoint(tmp_path / "tiny.gguf", tmp_path / "out")
    assert {(r.source_type, r.method) for r in summary.records} == {
        ("Q4_0", "exact"), ("Q4_1", "exact"), ("Q4_K", "exact"), ("F32", "kept")}
    manifest = read_manifest(tmp_path / "out")
    assert manifest["tokenizer"] is False  # the tiny GGUF has no vocabulary
    for layer in range(manifest["num_layers"]):  # weights equal gguf-py's, Q/K rows un-permuted
        _, packed = read_layer(tmp_path / "out", layer, manifest)
        for linear in LINEARS:
            name = f"model.layers.{layer}.{linear}"
            assert torch.equal(dequantize(packed[name]), torch.from_numpy(weights[f"{name}.weight"]))
    loaded = read_model(EngineConfig(model=str(tmp_path / "out")), "cpu", torch.float32)
    assert loaded.spec.family == family
    reference = reference_with_weights(hf_model, {k: torch.from_numpy(v) for k, v in weights.items()})
    with torch.no_grad():
        expected = reference(torch.tensor([TOKENS])).logits[0]
    torch.testing.assert_close(logits_of(loaded.model, TOKENS), expected, atol=TOLERANCE, rtol=0)


def test_rope_freqs_follow_the_gguf_path(tiny_llama, tmp_path):
    """Llama 3 GGUFs carry RoPE scaling as a rope_freqs tensor: it goes to config.json, not to a layer,
    and the converted model computes what deepinfer's GGUF path computes."""
    from deepinfer.core.models.decoder import DecoderModel
    from deepinfer.core.weights.gguf_reader import gguf_spec, iter_gguf_weights, open_gguf

    factors = np.linspace(1.0, 8.0, tiny_llama.config.head_dim // 2)
    write_tiny_gguf(tiny_llama, tmp_path / "tiny.gguf", EXACT, seed=4, rope_freqs=factors)
    convert_checkpoint(tmp_path / "tiny.gguf", tmp_path / "out")
    layered = read_model(EngineConfig(model=str(tmp_path / "out")), "cpu", torch.float32)
    reader = open_gguf(tmp_path / "tiny.gguf")  # the GGUF path, without a tokenizer (the file has none)
    spec = gguf_spec(reader)
    direct = DecoderModel(spec, max_positions=spec.max_position_embeddings)
    direct.load_weights(iter_gguf_weights(reader, spec))
    assert layered.spec.rope_scaling == spec.rope_scaling is not None
    torch.testing.assert_close(logits_of(layered.model, TOKENS), logits_of(direct, TOKENS), atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize(("options", "target"), [
    (ConvertOptions(), "int4-g32"),
    (ConvertOptions(bits=3, group_size=64, sym=True), "int3-g64"),
    (ConvertOptions(keep_8bit=True), "int8-g32"),
])
def test_other_types_requantized_or_kept_at_8_bits(tiny_llama, tmp_path, options, target):
    """Q8_0/Q6_K/Q5_K/F16 projections: re-quantized to --bits, or with --keep-8bit Q8_0 re-packed exactly
    at 8 bits (bit for bit gguf-py's dequantize, Q/K rows un-permuted) and the others re-quantized at 8."""
    keep_8bit = options.keep_8bit
    weights = write_tiny_gguf(tiny_llama, tmp_path / "tiny.gguf", REQUANTIZED, seed=3, embedding_type="Q8_0")
    summary = convert_checkpoint(tmp_path / "tiny.gguf", tmp_path / "out", options)
    records = {r.name: r for r in summary.records}
    manifest = read_manifest(tmp_path / "out")
    assert manifest["source"]["quant_scheme"]["requantized"]["bits"] == (8 if keep_8bit else options.rtn_bits)
    converted = {}
    for layer in range(manifest["num_layers"]):
        dense, packed = read_layer(tmp_path / "out", layer, manifest)
        assert not any(name.endswith("_proj.weight") for name in dense)  # every projection is packed
        for linear, type_name in REQUANTIZED.items():
            name = f"model.layers.{layer}.{linear}.weight"
            source = torch.from_numpy(weights[name])
            record = records[name]
            assert record.source_type == type_name
            converted[name] = dequantize(packed[name.removesuffix(".weight")])
            assert manifest["tensors"][name]["target_type"] == record.target_type
            if type_name == "Q4_0" or (keep_8bit and type_name == "Q8_0"):
                assert record.method == "exact" and record.max_abs_error is None
                assert record.target_type == ("int8-g32" if type_name == "Q8_0" else "int4-g32")
                assert torch.equal(converted[name], source)
                continue
            assert record.method == "requantized" and record.target_type == target
            error = (converted[name] - source).abs()
            assert record.max_abs_error == pytest.approx(float(error.max()))
            assert record.mean_abs_error == pytest.approx(float(error.mean()))
            assert manifest["tensors"][name]["max_abs_error"] == record.max_abs_error
            # RTN rounds by half a step (plus the fp16 scale's rounding): 8-bit asym range / 255,
            # 4-bit asym range / 15, 3-bit symmetric absmax / 3, where range <= 2 * absmax
            bound = float(source.abs().max()) * (1 / 200 if keep_8bit else 1 / 14 if options.rtn_bits == 4 else 1 / 5)
            assert 0 < record.max_abs_error <= bound
    embedding = records["model.embed_tokens.weight"]
    assert (embedding.method, embedding.source_type, embedding.target_type) == ("kept", "Q8_0", "float16")
    converted["model.embed_tokens.weight"] = torch.from_numpy(weights["model.embed_tokens.weight"]).half().float()
    loaded = read_model(EngineConfig(model=str(tmp_path / "out")), "cpu", torch.float32)
    k_proj = loaded.model.model.layers[0].self_attn.k_proj
    assert type(k_proj).__name__ == "QuantLinear" and k_proj.bits == (8 if keep_8bit else options.rtn_bits)
    all_weights = {k: torch.from_numpy(v) for k, v in weights.items()} | converted
    with torch.no_grad():
        expected = reference_with_weights(tiny_llama, all_weights)(torch.tensor([TOKENS])).logits[0]
    torch.testing.assert_close(logits_of(loaded.model, TOKENS), expected, atol=TOLERANCE, rtol=0)


def test_keep_8bit_error_is_far_below_4_bit(tiny_llama, tmp_path):
    """The same Q6_K / Q5_K / F16 tensors re-quantized at 8 and at 4 bits (group 32, asym): steps of
    range / 255 against range / 15, so the reported errors shrink about 17 times; the CLI table and
    the manifest show 8 bits. --bits 8 means --keep-8bit; --keep-8bit with --bits 4 is refused."""
    from typer.testing import CliRunner

    from deepinfer.cli.main import app

    write_tiny_gguf(tiny_llama, tmp_path / "tiny.gguf", REQUANTIZED, seed=6)
    four = {r.name: r for r in convert_checkpoint(tmp_path / "tiny.gguf", tmp_path / "four").records}
    result = CliRunner().invoke(app, ["convert", str(tmp_path / "tiny.gguf"), str(tmp_path / "eight"), "--keep-8bit"])
    assert result.exit_code == 0, result.output
    eight = read_manifest(tmp_path / "eight")["tensors"]
    compared = 0
    for name, record in four.items():
        if record.source_type in ("Q6_K", "Q5_K", "F16"):
            assert eight[name]["method"] == "requantized" and eight[name]["target_type"] == "int8-g32"
            assert eight[name]["max_abs_error"] < record.max_abs_error / 10
            assert eight[name]["mean_abs_error"] < record.mean_abs_error / 10
            compared += 1
    assert compared == 5 * tiny_llama.config.num_hidden_layers
    table = {tuple(line.split()[:3]) for line in result.output.splitlines() if line.split()}
    assert {("exact", "Q8_0", "int8-g32"), ("requantized", "Q6_K", "int8-g32"), ("requantized", "Q5_K", "int8-g32"),
            ("requantized", "F16", "int8-g32"), ("exact", "Q4_0", "int4-g32")} <= table
    as_bits = {r.name: r for r in convert_checkpoint(tmp_path / "tiny.gguf", tmp_path / "bits8",
                                                     ConvertOptions(bits=8)).records}
    assert {n: (r.method, r.target_type, r.max_abs_error) for n, r in as_bits.items()} == {
        n: (v["method"], v["target_type"], v.get("max_abs_error")) for n, v in eight.items()}
    with pytest.raises(ConversionError, match="--keep-8bit stores 8-bit weights: it does not go with --bits 4"):
        convert_checkpoint(tmp_path / "tiny.gguf", tmp_path / "out", ConvertOptions(bits=4, keep_8bit=True))


def test_bad_gguf_input(tiny_llama, tmp_path):
    write_tiny_gguf(tiny_llama, tmp_path / "tiny.gguf", EXACT)
    with pytest.raises(ConversionError, match="--bits 5 is not supported"):
        convert_checkpoint(tmp_path / "tiny.gguf", tmp_path / "out", ConvertOptions(bits=5))
    data = (tmp_path / "tiny.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 4096])
    with pytest.raises(ModelLoadError, match="truncated"):
        convert_checkpoint(tmp_path / "cut.gguf", tmp_path / "out")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        convert_checkpoint(tmp_path / "junk.gguf", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf", "junk.gguf", "tiny.gguf"]


@pytest.fixture(scope="module")
def smollm2_layered(smollm2_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / "layered"
    summary = convert_checkpoint(smollm2_gguf, out)
    return out, summary


def test_smollm2_q4_1_converts_exactly(smollm2_layered):
    out, summary = smollm2_layered
    rows = {(row.method, row.source_type): row for row in summary.rows()}
    assert rows[("exact", "Q4_1")].tensors == 30 * 7
    assert rows[("kept", "Q8_0")].tensors == 1  # the (tied) embedding, kept in fp16
    manifest = read_manifest(out)
    assert manifest["num_layers"] == 30 and manifest["tokenizer"] is True
    assert (out / "tokenizer.json").is_file()


def test_smollm2_greedy_tokens_match_the_gguf_path(smollm2_layered, smollm2_gguf):
    from deepinfer import LLM, SamplingParams

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0.0, max_tokens=9)
    answers = {}
    for name, model in (("gguf", smollm2_gguf), ("layered", smollm2_layered[0])):
        llm = LLM(model=str(model), dtype="float32", device="cpu")
        prompt = llm.tokenizer.encode_chat(messages)
        answers[name] = (prompt, llm.generate([prompt], params)[0].outputs[0])
    (gguf_prompt, gguf_out), (layered_prompt, layered_out) = answers["gguf"], answers["layered"]
    assert layered_prompt == gguf_prompt  # the saved HF tokenizer and chat template match the GGUF's
    assert layered_out.token_ids == gguf_out.token_ids
    assert layered_out.text.startswith("The capital of France is Paris")
