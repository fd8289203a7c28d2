"""The CUDA kernels against independent references on a real GPU (marker `gpu`).

Skipped cleanly where there is no CUDA device or no CuPy. Every case below names its shapes, dtypes, group size
and the kernel or path it forces; every output is poisoned with NaN (int8 caches with -128) before the launch, so
an element a kernel does not write fails; each comparison states its bound here. References: the fp32/fp64
product of the dequantized weight, the torch references of core/ops (checked on the CPU against HF transformers
and hand formulas, tests/test_ops_dispatch.py), and for the fused kernels the unfused kernels bit for bit. The
random inputs and the poisoning come from deepinfer.validate, which `deepinfer validate-kernels` runs on its own
(wider) case tables.
"""

from __future__ import annotations

import logging

import pytest
import torch

pytestmark = pytest.mark.gpu


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    from deepinfer.kernels import cuda_unavailable_reason, device_unsupported_reason

    return cuda_unavailable_reason() or device_unsupported_reason(torch.cuda.current_device())


_REASON = _skip_reason()
if _REASON is not None:
    pytest.skip(f"GPU kernels need CUDA and CuPy: {_REASON}", allow_module_level=True)

# imported after the skip: CPU runs never load the kernels' launchers
from deepinfer.core.bench.paged_kv import random_paged_kv
from deepinfer.core.ops import dispatch
from deepinfer.core.quant.packing import dequantize
from deepinfer.kernels import quant_matmul as kq
from deepinfer.validate.compare import poisoned
from deepinfer.validate.inputs import random_packed, rope_tables, tc_case_weight, w8_case_weight

DEVICE = torch.device("cuda", torch.cuda.current_device())
FP16, BF16 = torch.float16, torch.bfloat16
# Relative error ||out - ref|| / ||ref|| of one kernel against its fp32 reference: about 8 ulp of the dtype's
# mantissa over a sum of thousands of terms (fp16: 10 bits, bf16: 7 bits).
BOUND = {FP16: 2e-3, BF16: 1e-2}


def assert_close(out: torch.Tensor, ref: torch.Tensor, bound: float) -> None:
    """Every element written (finite) and the relative error within `bound`, computed in float64."""
    out64, ref64 = out.detach().double(), ref.detach().double()
    unwritten = int((~torch.isfinite(out64)).sum())
    assert unwritten == 0, f"{unwritten} non-finite outputs (never written?)"
    rel = float((out64 - ref64).norm()) / max(float(ref64.norm()), 1e-30)
    assert rel <= bound, f"relative error {rel:.3e} > {bound:.1e}"


def fp32_product(x: torch.Tensor, packed) -> torch.Tensor:
    """x @ W.T (+ bias) in fp32 from the reference dequantization, in the weight's original column order."""
    out = x.float() @ dequantize(packed, torch.float32).T
    return out if packed.bias is None else out + packed.bias.float()


# ---- W4/W3 products, each kernel forced ----------------------------------------------------------

# (kernel, tokens, out_features, in_features, group size, tile, fp32 scales)
PACKED_CASES = [
    ("gemv", 1, 4096, 4096, 128, 1, False),
    ("gemv", 3, 1536, 576, 32, 4, False),  # K = 576: not whole 128-code segments
    ("gemv", 2, 1000, 4096, 4096, 2, True),  # per-channel scales; N not a multiple of 8 rows
    ("stream", 1, 4096, 4096, 128, 1, False),
    ("stream", 1, 1000, 11008, 128, 1, False),
    ("stream", 3, 1536, 576, 32, 4, False),
    ("ksplit", 1, 4096, 4096, 128, 1, False),
    ("ksplit", 9, 1000, 4096, 128, 2, False),
    ("ksplit", 16, 1000, 11008, 128, 2, True),
    ("ksplit", 29, 1536, 576, 32, 2, False),
    ("staged", 64, 4096, 4096, 128, 8, False),
    ("staged", 33, 1000, 11008, 32, 8, False),
    ("staged", 5, 1536, 576, 64, 1, True),
    ("staged", 24, 4096, 14336, 128, 4, False),
]


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("bits,zero_mode", [(4, "zero"), (3, "min"), (4, "min"), (3, "zero")])
@pytest.mark.parametrize("kernel,tokens,out_features,in_features,group_size,tile,f32_scales", PACKED_CASES)
def test_packed_kernels_match_the_fp32_product(kernel, tokens, out_features, in_features, group_size, tile,
                                               f32_scales, bits, zero_mode, dtype):
    packed = random_packed(out_features, in_features, group_size, bits, zero_mode,
                           torch.float32 if f32_scales else FP16, DEVICE, bias_dtype=dtype)
    x = torch.randn(tokens, in_features, dtype=dtype, device=DEVICE)
    out = poisoned((tokens, out_features), dtype, DEVICE)
    kq.quant_matmul(x, packed.qweight, packed.scales, packed.zeros, bits, group_size, zero_mode, packed.bias,
                    kernel=kernel, tile=tile, out=out)
    assert_close(out, fp32_product(x, packed), BOUND[dtype])


