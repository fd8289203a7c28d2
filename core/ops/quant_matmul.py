"""quant_matmul: y = x @ W.T (+ bias) for a W4A16/W3A16/W8A16 PackedWeight; every QuantLinear routes here.

On CUDA with fp16/bf16 activations and a weight the kernels read (kernels/quant_matmul.py: unsupported_reason),
the row of core/ops/quant_matmul_table.py that serves the product's token count and shape runs it: one of the
packed-weight kernels (the act-order permutation gathered on the activation side first), or for many tokens the
dense path (dequantize once, then cuBLAS). On the CPU, core/ops/quant_matmul_cpu.py runs it on a layout made once
(torch's int4 matmul, or a dense copy). Anywhere else, or with DEEPINFER_FORCE_REFERENCE=1, the torch reference
dequantizes the whole weight and multiplies.

The fused products (core/ops/qkv_rotary.py, core/ops/gate_up_activation.py) run the same capability check first.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from deepinfer.core.ops import dispatch
from deepinfer.core.ops.quant_matmul_cpu import quant_matmul_cpu
from deepinfer.core.ops.quant_matmul_table import (
    ProductShape,
    fragment_may_serve,
    fragment_weight,
    gate_up_fragment_weight,
    gate_up_interleaves,
    gemm_may_serve,
    gemm_scale_pairs,
    product_row,
)
from deepinfer.core.quant.packed import PackedWeight
from deepinfer.core.quant.packing import dequantize
from deepinfer.kernels import quant_matmul as kernels
from deepinfer.kernels import w4_fragment_gemm as kernels_fragment
from deepinfer.kernels import w8_gemm as kernels_w8

OP = "quant_matmul"


def quant_matmul_reference(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype. The torch reference: dequantize the whole weight, then matmul."""
    weight = dequantize(packed, x.dtype)  # [N, K], original input order
    out = x @ weight.T
    if packed.bias is not None:
        out = out + packed.bias.to(x.dtype)
    return out


class ProductCase(NamedTuple):
    """What the kernels' capability check reads of a product (none of it changes with the token count)."""

    devices: tuple[torch.device, ...]  # the activations' and the weight's
    dtype: torch.dtype  # the activations'
    weight: kernels.PackedOperands

    @classmethod
    def of(cls, x: torch.Tensor, packed: PackedWeight) -> ProductCase:
        return cls((x.device, packed.qweight.device), x.dtype,
                   kernels.packed_operands(packed.qweight, packed.scales, packed.zeros, packed.bits, packed.group_size))


def product_reason(case: ProductCase) -> str | None:
    if case.weight.bits == 8:  # the W8 kernel's rows (core/ops/quant_matmul_table.py)
        return kernels_w8.unsupported_reason(case.dtype, case.weight)
    return kernels.unsupported_reason(case.dtype, case.weight)


def product_shape(num_tokens: int, packed: PackedWeight) -> ProductShape:
    return ProductShape(num_tokens, packed.in_features, packed.out_features, packed.bits, packed.group_size)


