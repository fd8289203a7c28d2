"""PackedWeight packing, dequantization, round-to-nearest and QuantLinear against hand-computed references."""

from __future__ import annotations

import pytest
import torch
from reference_packers import autogptq_pack_rows

from deepinfer.core.ops.quant_matmul import quant_matmul
from deepinfer.core.quant.packed import PackedWeight
from deepinfer.core.quant.packing import dequantize, pack_codes, pack_weight, unpack_codes
from deepinfer.core.quant.quant_linear import QuantLinear
from deepinfer.core.quant.rtn import quantization_error, quantize_rtn


def bit_stream_words(codes: list[int], bits: int) -> list[int]:
    """The little-endian bit stream of `codes` (code j at bit bits*j) cut into 32-bit words, as ints."""
    stream = sum(code << (bits * j) for j, code in enumerate(codes))
    num_words = len(codes) * bits // 32
    return [(stream >> (32 * w)) & 0xFFFFFFFF for w in range(num_words)]


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_pack_codes_is_the_documented_bit_stream(bits):
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (3, 64), generator=gen)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.int32 and packed.shape == (3, 64 * bits // 32)
    for row in range(3):
        expected = bit_stream_words(codes[row].tolist(), bits)
        assert [w & 0xFFFFFFFF for w in packed[row].tolist()] == expected
    assert torch.equal(unpack_codes(packed, bits), codes.to(torch.int32))


def test_three_bit_codes_straddle_words():
    """Codes 10 and 21 of a 3-bit run cross word boundaries: all-ones there lights bits 30-32 and 63-65."""
    codes = torch.zeros(1, 32, dtype=torch.int64)
    codes[0, 10] = 7
    codes[0, 21] = 7
    words = [w & 0xFFFFFFFF for w in pack_codes(codes, 3)[0].tolist()]
    assert words == [0xC0000000, 0x80000001, 0x00000003]


@pytest.mark.parametrize("bits", [3, 4])
def test_same_stream_as_autogptq_rows(bits):
    """GPTQ packs along K with the same stream: our packing of W.T's rows equals AutoGPTQ's loop."""
    gen = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 2**bits, (64, 16), generator=gen)  # [K, N]
    reference = torch.from_numpy(autogptq_pack_rows(codes.numpy(), bits))  # [K*bits/32, N]
    assert torch.equal(pack_codes(codes.T, bits), reference.T)


def test_eight_bit_words_and_dequantize_by_hand():
    """bits=8: code j of word w is k = 4w + j at bits 8j..8j+7; both zero modes by hand."""
    codes = torch.tensor([[1, 2, 3, 255] + [0x80] * 28 + list(range(200, 232))])  # [1, 64]
    words = [w & 0xFFFFFFFF for w in pack_codes(codes, 8)[0].tolist()]
    assert words[0] == 0xFF030201 and words[1] == 0x80808080 and words[8] == 0xCBCAC9C8
    assert len(words) == 16 and torch.equal(unpack_codes(pack_codes(codes, 8), 8), codes.to(torch.int32))
    scales = torch.tensor([[0.5, 0.03125]], dtype=torch.float16)
    zeros = torch.tensor([[128.0, -2.5]], dtype=torch.float16)
    zero_mode = dequantize(pack_weight(codes, scales, zeros, 8, "zero"))[0]
    min_mode = dequantize(pack_weight(codes, scales, zeros, 8, "min"))[0]
    assert zero_mode[:4].tolist() == [-63.5, -63.0, -62.5, 63.5] and zero_mode[4] == 0.0
    assert zero_mode[32:34].tolist() == [(200 + 2.5) * 0.03125, (201 + 2.5) * 0.03125]
    assert min_mode[:4].tolist() == [128.5, 129.0, 129.5, 255.5] and min_mode[32] == 200 * 0.03125 - 2.5
    with pytest.raises(ValueError, match="must lie in"):
        pack_codes(torch.full((1, 4), 256), 8)


def test_pack_rejects_out_of_range_codes_and_lengths():
    with pytest.raises(ValueError, match="must lie in"):
        pack_codes(torch.full((1, 8), 16), 4)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_codes(torch.zeros(1, 16, dtype=torch.int64), 3)