# The tc and tcs kernels (W4 only): (kernel, tokens, out_features, in_features, group size, tile, zero points,
# fp32 scales). Zero points "int" (whole: group sums scaled once when G % 128 == 0), "frac" or "min" (weights
# dequantized before the product).
TC_CASES = [
    ("tc", 1, 2560, 2048, 128, 1, "int", False),
    ("tc", 1, 2048, 11008, 128, 1, "int", False),
    ("tc", 1, 2048, 2048, 128, 1, "frac", False),
    ("tc", 1, 2048, 2048, 128, 1, "min", True),
    ("tc", 3, 1024, 4096, 32, 1, "int", False),  # G = 32: weights dequantized first
    ("tc", 4, 512, 11008, 11008, 1, "int", False),  # per-channel
    ("tc", 1, 16, 128, 128, 1, "int", False),  # one tile, one segment
    ("tc", 12, 2560, 2048, 128, 2, "int", False),
    ("tc", 32, 22016, 2048, 128, 4, "int", False),
    ("tc", 40, 2048, 2048, 128, 4, "int", False),  # two token tiles along grid.y
    ("tcs", 1, 22016, 2048, 128, 1, "int", False),  # up to 8 tokens on few row tiles: two K-splits
    ("tcs", 9, 2560, 2048, 128, 2, "int", False),
    ("tcs", 16, 22016, 2048, 128, 2, "int", False),
    ("tcs", 32, 992, 4096, 32, 4, "frac", False),  # N not a multiple of 128: idle warps
    ("tcs", 20, 512, 1024, 64, 4, "min", False),
    ("tcs", 12, 512, 11008, 11008, 2, "int", True),  # per-channel
]


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("kernel,tokens,out_features,in_features,group_size,tile,zeros,f32_scales", TC_CASES)
def test_tensor_core_w4_kernels_match_the_fp32_product(kernel, tokens, out_features, in_features, group_size, tile,
                                                       zeros, f32_scales, dtype):
    packed = tc_case_weight(out_features, in_features, group_size, zeros, f32_scales, dtype, DEVICE)
    x = torch.randn(tokens, in_features, dtype=dtype, device=DEVICE)
    out = poisoned((tokens, out_features), dtype, DEVICE)
    kq.quant_matmul(x, packed.qweight, packed.scales, packed.zeros, 4, group_size, packed.zero_mode, packed.bias,
                    kernel=kernel, tile=tile, out=out, integer_zeros=packed.integer_zeros)
    assert_close(out, fp32_product(x, packed), BOUND[dtype])


# The W8 kernel: (tokens, out_features, in_features, group size, zero points, fp32 scales). Zero points "q8_0" (128,
# GGUF Q8_0 as re-packed), "int", "frac" or "min" (validate/inputs.py w8_case_weight).
W8_CASES = [
    (1, 2048, 2048, 32, "q8_0", False),
    (3, 1000, 4096, 32, "q8_0", False),  # N not a multiple of the 16 rows a CTA takes
    (16, 1536, 576, 64, "frac", False),  # K = 576: not whole 64-code segments of the 8 warps
    (32, 2048, 2048, 128, "min", True),
    (64, 2560, 2048, 128, "int", False),
    (100, 2048, 2048, 32, "q8_0", False),  # two 64-token CTA columns
]


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("tokens,out_features,in_features,group_size,zeros,f32_scales", W8_CASES)
def test_w8_kernel_matches_the_fp32_product(tokens, out_features, in_features, group_size, zeros, f32_scales, dtype):
    from deepinfer.kernels.w8_gemm import w8_gemm

    packed = w8_case_weight(out_features, in_features, group_size, zeros, f32_scales, dtype, DEVICE)
    x = torch.randn(tokens, in_features, dtype=dtype, device=DEVICE)
    out = poisoned((tokens, out_features), dtype, DEVICE)
    w8_gemm(x, packed.qweight, packed.scales, packed.zeros, group_size, packed.zero_mode, packed.integer_zeros,
            packed.bias, out=out)
    assert_close(out, fp32_product(x, packed), BOUND[dtype])


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("tokens,in_features,out_features,path", [
    (5, 1024, 640, "tc"), (40, 1024, 640, "dense"), (40, 2048, 2560, "w4_gemm")])
def test_the_product_op_gathers_act_order_columns_on_its_table_row(tokens, in_features, out_features, path, dtype):
    """Through core/ops with an act-order (desc_act) weight: the activations are permuted before the kernel, on
    the row the table picks for the token count (a packed-weight kernel, the W4 GEMM, or dequantize + cuBLAS)."""
    from deepinfer.core.ops.quant_matmul import quant_matmul
    from deepinfer.core.ops.quant_matmul_table import ProductShape, product_row

    assert product_row(ProductShape(tokens, in_features, out_features, 4, 128)).kernel == path
    packed = random_packed(out_features, in_features, 128, 4, "zero", FP16, DEVICE, act_order=True, bias_dtype=dtype)
    x = torch.randn(tokens, in_features, dtype=dtype, device=DEVICE)
    with torch.no_grad():
        assert_close(quant_matmul(x, packed), fp32_product(x, packed), BOUND[dtype])


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("bits,zero_mode,scale_dtype,group_size", [
    (4, "zero", FP16, 128), (3, "zero", FP16, 128), (4, "min", torch.float32, 32), (3, "min", torch.float32, 32),
    (4, "zero", FP16, 2048), (8, "zero", FP16, 32), (8, "min", torch.float32, 128)])  # per-channel; 8-bit
