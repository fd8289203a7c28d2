"""The W4 kernels over the fragment layout (kernels/w4_fragment_gemm.cu, 1-32 tokens; kernels/w4_fragment_batch.cu,
33-128) against the torch reference on the GPU.

Every case draws fresh random codes, scales, integer zero points and activations, poisons the output with NaN before
the launch, and compares with x @ W.T in fp32, W the reference dequantizer's fp32 weight (core.quant.packing
.dequantize): the weights the kernel's tensor cores see are (q - z) exactly and its group scaling is the reference's
fp32 multiply (tests/test_w4_fragment_layout.py holds the layout to that on the CPU), so a relative error below 5e-3
leaves only the fp32 summation order and the final rounding. Shapes include N that is not a multiple of 16 or of a
CTA's rows, K that is not a multiple of a stage or of an atom, every group size the kernel takes and one group a row,
every launch shape, explicit K splits (the batch kernel: CTA counts that cut tiles into parts), bias, act-order
activations, fp16 and bf16, 1 to 128 tokens.
"""

from __future__ import annotations

import pytest
import torch
from w4_cases import random_w4_weight

from deepinfer.core.quant.packing import dequantize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _kernels():
    from deepinfer.kernels import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    if reason:
        pytest.skip(reason)
    from deepinfer.kernels import w4_fragment_gemm

    return w4_fragment_gemm


def _check(fragment, num_tokens, out_features, in_features, group_size, dtype, bias=False, act_order=False,
           config=None, splits=None, seed=0, batch_ctas=None):
    """batch_ctas: run the 33-128-token kernel instead, on that many CTAs (0: its plan's)."""
    packed = random_w4_weight(out_features, in_features, group_size, "zero", True, seed)
    device = torch.device("cuda")
    weight = fragment.fragment_layout(packed.qweight.to(device), packed.scales.to(device), packed.zeros.to(device),
                                      group_size, out_features, in_features, dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(num_tokens, in_features, device=device, dtype=dtype, generator=generator)
    if act_order:  # the layer gathers x[:, input_perm] before the product
        x = x.index_select(1, torch.randperm(in_features, device=device, generator=generator))
    b = torch.randn(out_features, device=device, dtype=dtype, generator=generator) if bias else None
    out = torch.full((num_tokens, out_features), float("nan"), device=device, dtype=dtype)
    if batch_ctas is None:
        fragment.w4_fragment_gemm(x, weight, bias=b, config=config, splits=splits, out=out)
    else:
        from deepinfer.kernels import w4_fragment_batch

        w4_fragment_batch.w4_fragment_batch(x, weight, bias=b, ctas=batch_ctas or None, out=out)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "an output element was not written"
    reference = x.float() @ dequantize(packed, torch.float32).to(device).T + (b.float() if bias else 0.0)
    relative = float((out.float() - reference).norm() / reference.norm())
    assert relative < 5e-3, relative


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
@pytest.mark.parametrize("num_tokens", [1, 7, 16, 29])
def test_every_group_size_and_token_tile(dtype, group_size, num_tokens):
    _check(_kernels(), num_tokens, 1000, 2048, group_size, dtype, bias=num_tokens % 2 == 1, seed=group_size)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_features,in_features,group_size", [
    (40, 160, 32),       # a partial row tile, K not a multiple of an atom, one stage
    (200, 1344, 64),     # N not a multiple of a CTA, K not a multiple of a stage
    (2560, 2048, 2048),  # one group a row
    (1000, 4160, 4160),  # one group a row, K = 16.25 stages
    (22016, 2048, 128),  # Qwen2.5-3B's merged gate/up
    (2048, 11008, 128),  # its down-projection (long K, many splits)
])
def test_shapes_off_the_tiles(dtype, out_features, in_features, group_size):
    kernels = _kernels()
    for num_tokens in (3, 32):
        _check(kernels, num_tokens, out_features, in_features, group_size, dtype, seed=out_features + num_tokens)


def test_every_launch_shape_and_k_splits_in_both_dtypes():
    kernels = _kernels()
    for config in kernels.CONFIGS:
        for splits in (1, 3, 8):
            for dtype in (torch.bfloat16, torch.float16):
                _check(kernels, config.tokens, 1000, 3072, 128, dtype, bias=True, config=config, splits=splits,
                       seed=splits)


def test_act_order_activations_and_more_tokens_than_a_cta():
    kernels = _kernels()
    for num_tokens in (33, 64, 128):
        _check(kernels, num_tokens, 2560, 2048, 128, torch.bfloat16, act_order=True, seed=num_tokens)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", [32, 64, 128, 2048])
def test_the_batch_kernel_at_every_group_size(dtype, group_size):
    kernels = _kernels()
    for num_tokens in (33, 64, 97, 128):
        _check(kernels, num_tokens, 1000, 2048, group_size, dtype, bias=num_tokens % 2 == 1, seed=num_tokens + group_size,
               batch_ctas=0)