def test_dequantize_zero_and_min_modes_by_hand():
    codes = torch.arange(64).remainder(16).reshape(1, 64)
    scales = torch.tensor([[0.5, 0.25]], dtype=torch.float16)
    zeros = torch.tensor([[8.0, 3.0]], dtype=torch.float16)
    zero_mode = dequantize(pack_weight(codes, scales, zeros, 4, "zero"))
    min_mode = dequantize(pack_weight(codes, scales, zeros, 4, "min"))
    k = torch.arange(64)
    q = (k % 16).float()
    s = torch.where(k < 32, 0.5, 0.25)
    z = torch.where(k < 32, 8.0, 3.0)
    assert torch.equal(zero_mode[0], (q - z) * s)
    assert torch.equal(min_mode[0], q * s + z)


def test_dequantize_undoes_input_perm():
    """Stored column j multiplies x[input_perm[j]]: dequantize returns W in the original column order."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(8, 64, generator=gen)
    perm = torch.randperm(64, generator=gen)
    plain = quantize_rtn(weight, 4, 32)
    stored_codes = unpack_codes(plain.qweight, 4)
    permuted = pack_weight(stored_codes, plain.scales, plain.zeros, 4, input_perm=perm)
    original = torch.empty_like(weight)
    original[:, perm] = dequantize(plain)
    assert torch.equal(dequantize(permuted), original)
    x = torch.randn(3, 64, generator=gen)
    torch.testing.assert_close(quant_matmul(x, permuted), x[:, perm] @ dequantize(plain).T)


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("sym", [False, True])
def test_rtn_error_is_within_half_a_step(bits, group_size, sym):
    gen = torch.Generator().manual_seed(bits * 100 + group_size)
    weight = torch.randn(48, 256, generator=gen) * 0.05
    packed = quantize_rtn(weight, bits, group_size, sym)
    group = 256 if group_size == -1 else group_size
    assert packed.group_size == group and packed.scales.dtype == torch.float16
    assert packed.scales.shape == (48, 256 // group)
    codes = unpack_codes(packed.qweight, bits)
    assert int(codes.min()) >= 0 and int(codes.max()) < 2**bits
    if sym:
        assert torch.all(packed.zeros == 2 ** (bits - 1))
    step = packed.scales.float().repeat_interleave(group, dim=1)
    error = (dequantize(packed) - weight).abs()
    # half a step, plus what rounding the scale to fp16 (2**-11 relative) moves the far end of the grid
    assert torch.all(error <= step * (0.5 + 2**bits * 2**-11))
    assert float((error / step).max()) > 0.4  # and the bound is not loose
    max_error, mean_error = quantization_error(weight, packed)
    assert max_error == pytest.approx(float(error.max())) and mean_error == pytest.approx(float(error.mean()))


def test_rtn_more_bits_smaller_error():
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(3))
    three, four, eight = (quantization_error(weight, quantize_rtn(weight, bits, 32))[1] for bits in (3, 4, 8))
    assert 8 * eight < four < three  # steps of range/255 against range/15: about 17 times smaller


def test_rtn_rejects_bad_arguments():
    with pytest.raises(ValueError, match="3, 4 or 8 bits"):
        quantize_rtn(torch.zeros(4, 64), 5, 32)
    with pytest.raises(ValueError, match="does not divide"):
        quantize_rtn(torch.zeros(4, 96), 4, 64)
    with pytest.raises(ValueError, match="NaN"):
        quantize_rtn(torch.full((4, 64), float("nan")), 4, 32)


def test_packed_weight_checks_shapes():
    good = quantize_rtn(torch.randn(8, 64), 4, 32)
    with pytest.raises(ValueError, match="scales has shape"):
        PackedWeight(good.qweight, good.scales[:, :1], good.zeros, 4, 32, 64, 8)
    with pytest.raises(ValueError, match="bits must be 3, 4 or 8"):
        PackedWeight(good.qweight, good.scales, good.zeros, 5, 32, 64, 8)
    with pytest.raises(ValueError, match="qweight has shape"):  # 8 bits need twice the words of 4
        PackedWeight(good.qweight, good.scales, good.zeros, 8, 32, 64, 8)


def test_quant_linear_matches_dequantized_matmul_and_keeps_scale_dtype():
    gen = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(24, 128, generator=gen), torch.randn(24, generator=gen)
    layer = QuantLinear(quantize_rtn(weight, 4, 64, bias=bias))
    x = torch.randn(2, 5, 128, generator=gen)  # [..., K]
    reference = x @ dequantize(layer.packed).T + bias
    assert torch.equal(layer(x), reference)
    assert set(layer.state_dict()) == {"qweight", "scales", "zeros", "bias"}
    layer.to(torch.bfloat16)  # the model's dtype: scales must not be rounded to bf16
    assert layer.scales.dtype == torch.float16 and layer.zeros.dtype == torch.float16
    assert layer.bias.dtype == torch.bfloat16 and layer.qweight.dtype == torch.int32
    out = layer(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.shape == (2, 5, 24)
    torch.testing.assert_close(out.float(), reference, atol=0.3, rtol=0.02)


@pytest.mark.parametrize("zero_mode", ["zero", "min"])
def test_eight_bit_quant_linear_runs_the_reference(zero_mode):
    """On the CPU an 8-bit layer is dequantized and multiplied in torch, equal to the hand-computed product; on a
    GPU the packed 3-/4-bit kernels refuse it (kernels/w8_gemm.cu and the dequantize kernel serve it)."""
    from deepinfer.kernels import dequantize as kd
    from deepinfer.kernels import quant_matmul as kq

    gen = torch.Generator().manual_seed(11)
    codes = torch.randint(0, 256, (24, 128), generator=gen)
    scales = (torch.rand(24, 4, generator=gen) * 0.01).to(torch.float16)
    zeros = torch.randint(0, 256, (24, 4), generator=gen).to(torch.float16)
    bias = torch.randn(24, generator=gen)
    layer = QuantLinear(pack_weight(codes, scales, zeros, 8, zero_mode, bias=bias))
    q = codes.float()
    s, z = scales.float().repeat_interleave(32, dim=1), zeros.float().repeat_interleave(32, dim=1)
    weight = (q - z) * s if zero_mode == "zero" else q * s + z  # [N, K], by hand
    x = torch.randn(3, 128, generator=gen)
    torch.testing.assert_close(layer(x), x @ weight.T + bias)
    assert layer.packed.qweight.shape == (24, 32)
    weight = kq.packed_operands(layer.qweight, layer.scales, layer.zeros, 8, 32)
    assert kq.unsupported_reason(torch.float16, weight) == "8-bit weights"
    assert kd.unsupported_reason(torch.float16, weight) is None


def test_quantize_projections_swaps_only_projections(tiny_models):
    from conftest import PagedRunner

    from deepinfer.core.models.decoder import DecoderModel
    from deepinfer.core.models.spec import ModelSpec
    from deepinfer.core.quant.quantize_model import quantize_projections

    _, hf_model = tiny_models["qwen2"]  # q/k/v biases
    model = DecoderModel(ModelSpec.from_hf_config(hf_model.config.to_dict()), max_positions=128)
    model.load_weights(hf_model.state_dict().items())
    embedding = model.model.embed_tokens.weight.clone()
    assert quantize_projections(model, bits=3) == 7 * hf_model.config.num_hidden_layers
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert {(q.bits, q.group_size) for q in quantized} == {(3, 64), (3, 32)}  # K = 64 and K = 96
    assert not any(isinstance(m, torch.nn.Linear) for m in model.model.layers.modules())
    assert torch.equal(model.model.embed_tokens.weight, embedding)
    q_proj = model.model.layers[0].self_attn.q_proj
    x = torch.randn(2, 64)
    reference = x @ dequantize(q_proj.packed).T + hf_model.model.layers[0].self_attn.q_proj.bias
    torch.testing.assert_close(q_proj(x), reference)
    (logits,) = PagedRunner(model, seed=1).step([("a", [5, 6, 7])])
    assert torch.isfinite(logits).all()