def test_dequantize_kernel_is_bit_identical_to_the_reference(bits, zero_mode, scale_dtype, group_size, dtype):
    from deepinfer.kernels.dequantize import dequantize as dequantize_kernel

    packed = random_packed(1000, 2048, group_size, bits, zero_mode, scale_dtype, DEVICE)
    out = poisoned((1000, 2048), dtype, DEVICE)
    dequantize_kernel(packed.qweight, packed.scales, packed.zeros, bits, group_size, zero_mode, dtype, out=out)
    assert torch.equal(out, dequantize(packed, dtype))


# ---- the fused epilogues: the unfused kernels' bits ------------------------------------------------

# (tokens, q heads, KV heads, head_dim, in_features, group size, zero points, bias)
QKV_ROPE_CASES = [
    (1, 16, 2, 128, 2048, 128, "int", True),  # Qwen2.5-3B
    (8, 16, 2, 128, 2048, 128, "int", True),
    (3, 32, 8, 128, 4096, 128, "int", False),  # Llama-3-8B
    (5, 8, 4, 64, 1024, 64, "min", False),
    (2, 12, 4, 256, 2048, 128, "frac", True),
]


@pytest.mark.parametrize("storage", ["same-dtype", "int8", "fp8"])
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim,in_features,group_size,zeros,bias", QKV_ROPE_CASES)
def test_qkv_product_with_rope_and_cache_write_equals_the_unfused_kernels(tokens, heads, kv_heads, head_dim,
                                                                          in_features, group_size, zeros, bias,
                                                                          dtype, storage):
    """quant_matmul_rope_cache against the tc product followed by rope_cache_kernel: the rotated q and k, the v
    columns and every cache row the same bits, an int8 cache's scales too (no other row written; a padding slot -1
    writes nothing)."""
    from deepinfer.kernels.rope_cache import rope_and_cache_write
    from deepinfer.validate.quant_matmul_checks import qkv_rope_caches, same_bits

    n = (heads + 2 * kv_heads) * head_dim
    packed = tc_case_weight(n, in_features, group_size, zeros, False, dtype if bias else None, DEVICE)
    x = torch.randn(tokens, in_features, dtype=dtype, device=DEVICE)
    cos, sin = rope_tables(tokens, head_dim, dtype, DEVICE)
    caches, scales = qkv_rope_caches(storage, (24, kv_heads, 16, head_dim), dtype, DEVICE)
    slots = torch.randperm(24 * 16, device=DEVICE)[:tokens]
    if tokens > 2:
        slots[tokens // 2] = -1
    weight = (packed.qweight, packed.scales, packed.zeros)
    qkv = kq.quant_matmul(x, *weight, 4, group_size, packed.zero_mode, packed.bias, kernel="tc", tile=1,
                          integer_zeros=packed.integer_zeros)
    q, k, v = (part.reshape(tokens, -1, head_dim) for part in qkv.split(
        (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1))
    if storage == "fp8":  # about each head's amax / 448, some codes saturated
        scales[0].copy_(k.float().abs().amax(dim=(0, 2)) / 300)
        scales[1].copy_(v.float().abs().amax(dim=(0, 2)) / 600)
    fused = kq.quant_matmul_rope_cache(x, *weight, packed.bias, group_size, packed.zero_mode, packed.integer_zeros,
                                       heads, kv_heads, head_dim, cos, sin, caches[0], caches[1], slots, scales[0],
                                       scales[1])
    unfused_q, unfused_k = rope_and_cache_write(q, k, v, cos, sin, caches[2], caches[3], slots, scales[2], scales[3])
    pairs = list(zip((*fused, caches[0], caches[1]), (unfused_q, unfused_k, v, caches[2], caches[3])))
    if storage == "int8":
        pairs += [(scales[0], scales[2]), (scales[1], scales[3])]
    for got, want in pairs:
        assert same_bits(got, want)


# (tokens, inner I, in_features, group size, zero points, fp32 scales, bias, activation); the weight is [2I, K]
GATE_UP_CASES = [
    (1, 11008, 2048, 128, "int", False, False, "silu"),  # Qwen2.5-3B at one token: two K-splits
    (8, 11008, 2048, 128, "int", False, True, "silu"),
    (12, 11008, 2048, 128, "int", False, False, "silu"),  # two token tiles a CTA
    (32, 11008, 2048, 128, "frac", True, False, "gelu_tanh"),  # four token tiles, one split
    (2, 14336, 4096, 128, "int", False, False, "silu"),  # Llama-3-8B
    (5, 1504, 512, 64, "min", False, True, "gelu_tanh"),  # I not a multiple of 64: idle warps in the last CTA
]


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("tokens,inner,in_features,group_size,zeros,f32_scales,bias,activation", GATE_UP_CASES)
def test_gate_up_product_with_the_activation_equals_the_unfused_kernels(tokens, inner, in_features, group_size,
                                                                        zeros, f32_scales, bias, activation, dtype):
    """quant_matmul_act_and_mul, with K splits meeting in a cluster (SM90+) and through global memory, against the
    tcs product followed by act_and_mul_kernel: the same bits."""
    from deepinfer.kernels.act_and_mul import act_and_mul

    packed = tc_case_weight(2 * inner, in_features, group_size, zeros, f32_scales, dtype if bias else None, DEVICE)
    x = torch.randn(tokens, in_features, dtype=dtype, device=DEVICE)
    weight = (packed.qweight, packed.scales, packed.zeros)
    args = (packed.bias, group_size, packed.zero_mode, packed.integer_zeros, activation)
    gate_up = kq.quant_matmul(x, *weight, 4, group_size, packed.zero_mode, packed.bias, kernel="tcs",
                              integer_zeros=packed.integer_zeros)
    want = act_and_mul(gate_up[:, :inner], gate_up[:, inner:], activation)
    for cluster_splits in (None, False):
        got = kq.quant_matmul_act_and_mul(x, *weight, *args, cluster_splits=cluster_splits)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), cluster_splits


# ---- paged attention, each path forced ------------------------------------------------------------

# (dtype, int8 KV, heads, KV heads, head_dim, block size, context lengths, window, softcap, bound)
DECODE_CASES = [
    (FP16, False, 32, 8, 128, 16, (1, 17, 300, 5000), None, None, None),  # past 1024: split only
    (BF16, False, 32, 8, 128, 16, (1, 17, 300, 5000), 256, 50.0, None),
    (FP16, True, 9, 3, 64, 16, (5, 700, 2049), None, None, None),
    (BF16, True, 16, 2, 256, 32, (3, 129, 1500), 100, 50.0, None),
    (FP16, False, 16, 2, 128, 16, (1, 15, 16, 17, 300, 1024), None, None, None),  # GQA 8, every path
    (BF16, True, 16, 2, 128, 16, (1, 15, 16, 17, 300, 1024), None, None, None),
    (FP16, False, 8, 8, 64, 8, (1, 15, 16, 17, 300), None, None, 1024),  # GQA 1, a graph's bound
    (FP16, True, 9, 3, 64, 128, (5, 700, 1000), 256, None, None),  # window from mid-tile
    (FP16, False, 40, 2, 128, 8, (33, 1000), None, None, None),  # GQA 20: a partial head tile
    (BF16, False, 32, 1, 128, 64, (1, 300, 999), 64, None, 1024),  # GQA 32: two head tiles
    (BF16, False, 4, 4, 96, 64, (65, 129), None, None, None),
]


def _decode_paths(bound: int) -> list[str]:
    from deepinfer.core.ops.paged_attention_table import COMBINED_MAX_SEQ_LEN
    from deepinfer.kernels.launch import clusters_available

    if bound > COMBINED_MAX_SEQ_LEN:
        return ["split", "combined_split"]
    return ["split", "combined_split", "combined"] + (["clustered"] if clusters_available(DEVICE.index) else [])


@pytest.mark.parametrize("pipelined", [True, False], ids=["ahead", "in-step"])
@pytest.mark.parametrize("dtype,int8,heads,kv_heads,head_dim,block_size,lengths,window,softcap,bound", DECODE_CASES)
def test_paged_decode_attention_matches_the_reference_on_every_path(dtype, int8, heads, kv_heads, head_dim,
                                                                    block_size, lengths, window, softcap, bound,
                                                                    pipelined):
    from deepinfer.core.ops.paged_attention import paged_decode_attention_reference
    from deepinfer.kernels.paged_attention import paged_decode_attention

    bound = bound or max(lengths)
    k_cache, v_cache, k_scales, v_scales, tables = random_paged_kv(lengths, kv_heads, head_dim, block_size, dtype,
                                                                   int8, DEVICE, table_blocks=-(-bound // block_size))
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    query = torch.randn(len(lengths), heads, head_dim, dtype=dtype, device=DEVICE)
    ref = paged_decode_attention_reference(query.float(), k_cache, v_cache, tables, seq_lens, head_dim**-0.5, window,
                                           softcap, k_scales, v_scales, max(lengths))
    for path in _decode_paths(bound):
        out = poisoned(query.shape, dtype, DEVICE)
        paged_decode_attention(query, k_cache, v_cache, tables, seq_lens, bound, head_dim**-0.5, window, softcap,
                               k_scales, v_scales, out=out, path=path, pipelined=pipelined)
        assert_close(out, ref, BOUND[dtype])


# (dtype, KV storage (False: the dtype, True: int8, "fp8": e4m3), heads, KV heads, head_dim, block size, chunks
# (first position, tokens), window, softcap)
PREFILL_CASES = [
    (BF16, False, 16, 2, 128, 16, ((0, 256), (0, 37), (100, 300)), None, None),  # Qwen2.5-3B: G = 8
    (FP16, False, 28, 4, 128, 16, ((0, 100), (1000, 64)), None, None),  # G = 7: 14 rows a warp
    (FP16, False, 9, 3, 64, 16, ((0, 90), (5, 3)), None, None),  # D = 64
    (BF16, False, 32, 32, 128, 32, ((0, 200), (7, 1)), None, None),  # MHA: 128 tokens a tile; a one-token tile
    (FP16, False, 8, 4, 64, 8, ((0, 50), (3, 20)), 32, 50.0),  # Gemma 2: window, softcap, 8-token blocks
    (FP16, False, 16, 2, 128, 16, ((2000, 2048),), None, None),  # a 2048-token chunk after 2000 cached tokens
    (BF16, False, 16, 2, 128, 16, ((3000, 16), (40, 3)), None, None),  # few tiles over long contexts: key splits
    (FP16, False, 32, 8, 128, 16, ((1500, 40),), 700, None),  # splits before the window are empty
    # int8 and e4m3 caches: codes staged, each converted once a CTA into the 16-bit tile the warps read
    (BF16, True, 16, 2, 128, 16, ((0, 256), (0, 37), (100, 301)), None, None),
    (FP16, "fp8", 16, 2, 128, 16, ((0, 256), (0, 37), (100, 301)), None, None),
    (FP16, True, 9, 3, 64, 8, ((0, 91), (5, 3)), 33, 50.0),  # D = 64: 8-byte staging copies
    (BF16, "fp8", 9, 3, 64, 128, ((0, 91), (129, 77)), None, 30.0),
    (BF16, True, 32, 8, 128, 64, ((1500, 41),), 700, 50.0),  # key splits
    (FP16, "fp8", 16, 2, 128, 32, ((3000, 17), (40, 3)), None, None),
]


@pytest.mark.parametrize("dtype,kv,heads,kv_heads,head_dim,block_size,chunks,window,softcap", PREFILL_CASES)
def test_paged_prefill_attention_matches_the_reference_and_writes_only_its_tiles(dtype, kv, heads, kv_heads, head_dim,
                                                                                 block_size, chunks, window, softcap):
    from deepinfer.core.ops.paged_attention import paged_prefill_attention_reference
    from deepinfer.kernels.paged_attention import paged_prefill_attention, prefill_tile_tokens

    lengths = [start + n for start, n in chunks]
    k_cache, v_cache, k_scales, v_scales, tables = random_paged_kv(lengths, kv_heads, head_dim, block_size, dtype,
                                                                   kv is True, DEVICE, fp8=kv == "fp8")
    tile_tokens = prefill_tile_tokens(heads, kv_heads)
    rows_seq, rows_len, tiles = [0], [lengths[0]], []  # row 0: a decode of sequence 0 that no tile covers
    for seq, (start, n) in enumerate(chunks):
        first = len(rows_seq)
        rows_seq += [seq] * n
        rows_len += list(range(start + 1, start + n + 1))
        tiles += [(first + k, min(tile_tokens, n - k)) for k in range(0, n, tile_tokens)]
    tiles += [(0, 0)] * 3  # unused entries
    token_tables = tables[torch.tensor(rows_seq, device=DEVICE)]
    seq_lens = torch.tensor(rows_len, dtype=torch.int32, device=DEVICE)
    tile_table = torch.tensor(tiles, dtype=torch.int32, device=DEVICE)
    query = torch.randn(len(rows_seq), heads, head_dim, dtype=dtype, device=DEVICE)
    out = poisoned(query.shape, dtype, DEVICE)
    bound = next(b for b in (1024, 4096, 16384) if b >= max(lengths))  # as a CUDA graph's context bound
    paged_prefill_attention(query, k_cache, v_cache, token_tables, seq_lens, tile_table, bound, head_dim**-0.5,
                            window, softcap, k_scales, v_scales, out=out)
    ref = paged_prefill_attention_reference(query.float(), k_cache, v_cache, token_tables, seq_lens, tile_table,
                                            head_dim**-0.5, window, softcap, k_scales, v_scales)
    assert torch.isnan(out[0]).all(), "wrote a row outside the tiles"
    assert_close(out[1:], ref[1:], BOUND[dtype])


# ---- the small kernels ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("rows,hidden", [(5, 576), (64, 4096), (3, 5120)])
@pytest.mark.parametrize("residual,offset", [(False, 0.0), (True, 0.0), (True, 1.0)])
def test_rms_norm_kernel_matches_the_reference_and_sums_the_residual_exactly(rows, hidden, residual, offset, dtype):
    from deepinfer.core.ops.norm import rms_norm_reference
    from deepinfer.kernels.rms_norm import rms_norm

    x = torch.randn(rows, hidden, dtype=dtype, device=DEVICE) * 3
    res = torch.randn_like(x) if residual else None
    weight = torch.randn(hidden, dtype=dtype, device=DEVICE) * 0.5 + (0.0 if offset else 1.0)
    out, summed = rms_norm(x, weight, 1e-6, offset, res, out=poisoned(x.shape, dtype, DEVICE),
                           residual_out=poisoned(x.shape, dtype, DEVICE))
    ref, ref_sum = rms_norm_reference(x, weight, 1e-6, offset, res)
    assert_close(out, ref, BOUND[dtype])
    if residual:
        assert torch.equal(summed, ref_sum)


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows,inner,merged", [(5, 1536, False), (64, 11008, True)])
def test_act_and_mul_kernel_matches_the_reference(rows, inner, merged, activation, dtype):
    from deepinfer.core.ops.activation import act_and_mul_reference
    from deepinfer.kernels.act_and_mul import act_and_mul

    if merged:  # the two halves of one [T, 2I] product: row strides of 2I
        gate_up = torch.randn(rows, 2 * inner, dtype=dtype, device=DEVICE) * 3
        gate, up = gate_up[:, :inner], gate_up[:, inner:]
    else:
        gate, up = torch.randn(rows, inner, dtype=dtype, device=DEVICE) * 3, torch.randn(rows, inner, dtype=dtype,
                                                                                       device=DEVICE)
    out = act_and_mul(gate, up, activation, out=poisoned((rows, inner), dtype, DEVICE))
    assert_close(out, act_and_mul_reference(gate, up, activation), BOUND[dtype])


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("int8", [False, True], ids=["same-dtype", "int8"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,rope", [(32, 8, 128, True), (9, 3, 64, True), (8, 4, 256, True),
                                                          (32, 8, 128, False)])
def test_rope_and_cache_write_kernel_writes_exactly_the_slots_of_the_reference(heads, kv_heads, head_dim, rope, int8,
                                                                               dtype):
    from deepinfer.core.ops.rotary import apply_rotary_reference, write_kv_cache_reference
    from deepinfer.kernels.rope_cache import rope_and_cache_write

    tokens, shape = 11, (20, kv_heads, 16, head_dim)
    query = torch.randn(tokens, heads, head_dim, dtype=dtype, device=DEVICE)
    key, value = (torch.randn(tokens, kv_heads, head_dim, dtype=dtype, device=DEVICE) for _ in range(2))
    cos, sin = rope_tables(tokens, head_dim, dtype, DEVICE)
    slots = torch.randperm(20 * 16, device=DEVICE)[:tokens]
    if int8:
        caches = [torch.full(shape, -128, dtype=torch.int8, device=DEVICE) for _ in range(4)]
        scales = [poisoned(shape[:3], FP16, DEVICE) for _ in range(4)]
    else:
        caches, scales = [poisoned(shape, dtype, DEVICE) for _ in range(4)], [None] * 4
    q_out, k_out = poisoned(query.shape, dtype, DEVICE), poisoned(key.shape, dtype, DEVICE)
    rope_and_cache_write(query if rope else None, key, value, cos if rope else None, sin if rope else None,
                         caches[0], caches[1], slots, scales[0], scales[1], query_out=q_out, key_out=k_out)
    ref_q, ref_k = (apply_rotary_reference(query, cos, sin), apply_rotary_reference(key, cos, sin)) if rope else (
        query, key)
    write_kv_cache_reference(ref_k, value, caches[2], caches[3], slots, scales[2], scales[3])
    if rope:
        assert_close(q_out, ref_q, BOUND[dtype])
        assert_close(k_out, ref_k, BOUND[dtype])
    blocks, offsets = slots // 16, slots % 16
    for got, want, got_scale, want_scale in ((caches[0], caches[2], scales[0], scales[2]),
                                             (caches[1], caches[3], scales[1], scales[3])):
        got_rows, want_rows = got[blocks, :, offsets].float(), want[blocks, :, offsets].float()
        if int8:  # compared dequantized
            got_rows = got_rows * got_scale[blocks, :, offsets].float().unsqueeze(-1)
            want_rows = want_rows * want_scale[blocks, :, offsets].float().unsqueeze(-1)
        assert_close(got_rows, want_rows, BOUND[dtype])
        untouched = got.clone()
        untouched[blocks, :, offsets] = want[blocks, :, offsets]
        assert torch.equal(untouched.view(torch.uint8), want.view(torch.uint8)), "slots outside slot_mapping written"


# ---- the ops together -------------------------------------------------------------------------------

def test_kernels_capture_and_replay_in_a_cuda_graph_bit_for_bit():
    """A W4 product, the norm after it, and decode attention for 4 sequences (the split or clustered path) and 16
    (combined), through core/ops, captured once; a replay on new inputs written into the captured buffers equals
    an eager run of the same inputs bit for bit."""
    from deepinfer.core.ops.norm import rms_norm
    from deepinfer.core.ops.paged_attention import paged_decode_attention
    from deepinfer.core.ops.quant_matmul import quant_matmul

    packed = random_packed(4096, 4096, 128, 4, "zero", FP16, DEVICE)
    norm_weight = torch.randn(4096, dtype=FP16, device=DEVICE)
    x = torch.randn(4, 4096, dtype=FP16, device=DEVICE)
    batches = []
    for lengths in ((1000, 517, 64, 1024), (1000, 517, 64, 1024, 1, 300, 17, 999) * 2):
        k_cache, v_cache, _, _, tables = random_paged_kv(lengths, 8, 128, 16, FP16, False, DEVICE)
        query = torch.randn(len(lengths), 32, 128, dtype=FP16, device=DEVICE)
        batches.append((query, k_cache, v_cache, tables, torch.tensor(lengths, dtype=torch.int32, device=DEVICE)))

    def step() -> list[torch.Tensor]:
        outs = [rms_norm(quant_matmul(x, packed), norm_weight, 1e-6)[0]]
        return outs + [paged_decode_attention(*batch, 128**-0.5, max_seq_len=1024) for batch in batches]

    with torch.no_grad():
        side = torch.cuda.Stream(DEVICE)
        side.wait_stream(torch.cuda.current_stream(DEVICE))
        with torch.cuda.stream(side):
            step()  # compile, load and allocate everything outside the capture
        torch.cuda.current_stream(DEVICE).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        for tensor in (x, batches[0][0], batches[1][0]):
            tensor.copy_(torch.randn_like(tensor))
        graph.replay()
        torch.cuda.synchronize(DEVICE)
        eager = step()
    for got, want in zip(captured, eager):
        assert torch.isfinite(got).all() and torch.equal(got, want)


@pytest.mark.parametrize("dtype,bits,kv_quantization,bound", [(FP16, 4, None, 5e-3), (BF16, 3, "int8", 3e-2),
                                                              (FP16, 4, "fp8", 3e-2)])
def test_tiny_model_native_logits_match_the_reference_path(dtype, bits, kv_quantization, bound):
    """A 2-layer SmolLM2-shaped Llama (K = 576: not whole 128-code segments) quantized RTN G64, over prefill, mixed
    and decode steps: native kernels against every op forced onto torch (the W3 / int8-KV model's bound is wider:
    3-bit weights and int8 caches round more)."""
    from deepinfer.core.attention.native_backend import NativePagedAttention
    from deepinfer.core.attention.torch_backend import TorchPagedAttention
    from deepinfer.validate.model_check import VOCAB, build_tiny_llama, forced_reference, run_steps

    model = build_tiny_llama(dtype, DEVICE, bits, 64)
    generator = torch.Generator().manual_seed(1)
    tokens = {name: torch.randint(0, VOCAB, (48,), generator=generator).to(DEVICE) for name in "abc"}
    with forced_reference(True):
        model.attention_backend = TorchPagedAttention()
        reference = run_steps(model, DEVICE, kv_quantization, tokens)
    with forced_reference(False):
        model.attention_backend = NativePagedAttention()
        native = run_steps(model, DEVICE, kv_quantization, tokens)
    assert_close(native, reference, bound)


def test_dispatch_takes_the_kernel_on_gpu(caplog, monkeypatch):
    from deepinfer.core.ops.norm import rms_norm

    monkeypatch.delenv(dispatch.FORCE_REFERENCE_ENV, raising=False)
    dispatch.reset_log()
    caplog.set_level(logging.INFO, logger="deepinfer.ops")
    x = torch.randn(4, 64, dtype=FP16, device=DEVICE)
    rms_norm(x, torch.ones(64, dtype=FP16, device=DEVICE), 1e-6)
    rms_norm(x.float(), torch.ones(64, device=DEVICE), 1e-6)  # fp32: no kernel
    messages = [r.getMessage() for r in caplog.records if r.name == "deepinfer.ops"]
    assert messages == ["rms_norm: CUDA kernel",
                        "rms_norm: torch reference (dtype torch.float32 (kernel takes float16/bfloat16))"]
    assert dispatch.kernel_summary(DEVICE)["ops"]["rms_norm"] == (
        "kernel, reference (dtype torch.float32 (kernel takes float16/bfloat16))")


@pytest.mark.parametrize("dtype,kv_quantization", [(FP16, None), (BF16, "int8"), (FP16, "fp8")])
def test_native_backend_behind_the_fused_rope_write_matches_torch_backend(dtype, kv_quantization, caplog, monkeypatch):
    """The decoder rotates q/k and writes K/V with the rope_cache_write kernel, then calls the backend with
    kv_written=True: the native backend (paged decode kernel) and the torch backend (SDPA over the same
    cache) must give the same logits over prefill, mixed and decode steps, and neither writes K/V again."""
    from deepinfer.core.attention.native_backend import NativePagedAttention
    from deepinfer.core.attention.torch_backend import TorchPagedAttention
    from deepinfer.core.engine.worker.step_inputs import SequenceChunk, build_attention_metadata
    from deepinfer.core.kv.cache import KVCache
    from deepinfer.validate.model_check import BLOCK_SIZE, VOCAB, build_tiny_llama

    monkeypatch.delenv(dispatch.FORCE_REFERENCE_ENV, raising=False)
    dispatch.reset_log()
    caplog.set_level(logging.INFO, logger="deepinfer.ops")
    model = build_tiny_llama(dtype, DEVICE, 4, 64)
    tokens = torch.randint(0, VOCAB, (3, 48), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    tables = ([3, 7, 1, 12], [5, 0], [9])
    steps = (((0, 0, 37), (1, 0, 20)), ((0, 37, 1), (1, 20, 1), (2, 0, 9)), ((0, 38, 1), (1, 21, 1), (2, 9, 1)))

    def backend_write(*args, **kwargs):
        raise AssertionError("a backend wrote K/V that the decoder had already written")

    monkeypatch.setattr(KVCache, "write", backend_write)
    logits = {}
    for backend in (TorchPagedAttention(), NativePagedAttention()):
        model.attention_backend = backend
        spec = model.spec
        cache = KVCache(spec.num_layers, 24, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, dtype, DEVICE,
                        quantized=kv_quantization)
        rows = []
        with torch.no_grad():
            for step in steps:
                chunks = [SequenceChunk(tables[i], start, count) for i, start, count in step]
                metadata, positions = build_attention_metadata(chunks, BLOCK_SIZE, DEVICE)
                input_ids = torch.cat([tokens[i, start:start + count] for i, start, count in step])
                hidden = model(input_ids, positions, metadata, cache)
                rows.append(model.compute_logits(hidden[metadata.query_start_loc[1:].long() - 1]))
        logits[backend.name] = torch.cat(rows)
    messages = [r.getMessage() for r in caplog.records if r.name == "deepinfer.ops"]
    assert "rope_cache_write: CUDA kernel" in messages and "paged_decode_attention: CUDA kernel" in messages
    assert_close(logits["native"], logits["torch"], 2e-2 if kv_quantization else 5e-3)


@pytest.mark.parametrize("kv_quantization", [None, "int8", "fp8"])
def test_merged_w4_projections_with_fused_epilogues_equal_the_unfused_kernels(caplog, monkeypatch, kv_quantization):
    """A model whose merged q/k/v projection (K % 128 == 0, head_dim 128) and merged gate/up projection (2I >= 3K)
    the fused kernels serve: logits and KV caches (codes and scales of an int8 / e4m3 cache) must be the same bits as
    with the products and rope_cache_write / act_and_mul run one after the other, over prefill, mixed and decode
    steps (the q/k/v fusion takes the steps of at most 8 tokens, the gate/up one those of at most 32)."""
    from deepinfer.core.attention.native_backend import NativePagedAttention
    from deepinfer.core.engine.worker.step_inputs import SequenceChunk, build_attention_metadata
    from deepinfer.core.kv.cache import KVCache
    from deepinfer.core.models import layers
    from deepinfer.core.models.merged_projections import merge_projections
    from deepinfer.validate.model_check import BLOCK_SIZE, STEPS, VOCAB, build_tiny_llama

    monkeypatch.delenv(dispatch.FORCE_REFERENCE_ENV, raising=False)
    dispatch.reset_log()
    caplog.set_level(logging.INFO, logger="deepinfer.ops")
    model = build_tiny_llama(BF16, DEVICE, 4, 128, hidden_size=1024, intermediate_size=2048,
                             num_attention_heads=8, num_key_value_heads=2, head_dim=128)
    merge_projections(model)
    model.attention_backend = NativePagedAttention()
    generator = torch.Generator().manual_seed(3)
    tokens = {name: torch.randint(0, VOCAB, (48,), generator=generator).to(DEVICE) for name in "abc"}
    tables = {"a": [3, 7, 1, 12], "b": [5, 0], "c": [9]}
    fused_ops = {name: getattr(layers, name) for name in ("qkv_rotary_and_cache_write", "gate_up_act_and_mul")}
    runs = {}
    for fused in (True, False):
        for name, op in fused_ops.items():
            monkeypatch.setattr(layers, name, op if fused else lambda *a, **k: None)
        spec = model.spec
        cache = KVCache(spec.num_layers, 24, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, BF16, DEVICE,
                        quantized=kv_quantization)
        if kv_quantization == "fp8":  # scales of the order of the heads' amax / 448
            for scales in (*cache.key_scales, *cache.value_scales):
                scales.copy_(torch.tensor([0.01, 0.03], device=DEVICE))
        rows = []
        with torch.no_grad():
            for step in STEPS:
                chunks = [SequenceChunk(tables[name], start, count) for name, start, count in step]
                metadata, positions = build_attention_metadata(chunks, BLOCK_SIZE, DEVICE)
                input_ids = torch.cat([tokens[name][start:start + count] for name, start, count in step])
                hidden = model(input_ids, positions, metadata, cache)
                rows.append(model.compute_logits(hidden[metadata.query_start_loc[1:].long() - 1]))
        runs[fused] = (torch.cat(rows), cache)
    messages = [r.getMessage() for r in caplog.records if r.name == "deepinfer.ops"]
    assert "quant_matmul_rope_cache: CUDA kernel" in messages and "quant_matmul_act_and_mul: CUDA kernel" in messages
    assert torch.equal(runs[True][0], runs[False][0])
    for layer in range(model.spec.num_layers):
        for pools in ("key_caches", "value_caches"):  # as bytes: equal() takes every storage dtype so
            assert torch.equal(getattr(runs[True][1], pools)[layer].view(torch.uint8),
                               getattr(runs[False][1], pools)[layer].view(torch.uint8))
        if kv_quantization == "int8":
            assert torch.equal(runs[True][1].key_scales[layer], runs[False][1].key_scales[layer])
            assert torch.equal(runs[True][1].value_scales[layer], runs[False][1].value_scales[layer])
