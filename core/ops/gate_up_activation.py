"""The merged gate/up projection of a gated MLP with the activation fused into the product's epilogue, and the
column order of the product where it is not fused.

A decode step runs the W4 gate/up product on the tcs kernel and then act_and_mul_kernel, which reads the [T, 2I]
product back and writes act(gate) * up [T, I]: a kernel launch and its round trips per layer. Where the fused
kernel serves (core/ops/quant_matmul_table.py: GATE_UP_ACT; kernels/quant_matmul.py:
gate_up_act_unsupported_reason), the product's epilogue does that work instead, with the same roundings, so the
result is the unfused one bit for bit. Where the product's row is the few-token fragment kernel
(FRAGMENT_GATE_UP_ACT: the same bits as its product then act_and_mul), its act-and-mul epilogue over the weight's
interleaved gate/up layout does that work.
A W4 gate/up weight the fragment rows serve holds that interleaved layout as its one fragment form
(core/ops/quant_matmul.py: prepare_products), so at the token counts whose row is a fragment kernel without the
fused epilogue, its product (interleaved_gate_up_product) returns the [T, 2I] outputs in the layout's column order
(column 16 b + j: gate output 8 b + j, 16 b + 8 + j: its up output) and the MLP's interleaved act_and_mul reads
them. Which order a product returns follows from its token count and what the load prepared, never from data, so
a captured graph replays it.
Everywhere else the product returns [gate | up] and act_and_mul reads its halves.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from deepinfer.core.ops import dispatch
from deepinfer.core.ops.quant_matmul import OP as PRODUCT_OP
from deepinfer.core.ops.quant_matmul import ProductCase, product_reason, product_shape, stored_order
from deepinfer.core.ops.quant_matmul_table import (
    FRAGMENT_GATE_UP_ACT,
    FRAGMENT_KERNELS,
    GATE_UP_ACT,
    epilogue_serves,
    fragment_takes,
    gate_up_fragment_product,
    gate_up_fragment_weight,
    product_row,
)
from deepinfer.core.quant.packed import PackedWeight
from deepinfer.kernels import quant_matmul as kernels
from deepinfer.kernels import w4_fragment_gemm as kernels_fragment
from deepinfer.kernels.act_and_mul import ACTIVATIONS


class GateUpActCase(NamedTuple):
    devices: tuple[torch.device, ...]  # the activations' and the weight's
    product: ProductCase
    in_features: int
    out_features: int
    activation: str


def _reason(case: GateUpActCase) -> str | None:
    weight = case.product.weight
    return product_reason(case.product) or kernels.gate_up_act_unsupported_reason(
        weight.bits, weight.group_size, case.in_features, case.out_features, case.activation)


class FragmentGateUpActCase(NamedTuple):
    devices: tuple[torch.device, ...]  # the activations' and the weight's
    product: ProductCase
    takes_fragments: bool  # integer zero points and fp16 scales (quant_matmul_table.fragment_takes)
    out_features: int
    activation: str


def _fragment_reason(case: FragmentGateUpActCase) -> str | None:
    if reason := product_reason(case.product):
        return reason
    if not case.takes_fragments:
        return "the fragment layout takes integer zero points and fp16 scales"
    if case.out_features % 16:
        return f"{case.out_features} outputs are not two halves of whole 8-row blocks"
    return None if case.activation in ACTIVATIONS else f"activation {case.activation!r}"


def fused_activation(activation: str) -> bool:
    """Whether the fused epilogues have this gated activation (the loader lays out gate/up weights for them)."""
    return activation in ACTIVATIONS


def gate_up_act_and_mul(x: torch.Tensor, packed: PackedWeight | None, activation: str) -> torch.Tensor | None:
    """x [T, hidden] through the merged [gate | up] weight `packed` (2I outputs; None for an unquantized projection)
    -> act(gate) * up [T, I] as the product followed by act_and_mul would give, or None where the fused kernel does
    not serve (the caller then runs those two)."""
    if packed is None:
        return None
    shape = product_shape(x.shape[0], packed)
    if epilogue_serves(FRAGMENT_GATE_UP_ACT, shape):
        case = FragmentGateUpActCase((x.device, packed.qweight.device), ProductCase.of(x, packed),
                                     fragment_takes(packed), packed.out_features, activation)
        layout = (gate_up_fragment_weight(packed, x.dtype)
                  if dispatch.decide(FRAGMENT_GATE_UP_ACT.op, case, _fragment_reason, (x,), fallback="separate ops")
                  else None)
        if layout is None:
            return None
        weight, bias = layout
        return kernels_fragment.w4_fragment_gemm_act_and_mul(stored_order(x, packed), weight, activation, bias)
    if not epilogue_serves(GATE_UP_ACT, shape):
        return None
    case = GateUpActCase((x.device, packed.qweight.device), ProductCase.of(x, packed), packed.in_features,
                         packed.out_features, activation)
    if not dispatch.decide(GATE_UP_ACT.op, case, _reason, (x,), fallback="separate ops"):
        return None
    rows = stored_order(x, packed)
    return kernels.quant_matmul_act_and_mul(rows, packed.qweight, packed.scales, packed.zeros, packed.bias,
                                            packed.group_size, packed.zero_mode, packed.integer_zeros, activation)


def interleaved_gate_up_product(x: torch.Tensor, packed: PackedWeight | None, activation: str) -> torch.Tensor | None:
    """x [T, hidden] through the merged [gate | up] weight `packed` -> [T, 2I] in the interleaved layout's column
    order, where a fragment row serves T tokens over that layout (quant_matmul_table.gate_up_fragment_product), or
    None (the product then runs on quant_matmul, in [gate | up] order)."""
    if packed is None or not fused_activation(activation):  # the loader interleaves only these (fused_activation)
        return None
    if product_row(product_shape(x.shape[0], packed)).kernel not in FRAGMENT_KERNELS:
        return None
    if not dispatch.decide(PRODUCT_OP, ProductCase.of(x, packed), product_reason, (x,)):
        return None
    return gate_up_fragment_product(stored_order(x, packed), packed)