def stored_order(rows: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """rows [M, K] in the weight's stored column order: stored column j multiplies x[input_perm[j]]."""
    return rows if packed.input_perm is None else rows.index_select(1, packed.input_perm)


def quant_matmul(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype: the kernel its table row names where the kernels serve the case, else
    the reference. The capability is decided once per case (dispatch.decide) and the row once per shape, so a call
    costs a few dict lookups besides the launch."""
    if not dispatch.decide(OP, ProductCase.of(x, packed), product_reason, (x,)):
        if x.device.type == "cpu" and not dispatch.force_reference() and not x.requires_grad:
            return quant_matmul_cpu(x, packed)
        return quant_matmul_reference(x, packed)
    rows = stored_order(x.reshape(-1, packed.in_features), packed)  # [M, K]
    out = product_row(product_shape(rows.shape[0], packed)).launch(rows, packed)  # [M, N]
    return out.view(*x.shape[:-1], packed.out_features)


class PreparedForms(NamedTuple):
    """What prepare_products makes of one weight, beside its packed tensors, for one activation dtype."""

    scale_pairs: bool  # the W4 GEMM's scale pairs (kernels/w4_gemm.py: gemm_scales), where its row serves
    fragment: bool  # the fragment layout in the weight's row order, where a fragment row serves
    gate_up_fragment: bool  # ... or in gate_up_order with the bias in that order: a merged gate/up weight's one form


def prepared_forms(packed: PackedWeight, dtype: torch.dtype, fragments: bool = True,
                   gate_up: bool = False) -> PreparedForms | None:
    """The forms prepare_products makes of `packed` for `dtype` activations (None: the kernels cannot serve it on its
    device). A merged gate/up weight (`gate_up`: its MLP reads the fused epilogues' interleaved order, core/ops/
    gate_up_activation.py) gets the interleaved fragment layout and no plain one; fragments=False: no fragment
    layout (a memory budget)."""
    case = ProductCase((packed.qweight.device, packed.qweight.device), dtype,
                       kernels.packed_operands(packed.qweight, packed.scales, packed.zeros, packed.bits,
                                               packed.group_size))
    if dispatch.kernel_blocker(case.devices) is not None or product_reason(case) is not None:
        return None
    layout = fragments and fragment_may_serve(packed) and kernels_fragment.zeros_fit(packed.zeros, dtype)
    interleaved = gate_up and gate_up_interleaves(packed)
    return PreparedForms(gemm_may_serve(packed), layout and not interleaved, layout and interleaved)


def fragment_layout_bytes(packed: PackedWeight) -> int:
    """Bytes of the fragment layout of a W4 weight (kernels/w4_fragment_gemm.py FragmentWeight), in either row order:
    the codes in 16-row x 64-k atoms of 512 bytes (frag int32 [ceil(N / 16), ceil(K / 64), 32, 4], as large as the
    packed codes where K is a multiple of 64) and a scale and a zero (one word) per row and group (sz int32
    [ceil(N / 16), K / G, 8, 2])."""
    tiles, atoms = -(-packed.out_features // 16), -(-packed.in_features // 64)
    return tiles * atoms * 32 * 4 * 4 + scale_pair_bytes(packed)


def scale_pair_bytes(packed: PackedWeight) -> int:
    """Bytes of a scale and a zero per row (padded to whole 16-row tiles) and group in one 32-bit word: the fragment
    layout's sz and the W4 GEMM's scale pairs, int32 [ceil(N / 16), K / G, 8, 2] each."""
    return -(-packed.out_features // 16) * packed.scales.shape[1] * 8 * 2 * 4


def prepared_bytes(weights: list[PackedWeight], dtype: torch.dtype, gate_ups: frozenset[int] = frozenset(),
                   fragments: bool = True) -> int:
    """Bytes of everything prepare_products(weights, dtype, fragments, gate_ups) makes: for each weight its
    prepared_forms (one fragment layout at most, a gate/up weight's with its bias in its row order, in `dtype`; the
    W4 GEMM's scale pairs)."""
    total = 0
    for packed in weights:
        forms = prepared_forms(packed, dtype, fragments, id(packed) in gate_ups)
        if forms is None:
            continue
        if forms.scale_pairs:
            total += scale_pair_bytes(packed)
        if forms.fragment or forms.gate_up_fragment:
            total += fragment_layout_bytes(packed)
        if forms.gate_up_fragment and packed.bias is not None:
            total += packed.out_features * dtype.itemsize
    return total


def prepare_products(weights: list[PackedWeight], dtype: torch.dtype, fragments: bool = True,
                     gate_ups: frozenset[int] = frozenset()) -> int:
    """Lay out, for `dtype` activations, what the kernels derive from the weights they may serve (prepared_forms:
    the W4 GEMM's scale pairs, the fragment kernels' copy of the weight in their layout), so nothing is allocated
    for it during a step; returns how many weights got something. Weights the kernels cannot serve on their device
    are left alone. fragments=False keeps one form of each weight (a memory budget: the fragment copy is as large as
    the packed codes); their products then run on the rows after the fragment kernels'. `gate_ups`: the ids of
    merged gate/up weights whose MLP reads the interleaved order: their one fragment form is the interleaved
    gate/up layout, which the fused epilogue and the plain fragment rows read (core/ops/gate_up_activation.py);
    their products that quant_matmul runs take the rows after the fragment kernels'."""
    prepared = 0
    for packed in weights:
        forms = prepared_forms(packed, dtype, fragments, id(packed) in gate_ups)
        if forms is None:
            continue
        if forms.scale_pairs:
            gemm_scale_pairs(packed, dtype)
        if fragment_may_serve(packed):  # the first call decides: the forms not made now are never made
            fragment_weight(packed, dtype, lay_out=forms.fragment)
            if id(packed) in gate_ups and gate_up_interleaves(packed):
                gate_up_fragment_weight(packed, dtype, lay_out=forms.gate_up_fragment)
        prepared += any(forms)
    return prepared
