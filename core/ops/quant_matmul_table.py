"""Which kernel serves a W4A16/W3A16/W8A16 product: one table, the first row that serves a shape wins.

A product is described by its ProductShape (tokens M, in_features K, out_features N, bits, group size); each row
names a kernel, the shapes it serves, its launcher and the measurement that put it there (docs/KERNELS.md has the
table with its numbers). The two fused epilogues serve exactly where the plain product's row is the kernel they
extend: the q/k/v product with RoPE and the KV-cache write on the tc row (up to one token tile), the gate/up
product with the gated activation on the tcs row. A new kernel is one more row (with its launcher) placed before
the rows it beats; the CPU test tests/test_dispatch_choices.py records which row serves what.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import cache
from typing import NamedTuple

import torch
import torch.nn.functional as F

from deepinfer.core.ops import dispatch
from deepinfer.core.quant.packed import PackedWeight
from deepinfer.kernels import dequantize as kernels_dequantize
from deepinfer.kernels import quant_matmul as kernels
from deepinfer.kernels import w4_fragment_batch as kernels_batch
from deepinfer.kernels import w4_fragment_gemm as kernels_fragment
from deepinfer.kernels import w4_gemm as kernels_gemm
from deepinfer.kernels import w8_gemm as kernels_w8

KERNEL_MAX_TOKENS = 32  # the packed-weight kernels serve up to this many tokens on any shape
WIDE_KERNEL_MAX_TOKENS = 64  # ... and up to this many where the product is wide (out_features >= 3 x in_features)
TC_MAX_TOKENS = 32  # tc and tcs: four 8-token tiles a CTA
TC_FEW_TOKENS = 8  # tc at any K up to here; beyond it only on long K
LONG_K = 4096  # in_features from which tc (any token count it serves) and stream (one token) win
GEMM_LARGE_TOKENS = (17, 64)  # the W4 GEMM's token range on products larger than GEMM_LARGE_WEIGHT ...
GEMM_LARGE_WEIGHT = 1 << 22  # in_features x out_features (Qwen2.5-3B's o-projection, 2048 x 2048, is not larger)
GEMM_LONG_K_TOKENS = (9, 16)  # ... from 9 tokens where K is at least GEMM_LONG_K as well ...
GEMM_LONG_K = 3072
GEMM_ELONGATED_TOKENS = (65, 128)  # ... and at 65-128 tokens on elongated products
FRAGMENT_TOKENS = (9, 16)  # the fragment kernel's token range on products of at least FRAGMENT_WEIGHT ...
FRAGMENT_WEIGHT = 1 << 22  # in_features x out_features (Qwen2.5-3B's o-projection, 2048 x 2048, is one)
FRAGMENT_WIDE_TOKENS = (17, 32)  # ... at 17-32 tokens where wide, or elongated and of FRAGMENT_LARGE_WEIGHT ...
FRAGMENT_LARGE_WEIGHT = 3 << 24  # (Qwen2.5-7B's MLP products: 3584 x 37888 and 18944 x 3584)
FRAGMENT_FEW_TOKENS = 8  # ... and up to 8 tokens on those elongated large products when K >= GEMM_LONG_K
FRAGMENT_BATCH_TOKENS = (33, 96)  # the 33-128-token kernel over the fragment layout (kernels/w4_fragment_batch.py)
FRAGMENT_BATCH_WIDE_WEIGHT = 1 << 25  # serves wide products of this size (3B's gate/up) at these counts, ...
FRAGMENT_BATCH_LARGE_TOKENS = (33, 128)  # ... wide ones of FRAGMENT_LARGE_WEIGHT (7B's gate/up) at these ...
FRAGMENT_BATCH_TALL_TOKENS = ((33, 48), (65, 128))  # ... and tall ones of it (7B's down: K >= 3N) at these
BATCH_TOKEN_BOUNDS = (*FRAGMENT_BATCH_TOKENS, *FRAGMENT_BATCH_LARGE_TOKENS, 48, 65, 128)  # the ranges' ends
FRAGMENT_BATCH_ROW = True  # (KERNELS.md: w4_gemm was faster on 7B's down at 49-64, 3B's gate/up at 128, 3B's down)
W8_MAX_TOKENS = 64  # the W8 kernel's row: 1-64 tokens, ...
W8_MMA_MAX_TOKENS = 32  # ... beyond this on SM90 only (off SM90 mma.sync beat the dense row on some products only)
W8_MAX_IN_FEATURES = kernels_w8.MAX_IN_FEATURES  # ... at any K its group index takes


class ProductShape(NamedTuple):
    """Everything a row's choice reads: rows can only serve by these fields, so they key the cache of choices."""

    tokens: int
    in_features: int
    out_features: int
    bits: int
    group_size: int


