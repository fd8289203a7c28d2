"""The W4 GEMM's scale pairs (kernels/w4_gemm.py gemm_scales) against the reference dequantizer.

`dequantize_like_kernel` computes the weight the way the kernel does from the packed codes and the scale pairs
(every product exact, one rounding to the activation dtype); it must equal core.quant.packing.dequantize bit for
bit in fp16 with integer zero points (the kernel then rounds exactly where the reference does), and stay within the
bf16 rounding of the scale otherwise. The pairs' placement (tile, group, row g / g + 8) is checked entry by entry.
"""

from __future__ import annotations

import pytest
import torch
from w4_cases import random_w4_weight

from deepinfer.core.quant.packing import dequantize
from deepinfer.kernels import w4_gemm


@pytest.mark.parametrize("group_size", [32, 64, 128, 96])
@pytest.mark.parametrize("out_features", [48, 40, 8])  # whole tiles, a partial last tile, less than one tile
def test_fp16_integer_zeros_equal_the_reference_bit_for_bit(group_size, out_features):
    packed = random_w4_weight(out_features, 384, group_size, "zero", True)
    sz, zmode = w4_gemm.gemm_scales(packed.scales, packed.zeros, packed.zero_mode, torch.float16)
    assert zmode == 0
    assert sz.shape == (-(-out_features // 16), 384 // group_size, 8, 2) and sz.dtype == torch.int32
    weight = w4_gemm.dequantize_like_kernel(packed.qweight, sz, zmode, group_size, out_features, torch.float16)
    assert torch.equal(weight, dequantize(packed, torch.float16))


@pytest.mark.parametrize("zero_mode,integer_zeros,expected_zmode", [
    ("zero", True, 0), ("min", True, 1), ("zero", False, 1)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_mode_matches_the_reference_within_the_dtype(zero_mode, integer_zeros, expected_zmode, dtype):
    packed = random_w4_weight(40, 256, 32, zero_mode, integer_zeros, seed=1)
    sz, zmode = w4_gemm.gemm_scales(packed.scales, packed.zeros, packed.zero_mode, dtype)
    assert zmode == expected_zmode
    weight = w4_gemm.dequantize_like_kernel(packed.qweight, sz, zmode, 32, 40, dtype).float()
    reference = dequantize(packed, torch.float32)
    relative = float((weight - reference).norm() / reference.norm())
    # fp16 rounds each weight once (2^-11); bf16 rounds the scale and the weight (2^-8 each, at most)
    assert relative < (1e-3 if dtype == torch.float16 else 6e-3)


def test_pairs_hold_rows_g_and_g_plus_8_of_each_tile_and_group():
    packed = random_w4_weight(32, 128, 64, "zero", True, seed=2)
    sz, _ = w4_gemm.gemm_scales(packed.scales, packed.zeros, "zero", torch.float16)
    scales = packed.scales.view(torch.int16).to(torch.int64) & 0xFFFF  # [N, G] fp16 bits
    zero_terms = (-(packed.zeros.float() + 1024)).half().view(torch.int16).to(torch.int64) & 0xFFFF
    words = sz.to(torch.int64) & 0xFFFFFFFF
    for tile in range(2):
        for group in range(2):
            for g in range(8):
                lo, hi = 16 * tile + g, 16 * tile + g + 8
                assert int(words[tile, group, g, 0]) == int(scales[lo, group]) | int(scales[hi, group]) << 16
                assert int(words[tile, group, g, 1]) == int(zero_terms[lo, group]) | int(zero_terms[hi, group]) << 16


def test_padding_rows_of_the_last_tile_contribute_nothing():
    packed = random_w4_weight(20, 128, 128, "zero", True, seed=3)
    sz, _ = w4_gemm.gemm_scales(packed.scales, packed.zeros, "zero", torch.bfloat16)
    assert sz.shape[0] == 2
    # rows 20..31 of tile 1 have scale 0: whatever codes the kernel reads there, their weights are 0
    pad_scales = (sz[1, :, :, 0].to(torch.int64) & 0xFFFFFFFF)
    g = torch.arange(8)
    lo_pad = (16 + g) >= 20
    assert ((pad_scales[:, lo_pad] & 0xFFFF) == 0).all()
    assert ((pad_scales >> 16) == 0).all()  # rows 24..31


@pytest.mark.parametrize("group_size,ok", [(32, True), (64, True), (128, True), (96, True), (48, False)])
def test_unsupported_reason(group_size, ok):
    x = torch.empty(4, 384, dtype=torch.bfloat16)
    qweight = torch.empty(16, 48, dtype=torch.int32)
    reason = w4_gemm.unsupported_reason(x, qweight, 4, group_size)
    assert (reason is None) == ok
    assert w4_gemm.unsupported_reason(x, torch.empty(16, 36, dtype=torch.int32), 3, 32).startswith("3-bit")
    assert "float32" in w4_gemm.unsupported_reason(x.float(), qweight, 4, 32)