def test_the_batch_kernels_stream_k_parts_meet_in_k_order():
    """CTA counts that cut every tile into parts (one CTA holding them all, a few, more than the tiles' k blocks),
    against the reference; and the same CTA count gives the same bits every run (the parts are added in k order)."""
    kernels = _kernels()
    for ctas in (1, 5, 17, 130):
        _check(kernels, 80, 2048, 5632, 128, torch.bfloat16, bias=True, act_order=ctas == 5, seed=ctas, batch_ctas=ctas)
    from deepinfer.kernels import w4_fragment_batch

    packed = random_w4_weight(2048, 5632, 128, "zero", True, 3)
    device = torch.device("cuda")
    weight = kernels.fragment_layout(packed.qweight.to(device), packed.scales.to(device), packed.zeros.to(device),
                                     128, 2048, 5632, torch.bfloat16)
    x = torch.randn(80, 5632, device=device, dtype=torch.bfloat16)
    first = w4_fragment_batch.w4_fragment_batch(x, weight, ctas=23)
    assert all(torch.equal(first, w4_fragment_batch.w4_fragment_batch(x, weight, ctas=23)) for _ in range(5))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_fused_gate_up_activation_equals_the_product_then_act_and_mul(dtype, activation):
    """The interleaved gate/up layout with the activation in the epilogue gives the bits of the plain product (same
    launch shape and splits) followed by act_and_mul_kernel, at every launch shape, with and without K splits."""
    kernels = _kernels()
    from deepinfer.kernels.act_and_mul import act_and_mul

    inner, in_features = 1000, 2048
    packed = random_w4_weight(2 * inner, in_features, 128, "zero", True, seed=7)
    device = torch.device("cuda")
    qweight, scales, zeros = packed.qweight.to(device), packed.scales.to(device), packed.zeros.to(device)
    plain = kernels.fragment_layout(qweight, scales, zeros, 128, 2 * inner, in_features, dtype)
    fused = kernels.gate_up_layout(qweight, scales, zeros, 128, in_features, dtype)
    generator = torch.Generator(device=device).manual_seed(7)
    bias = torch.randn(2 * inner, device=device, dtype=dtype, generator=generator)
    order = kernels.gate_up_order(inner, device)
    for config in kernels.CONFIGS:
        for splits in (1, 3):
            x = torch.randn(config.tokens + 1, in_features, device=device, dtype=dtype, generator=generator)
            product = kernels.w4_fragment_gemm(x, plain, bias, config=config, splits=splits)
            expected = act_and_mul(product[:, :inner], product[:, inner:], activation)
            out = torch.full((x.shape[0], inner), float("nan"), device=device, dtype=dtype)
            kernels.w4_fragment_gemm_act_and_mul(x, fused, activation, bias[order], config=config, splits=splits,
                                                 out=out)
            assert torch.equal(out, expected), (config, splits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_products_over_the_interleaved_layout_then_interleaved_act_and_mul_give_the_plain_bits(dtype, activation):
    """A merged gate/up weight's one fragment form: the plain products (the 1-32-token kernel at every launch shape,
    with and without K splits; the batch kernel on CTAs that take whole tiles) over the interleaved layout and its
    bias, followed by the interleaved act_and_mul, give the bits of the same products over the plain layout
    followed by act_and_mul on the halves. The batch kernel's planned stream-K runs cut a tile at k blocks that
    depend on the tile's place, which moves with the rows: there its sums may round otherwise, and are held to the
    plain ones within the fp32 summation's error."""
    kernels = _kernels()
    from deepinfer.kernels import w4_fragment_batch
    from deepinfer.kernels.act_and_mul import act_and_mul, act_and_mul_interleaved

    inner, in_features = 1024, 2048
    packed = random_w4_weight(2 * inner, in_features, 128, "zero", True, seed=9)
    device = torch.device("cuda")
    qweight, scales, zeros = packed.qweight.to(device), packed.scales.to(device), packed.zeros.to(device)
    plain = kernels.fragment_layout(qweight, scales, zeros, 128, 2 * inner, in_features, dtype)
    interleaved = kernels.gate_up_layout(qweight, scales, zeros, 128, in_features, dtype)
    generator = torch.Generator(device=device).manual_seed(9)
    bias = torch.randn(2 * inner, device=device, dtype=dtype, generator=generator)
    order = kernels.gate_up_order(inner, device)

    def both(product, x, **launch):
        expected = product(x, plain, bias, **launch)
        expected = act_and_mul(expected[:, :inner], expected[:, inner:], activation)
        out = torch.full((x.shape[0], inner), float("nan"), device=device, dtype=dtype)
        act_and_mul_interleaved(product(x, interleaved, bias[order], **launch), activation, out=out)
        return out, expected

    for config in kernels.CONFIGS:
        for splits in (1, 3):
            x = torch.randn(config.tokens - 3, in_features, device=device, dtype=dtype, generator=generator)
            out, expected = both(kernels.w4_fragment_gemm, x, config=config, splits=splits)
            assert torch.equal(out, expected), (config, splits)
    for tokens in (40, 96, 128):
        x = torch.randn(tokens, in_features, device=device, dtype=dtype, generator=generator)
        config, _ = w4_fragment_batch.plan(tokens, 2 * inner, in_features, 0)
        k_blocks = -(-in_features // config.bk)
        whole_tiles = w4_fragment_batch.iterations(tokens, 2 * inner, in_features, config) // k_blocks  # a CTA a tile
        out, expected = both(w4_fragment_batch.w4_fragment_batch, x, ctas=whole_tiles)
        assert torch.equal(out, expected), tokens
        out, expected = both(w4_fragment_batch.w4_fragment_batch, x)
        assert torch.isfinite(out).all()
        assert float((out.float() - expected.float()).norm() / expected.float().norm()) < 2e-3, tokens
