"""The W4A16 GEMM (kernels/w4_gemm.cu) against its torch reference on the GPU.

Every case draws fresh random codes, scales, zero points and activations, poisons the output with NaN before the
launch, and compares with x @ W.T in fp32 where W is the weight the kernel multiplies (`dequantize_like_kernel`,
itself checked against the reference dequantizer on the CPU): a relative error below 5e-3 leaves only the fp32
accumulation order and the final rounding. Shapes include N and K that are not multiples of the tiles, every group
size the kernels take, act-order (the permuted activations a layer gathers first), bias, split-K, fp16 and bf16.
"""

from __future__ import annotations

import pytest
import torch
from w4_cases import random_w4_weight

from deepinfer.core.quant.packing import dequantize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _cupy_or_skip():
    from deepinfer.kernels import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    if reason:
        pytest.skip(reason)
    from deepinfer.kernels import w4_gemm

    return w4_gemm


def _case(out_features, in_features, group_size, zero_mode, integer_zeros, seed):
    packed = random_w4_weight(out_features, in_features, group_size, zero_mode, integer_zeros, seed)
    device = torch.device("cuda")
    return (packed.qweight.to(device), packed.scales.to(device), packed.zeros.to(device), packed)


def _check(w4_gemm, num_tokens, out_features, in_features, group_size, dtype, zero_mode="zero", integer_zeros=True,
           bias=False, act_order=False, config=None, splits=None, seed=0):
    qweight, scales, zeros, packed = _case(out_features, in_features, group_size, zero_mode, integer_zeros, seed)
    device = qweight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(num_tokens, in_features, device=device, dtype=dtype, generator=generator)
    if act_order:  # the layer gathers x[:, input_perm] before the product
        x = x.index_select(1, torch.randperm(in_features, device=device, generator=generator))
    b = torch.randn(out_features, device=device, dtype=dtype, generator=generator) if bias else None
    sz, zmode = w4_gemm.gemm_scales(scales, zeros, zero_mode, dtype)
    out = torch.full((num_tokens, out_features), float("nan"), device=device, dtype=dtype)
    w4_gemm.w4_gemm(x, qweight, sz, zmode, group_size, bias=b, config=config, splits=splits, out=out)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "an output element was not written"
    weight = w4_gemm.dequantize_like_kernel(qweight, sz, zmode, group_size, out_features, dtype).float()
    reference = x.float() @ weight.T + (b.float() if bias else 0.0)
    relative = float((out.float() - reference).norm() / reference.norm())
    assert relative < 5e-3, relative
    # and close to the reference dequantizer's weight too (bf16: the scale's rounding)
    exact = x.float() @ dequantize(packed, torch.float32).to(device).T + (b.float() if bias else 0.0)
    assert float((out.float() - exact).norm() / exact.norm()) < 1.5e-2


def _configs(w4_gemm):
    mma = [w4_gemm.TileConfig(4, 2, tt, 4) for tt in (1, 2, 4, 8)] + [w4_gemm.TileConfig(8, 2, 2, 3)]
    if not w4_gemm.wgmma_available(torch.cuda.current_device()):
        return mma
    return mma + [w4_gemm.WgmmaConfig(2, 1, n, 4) for n in (16, 32, 64)] + [
        w4_gemm.WgmmaConfig(2, 1, 128, 3), w4_gemm.WgmmaConfig(2, 1, 256, 2), w4_gemm.WgmmaConfig(1, 1, 16, 4),
        w4_gemm.WgmmaConfig(1, 1, 32, 4), w4_gemm.WgmmaConfig(1, 1, 64, 4), w4_gemm.WgmmaConfig(1, 2, 64, 4)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("zero_mode,integer_zeros", [("zero", True), ("min", True), ("zero", False)])
def test_planned_launch_every_group_size_and_zero_mode(dtype, group_size, zero_mode, integer_zeros):
    w4_gemm = _cupy_or_skip()
    _check(w4_gemm, 37, 2048, 2048, group_size, dtype, zero_mode, integer_zeros, seed=group_size)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,out_features,in_features,group_size,bias,act_order", [
    (9, 1000, 2080, 32, False, False),     # N and K off the tiles, K off the 128-k stage
    (100, 2056, 2112, 64, True, False),
    (256, 4608, 3584, 128, False, True),   # act-order
    (16, 2048, 11008, 128, False, False),  # long K: split-K
    (24, 2000, 11008, 128, False, True),   # planned 64-row CTAs (a narrow output at <= 32 tokens), act-order
    (17, 22016, 2048, 64, True, False),    # a wide product just past the packed kernels' 16 tokens
    (3, 576, 576, 576, False, False),      # per-channel, K off the stage
    (64, 22016, 2048, 128, True, False),
    (200, 136, 96, 32, False, False),      # one stage, a partial tile
    (70, 512, 768, 96, False, False),      # a group size that does not divide the stage
])
def test_edge_shapes(dtype, num_tokens, out_features, in_features, group_size, bias, act_order):
    w4_gemm = _cupy_or_skip()
    _check(w4_gemm, num_tokens, out_features, in_features, group_size, dtype, bias=bias, act_order=act_order)


def test_every_tile_config_with_and_without_split_k():
    w4_gemm = _cupy_or_skip()
    for index, config in enumerate(_configs(w4_gemm)):
        for splits in (1, 3):
            _check(w4_gemm, config.tokens * 2 + 3, 1024, 1536, 128, torch.bfloat16, config=config, splits=splits,
                   seed=index)
            _check(w4_gemm, max(1, config.tokens - 3), 1000, 2080, 32, torch.float16, config=config, splits=splits,
                   seed=index + 100)


def test_split_k_sums_are_the_same_bits_every_run():
    w4_gemm = _cupy_or_skip()
    qweight, scales, zeros, _ = _case(2048, 11008, 128, "zero", True, seed=7)
    sz, zmode = w4_gemm.gemm_scales(scales, zeros, "zero", torch.bfloat16)
    x = torch.randn(128, 11008, device="cuda", dtype=torch.bfloat16)
    first = w4_gemm.w4_gemm(x, qweight, sz, zmode, 128, splits=8)
    for _ in range(5):
        assert torch.equal(w4_gemm.w4_gemm(x, qweight, sz, zmode, 128, splits=8), first)


def test_runs_inside_a_cuda_graph():
    w4_gemm = _cupy_or_skip()
    qweight, scales, zeros, _ = _case(2048, 2048, 128, "zero", True, seed=8)
    sz, zmode = w4_gemm.gemm_scales(scales, zeros, "zero", torch.bfloat16)
    x = torch.randn(100, 2048, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(100, 2048, device="cuda", dtype=torch.bfloat16)
    eager = w4_gemm.w4_gemm(x, qweight, sz, zmode, 128, splits=4).clone()  # allocates the split workspace
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w4_gemm.w4_gemm(x, qweight, sz, zmode, 128, splits=4, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