def wide(shape: ProductShape) -> bool:
    """Outputs at least 3x the inputs (a merged gate/up projection)."""
    return shape.out_features >= 3 * shape.in_features


def elongated(shape: ProductShape) -> bool:
    """One side at least 3x the other: the MLP's gate/up (wide) and down (tall) projections."""
    return max(shape.in_features, shape.out_features) >= 3 * min(shape.in_features, shape.out_features)


def long_k(shape: ProductShape) -> bool:
    return shape.in_features >= LONG_K


def tc_takes(shape: ProductShape) -> bool:
    """A W4 weight of whole 16-row tiles and 128-code segments (kernels/quant_matmul.py: tc_reason)."""
    return kernels.tc_reason(shape.bits, shape.in_features, shape.out_features, shape.group_size) is None


def packed_kernel(kernel: str) -> Callable[[torch.Tensor, PackedWeight], torch.Tensor]:
    """The launcher of one of kernels/quant_matmul.py's kernels on a PackedWeight."""
    def launch(rows: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
        return kernels.quant_matmul(rows, packed.qweight, packed.scales, packed.zeros, packed.bits, packed.group_size,
                                    packed.zero_mode, packed.bias, kernel=kernel, integer_zeros=packed.integer_zeros)
    return launch


def dense(rows: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """kernels/dequantize.cu writes the dense weight [N, K] (stored column order, bit-identical to
    core.quant.packing.dequantize), then cuBLAS multiplies. It reads every weight the packed kernels read, so the
    product's capability check covers it."""
    dispatch.use_kernel("dequantize", None)
    weight = kernels_dequantize.dequantize(packed.qweight, packed.scales, packed.zeros, packed.bits,
                                           packed.group_size, packed.zero_mode, rows.dtype)
    return F.linear(rows, weight, packed.bias)


# The GEMM's scale pairs of each weight and activation dtype (kernels/w4_gemm.py gemm_scales), by the id of the
# weight's scales tensor and dropped when that tensor is; the loader makes them before the engine measures its
# memory (core/ops/quant_matmul.py: prepare_products).
_scale_pairs: dict[int, tuple[weakref.ref, dict]] = {}


def gemm_scale_pairs(packed: PackedWeight, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """(sz, zmode) of this weight for `dtype` activations, laid out on first use."""
    key = id(packed.scales)
    entry = _scale_pairs.get(key)
    if entry is None or entry[0]() is not packed.scales:
        entry = _scale_pairs[key] = (weakref.ref(packed.scales, lambda _, key=key: _scale_pairs.pop(key, None)), {})
    per_dtype = entry[1]
    pairs = per_dtype.get(dtype)
    if pairs is None:
        pairs = per_dtype[dtype] = kernels_gemm.gemm_scales(packed.scales, packed.zeros, packed.zero_mode, dtype)
    return pairs


def gemm_serves(shape: ProductShape) -> bool:
    if shape.bits != 4:
        return False
    large = shape.in_features * shape.out_features > GEMM_LARGE_WEIGHT
    return ((GEMM_LARGE_TOKENS[0] <= shape.tokens <= GEMM_LARGE_TOKENS[1] and large)
            or (GEMM_LONG_K_TOKENS[0] <= shape.tokens <= GEMM_LONG_K_TOKENS[1] and large
                and shape.in_features >= GEMM_LONG_K)
            or (GEMM_ELONGATED_TOKENS[0] <= shape.tokens <= GEMM_ELONGATED_TOKENS[1] and elongated(shape)))


def gemm_may_serve(packed: PackedWeight) -> bool:
    """Whether the GEMM row serves some token count of this weight (the loader prepares only those)."""
    return any(product_row(ProductShape(tokens, packed.in_features, packed.out_features, packed.bits,
                                        packed.group_size)).kernel == "w4_gemm"
               for bounds in (GEMM_LARGE_TOKENS, GEMM_LONG_K_TOKENS, GEMM_ELONGATED_TOKENS) for tokens in bounds)


# The fragment layout of each weight and activation dtype (kernels/w4_fragment_gemm.py fragment_layout), by the id
# of the weight's codes tensor and dropped when that tensor is; the loader makes them before the engine measures its
# memory (core/ops/quant_matmul.py: prepare_products). None where the weight's zero points do not fit the layout.
_fragments: dict[int, tuple[weakref.ref, dict]] = {}


def fragment_takes(packed: PackedWeight) -> bool:
    """What the fragment kernel needs of a weight beyond its shape: integer zero points, fp16 scales."""
    return kernels_fragment.fragment_reason(packed.bits, packed.group_size, packed.in_features, packed.zero_mode,
                                            packed.integer_zeros, packed.scales.dtype) is None


def fragment_weight(packed: PackedWeight, dtype: torch.dtype,
                    lay_out: bool = True) -> kernels_fragment.FragmentWeight | None:
    """This weight in the fragment kernel's layout for `dtype` activations, laid out on first use (None: it cannot
    be, or lay_out=False said on first use that it keeps one form)."""
    key = id(packed.qweight)
    entry = _fragments.get(key)
    if entry is None or entry[0]() is not packed.qweight:
        entry = _fragments[key] = (weakref.ref(packed.qweight, lambda _, key=key: _fragments.pop(key, None)), {})
    per_dtype = entry[1]
    if dtype not in per_dtype and not lay_out:
        per_dtype[dtype] = None
    elif dtype not in per_dtype:
        try:
            per_dtype[dtype] = kernels_fragment.fragment_layout(packed.qweight, packed.scales, packed.zeros,
                                                                packed.group_size, packed.out_features,
                                                                packed.in_features, dtype)
        except ValueError:  # zero points too large for the magic-number subtraction
            per_dtype[dtype] = None
    return per_dtype[dtype]


def fragment_serves(shape: ProductShape) -> bool:
    """W4, group sizes of 128 * 2^i or one group a row (those measured), and the measured token ranges."""
    if shape.bits != 4 or not (shape.group_size == shape.in_features
                               or (shape.group_size >= 128 and shape.group_size & (shape.group_size - 1) == 0)):
        return False
    weight = shape.in_features * shape.out_features
    large = weight >= FRAGMENT_LARGE_WEIGHT
    return ((FRAGMENT_TOKENS[0] <= shape.tokens <= FRAGMENT_TOKENS[1] and weight >= FRAGMENT_WEIGHT)
            or (FRAGMENT_WIDE_TOKENS[0] <= shape.tokens <= FRAGMENT_WIDE_TOKENS[1] and weight >= FRAGMENT_WEIGHT
                and (wide(shape) or (large and elongated(shape))))
            or (shape.tokens <= FRAGMENT_FEW_TOKENS and large and elongated(shape)
                and shape.in_features >= GEMM_LONG_K))


def fragment_batch_serves(shape: ProductShape) -> bool:
    """Where FRAGMENT_BATCH_ROW is on: W4 with G = 128 * 2^i or one group a row; wide products of at least
    FRAGMENT_BATCH_WIDE_WEIGHT (3B's gate/up) at 33-96 tokens, of FRAGMENT_LARGE_WEIGHT (7B's) at 33-128; tall ones
    of FRAGMENT_LARGE_WEIGHT (7B's down) at 33-48 and 65-128 (the H200 timing: wgmma)."""
    weight = shape.in_features * shape.out_features
    if not (FRAGMENT_BATCH_ROW and shape.bits == 4 and weight >= FRAGMENT_BATCH_WIDE_WEIGHT
            and (shape.group_size == shape.in_features
                 or (shape.group_size >= 128 and shape.group_size & (shape.group_size - 1) == 0))):
        return False
    large = weight >= FRAGMENT_LARGE_WEIGHT
    if wide(shape):
        low, high = FRAGMENT_BATCH_LARGE_TOKENS if large else FRAGMENT_BATCH_TOKENS
        return low <= shape.tokens <= high
    tall = shape.in_features >= 3 * shape.out_features
    return tall and large and any(low <= shape.tokens <= high for low, high in FRAGMENT_BATCH_TALL_TOKENS)


class FragmentProduct(NamedTuple):
    """A kernel over the fragment layout, as a row of the table runs it."""

    op: str  # the kernel op dispatch logs
    product: Callable[[torch.Tensor, kernels_fragment.FragmentWeight, torch.Tensor | None], torch.Tensor]
    measured_on: Callable[[int], bool]  # the devices (by index) the row's numbers hold for


# kernels/w4_fragment_gemm.cu (1-32 tokens) and kernels/w4_fragment_batch.cu (33-128), looked up at each call; the
# batch kernel's row was measured on its wgmma path (SM90): elsewhere the product runs on the next row
FRAGMENT_PRODUCTS = {
    "fragment": FragmentProduct("w4_fragment_gemm", lambda rows, weight, bias: kernels_fragment.w4_fragment_gemm(
        rows, weight, bias), lambda index: True),
    "fragment_batch": FragmentProduct("w4_fragment_batch", lambda rows, weight, bias: kernels_batch.w4_fragment_batch(
        rows, weight, bias), lambda index: kernels_gemm.wgmma_available(index)),
}
FRAGMENT_KERNELS = tuple(FRAGMENT_PRODUCTS)  # the rows that read the fragment layout


def fragment_may_serve(packed: PackedWeight) -> bool:
    """Whether a fragment row serves some token count of this weight (the loader prepares only those)."""
    return fragment_takes(packed) and any(
        product_row(ProductShape(tokens, packed.in_features, packed.out_features, packed.bits,
                                 packed.group_size)).kernel in FRAGMENT_KERNELS
        for tokens in (1, *FRAGMENT_TOKENS, *FRAGMENT_WIDE_TOKENS, *BATCH_TOKEN_BOUNDS))


@cache
def _row_after_fragment(shape: ProductShape) -> ProductRow:
    return next(row for row in PRODUCT_TABLE if row.kernel not in FRAGMENT_KERNELS and row.serves(shape))


def fragment_launcher(kernel: str) -> Callable[[torch.Tensor, PackedWeight], torch.Tensor]:
    """The launcher of the row of FRAGMENT_PRODUCTS[`kernel`]: its product over the weight's layout; a weight the
    layout cannot hold (float zero points, fp32 scales, zero points beyond the exact range) or that has no layout in
    its own row order (a memory budget, or a merged gate/up weight whose one layout is the interleaved one:
    prepare_products), or a device the row was not measured on, runs on the row that would serve it otherwise."""
    def launch(rows: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
        product = FRAGMENT_PRODUCTS[kernel]
        weight = (fragment_weight(packed, rows.dtype)
                  if fragment_takes(packed) and product.measured_on(rows.device.index) else None)
        if weight is None:
            return _row_after_fragment(ProductShape(rows.shape[0], packed.in_features, packed.out_features,
                                                    packed.bits, packed.group_size)).launch(rows, packed)
        dispatch.use_kernel(product.op, None)
        return product.product(rows, weight, packed.bias)
    return launch


fragment, fragment_batch = fragment_launcher("fragment"), fragment_launcher("fragment_batch")


def gemm(rows: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """kernels/w4_gemm.cu: tensor cores reading the packed weight (wgmma on SM90, mma.sync on SM80-89)."""
    dispatch.use_kernel("w4_gemm", None)
    sz, zmode = gemm_scale_pairs(packed, rows.dtype)
    return kernels_gemm.w4_gemm(rows, packed.qweight, sz, zmode, packed.group_size, packed.bias)


def w8(rows: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """kernels/w8_gemm.cu: tensor cores reading the 8-bit codes, dequantized in registers (the kernel picks mma.sync
    or wgmma, w8_gemm.uses_wgmma); beyond W8_MMA_MAX_TOKENS without wgmma (SM80-89) the dense row."""
    if rows.shape[0] > W8_MMA_MAX_TOKENS and not kernels_gemm.wgmma_available(rows.device.index):
        return dense(rows, packed)
    dispatch.use_kernel("w8_gemm", None)
    return kernels_w8.w8_gemm(rows, packed.qweight, packed.scales, packed.zeros, packed.group_size, packed.zero_mode,
                              packed.integer_zeros, packed.bias)


class ProductRow(NamedTuple):
    kernel: str  # the name dispatch logs and bench gemv marks as "auto"
    serves: Callable[[ProductShape], bool]
    launch: Callable[[torch.Tensor, PackedWeight], torch.Tensor]  # rows [M, K] in stored column order -> [M, N]
    measured: str  # why the row is where it is (docs/KERNELS.md gives the numbers)


PRODUCT_TABLE = (
    ProductRow("w8_gemm", lambda s: s.bits == 8 and s.tokens <= W8_MAX_TOKENS and s.in_features <= W8_MAX_IN_FEATURES,
               w8,
               "8-bit weights (GGUF Q8_0, RTN 8-bit) at 1-64 tokens, at any K: on an H200 faster than the dense "
               "row (dequantize, then cuBLAS) on every Qwen2.5-3B and 7B product at 16-64 tokens (at 64: 3584 x 37888 "
               "108.4 us on the wgmma path against 191.4, 11008 x 2048 27.2 on mma.sync against 34.3), and than "
               "cuBLAS bf16 on the dense weight at one token on all six (2048 x 2048 4.6 us against 6.1), below it "
               "from 16 tokens (docs/KERNELS.md, the W8A16 section); off SM90 the mma.sync kernel to 32 tokens"),
    ProductRow("dense", lambda s: s.bits == 8, dense,
               "the 8-bit products the w8_gemm row leaves: more than 64 tokens (the packed rows below read 4- and "
               "3-bit codes)"),
    ProductRow("fragment", fragment_serves, fragment,
               "on an H200 with bf16 activations (W4, G = 128), faster than every other kernel: at 9-16 tokens on "
               "Qwen2.5-3B's and 7B's products of 2048 x 2048 and more (at 16: 3B gate/up 12.8 us against tcs's 17.2, "
               "7B gate/up 31.7 against w4_gemm's 54.7, 7B down 16.4 against 30.2, 3B down 10.0 against 12.5), at "
               "17-32 on the gate/up products and 7B's down (at 32: 3B gate/up 18.6 against w4_gemm's 20.4, 7B gate/up "
               "48.7 against 58.5, 7B down 23.9 against 28.4), and at 1-8 on 7B's MLP (7B down 13.6 against tc's "
               "20.4, 7B gate/up 22.1 against tcs's 32.5 at one token); it lost to tc at 1-8 tokens elsewhere and "
               "to w4_gemm / ksplit at 32 on the attention products and 3B's down "
               "(results/bench_gemv_qwen2.5-w4a16-fragment-bf16_nvidia_h200.json)"),
    ProductRow("fragment_batch", fragment_batch_serves, fragment_batch,
               "the 33-128-token kernel over the same layout (wgmma on SM90: the 256-row tile over 48- or 64-token "
               "blocks), where FRAGMENT_BATCH_ROW is on: on an H200 faster than w4_gemm on 3B's gate/up 2048 x 22016 "
               "at 48-96 tokens (21.5 us against 28.5 at 48, 34.0 against 43.8 at 96; at 128 44.2 against 43.5), 7B's "
               "gate/up 3584 x 37888 at 48-128 (44.9 against 74.6 at 48, 108.6 against 127.3 at 128) and 7B's down "
               "18944 x 3584 at 48 and 96-128 (32.5 against 34.3, 56.0 against 84.1 at 128; at 64 38.9 against 34.3); "
               "slower on 3B's down at every count (28.8 against 18.6 at 64) (H200 run of the w4 branch, bench gemv)"),
    ProductRow("w4_gemm", gemm_serves, gemm,
               "on an H200 with bf16 activations, on Qwen2.5-3B's and 7B's products larger than 2048 x 2048 at "
               "17-64 tokens faster than every other kernel (at 32 tokens 7B's q/k/v 10.1 us against ksplit's 22.3, "
               "3B's gate/up 20.4 against tcs's 26.4; at 64 tokens 7B's down 34.4 against dequantize + cuBLAS's "
               "99.6), from 9 tokens on long K (7B's q/k/v 9.1 against ksplit's 15.7 at 16, 3B's down 12.5 against "
               "tc's 13.1), and at 65-128 tokens on the MLP products (1.2-1.5x faster than dequantize + cuBLAS at "
               "128); on 3B's o-projection (2048 x 2048) ksplit or dequantize + cuBLAS were faster, on the attention "
               "products at 128 tokens and on every product at 256 dequantize + cuBLAS "
               "(results/bench_gemv_qwen2.5-w4a16-bf16_nvidia_h200.json, 8ad1055:results/w4_gemm_sweep_nvidia_h200.json)"),
    ProductRow("dense", lambda s: s.tokens > (WIDE_KERNEL_MAX_TOKENS if wide(s) else KERNEL_MAX_TOKENS), dense,
               "dequantize + cuBLAS costs about the same at any token count and beats the packed kernels beyond 32 "
               "tokens, beyond 64 on wide products (results/bench_gemv_dense_w4_nvidia_h200.json)"),
    ProductRow("tcs", lambda s: s.tokens <= TC_MAX_TOKENS and wide(s) and tc_takes(s), packed_kernel("tcs"),
               "fastest on wide W4 products at 1-32 tokens (6232077:results/bench_gemv_tcs_bf16_nvidia_h200.json)"),
    ProductRow("tc", lambda s: (s.tokens <= TC_FEW_TOKENS or (s.tokens <= TC_MAX_TOKENS and long_k(s))) and tc_takes(s),
               packed_kernel("tc"),
               "fastest W4 kernel at 2-8 tokens and on long K up to 32; at one token it ties gemv alone and wins "
               "under programmatic dependent launch (6232077:results/bench_gemv_tc_registers_bf16_nvidia_h200.json, "
               "e0c504d:results/pdl_and_l2_prefetch_experiments_qwen2.5-3b_nvidia_h200.json)"),
    ProductRow("stream", lambda s: s.tokens == 1 and long_k(s) and s.out_features <= s.in_features,
               packed_kernel("stream"),
               "one token on long rows (results/bench_gemv_w4a16-w3a16_nvidia_h200.json)"),
    ProductRow("gemv", lambda s: s.tokens == 1, packed_kernel("gemv"),
               "one token elsewhere (results/bench_gemv_w4a16-w3a16_nvidia_h200.json)"),
    ProductRow("ksplit", lambda s: s.tokens <= 16 or (s.tokens <= KERNEL_MAX_TOKENS and not wide(s)),
               packed_kernel("ksplit"),
               "fastest at 2-16 tokens, and at 17-32 unless wide (results/bench_gemv_w4a16-w3a16_nvidia_h200.json, "
               "results/bench_gemv_dense_w4_nvidia_h200.json)"),
    ProductRow("staged", lambda s: s.tokens <= WIDE_KERNEL_MAX_TOKENS, packed_kernel("staged"),
               "wide products at 17-64 tokens the tc kernels do not take: its staged activations serve 128 rows "
               "(results/bench_gemv_w4a16-w3a16_nvidia_h200.json, results/bench_gemv_dense_w4_nvidia_h200.json)"),
)


@cache
def product_row(shape: ProductShape) -> ProductRow:
    """The first row of PRODUCT_TABLE that serves `shape` (the dense row serves every shape the others leave)."""
    return next(row for row in PRODUCT_TABLE if row.serves(shape))


class Epilogue(NamedTuple):
    """A product with more work fused into its epilogue, served where the plain product's row is `kernel`."""

    op: str  # the kernel op (kernels/registry.py), as dispatch logs it
    kernel: str  # the plain product's kernel it extends
    max_tokens: int | None  # the most tokens the fused kernel takes (None: whatever the row serves)


QKV_ROPE = Epilogue("quant_matmul_rope_cache", "tc", kernels.QKV_ROPE_MAX_TOKENS)
GATE_UP_ACT = Epilogue("quant_matmul_act_and_mul", "tcs", None)
# the few-token fragment kernel over a gate/up layout of interleaved rows, where its flag is on: up to 16 tokens,
# where the fused call was faster (the H200 run: the 3B step at 16 tokens 1.987 ms against 1.993)
FRAGMENT_GATE_UP_ACT = Epilogue("w4_fragment_gemm_act_and_mul", "fragment", 16)
FRAGMENT_GATE_UP_ACT_ROW = True


def epilogue_serves(epilogue: Epilogue, shape: ProductShape) -> bool:
    """Whether the fused epilogue serves this product shape (its weight-level checks aside: the fused op runs
    those through dispatch.decide)."""
    if shape.tokens <= 0 or (epilogue.max_tokens is not None and shape.tokens > epilogue.max_tokens):
        return False
    if epilogue is FRAGMENT_GATE_UP_ACT and not FRAGMENT_GATE_UP_ACT_ROW:
        return False
    return product_row(shape).kernel == epilogue.kernel


# The interleaved gate/up layout (kernels/w4_fragment_gemm.py: gate_up_layout) of each merged gate/up weight and
# activation dtype, with its bias in that row order, by the id of the weight's codes and dropped when that tensor
# is; the loader makes them before the engine measures its memory (core/ops/quant_matmul.py: prepare_products), as
# the weight's one fragment form: the fused epilogue and the plain fragment rows read it. None where the weight's
# zero points do not fit the layout, or it keeps one form.
_gate_up_fragments: dict[int, tuple[weakref.ref, dict]] = {}


def gate_up_fragment_weight(packed: PackedWeight, dtype: torch.dtype, lay_out: bool = True
                            ) -> tuple[kernels_fragment.FragmentWeight, torch.Tensor | None] | None:
    """(the interleaved layout, the bias in its row order) of a merged [gate; up] weight for `dtype` activations,
    laid out on first use (None: it cannot be, the fragment rows do not serve it, or lay_out=False said on first use
    that it keeps one form)."""
    key = id(packed.qweight)
    entry = _gate_up_fragments.get(key)
    if entry is None or entry[0]() is not packed.qweight:
        entry = _gate_up_fragments[key] = (
            weakref.ref(packed.qweight, lambda _, key=key: _gate_up_fragments.pop(key, None)), {})
    per_dtype = entry[1]
    if dtype not in per_dtype and not (lay_out and gate_up_interleaves(packed)):
        per_dtype[dtype] = None
    elif dtype not in per_dtype:
        try:
            weight = kernels_fragment.gate_up_layout(packed.qweight, packed.scales, packed.zeros, packed.group_size,
                                                     packed.in_features, dtype)
        except ValueError:  # zero points too large for the magic-number subtraction
            per_dtype[dtype] = None
        else:
            order = kernels_fragment.gate_up_order(packed.out_features // 2, packed.qweight.device)
            bias = None if packed.bias is None else packed.bias[order].to(dtype).contiguous()
            per_dtype[dtype] = (weight, bias)
    return per_dtype[dtype]


def gate_up_interleaves(packed: PackedWeight) -> bool:
    """Whether a merged gate/up weight's fragment form is the interleaved layout: the fragment rows serve it and its
    halves are whole 8-row blocks."""
    return packed.out_features % 16 == 0 and fragment_may_serve(packed)


def gate_up_fragment_product(rows: torch.Tensor, packed: PackedWeight) -> torch.Tensor | None:
    """rows [M, K] (stored column order) through a merged [gate; up] weight -> [M, 2I] in gate_up_order's column
    order (column 16 t + j: gate output 8 t + j, 16 t + 8 + j: its up output), from the fragment row that serves M
    tokens over the weight's interleaved layout: the outputs the row's product over the plain layout computes, at
    other columns. None where no fragment row serves M tokens, the weight has no interleaved layout, or the device
    is not the row's (its product then runs on the other rows, in [gate | up] order)."""
    product = FRAGMENT_PRODUCTS.get(product_row(ProductShape(rows.shape[0], packed.in_features, packed.out_features,
                                                             packed.bits, packed.group_size)).kernel)
    layout = (gate_up_fragment_weight(packed, rows.dtype)
              if product is not None and product.measured_on(rows.device.index) else None)
    if layout is None:
        return None
    weight, bias = layout
    dispatch.use_kernel(product.op, None)
    return product.product(rows, weight, bias)
