"""The merged gate/up projection of a gated MLP with the activation fused into the product's epilogue.

A decode step runs the W4 gate/up product on the tcs kernel and then act_and_mul_kernel, which reads the [T, 2I]
product back and writes act(gate) * up [T, I]: a kernel launch and its round trips per layer. Where the fused
kernel serves (core/ops/quant_matmul_table.py: GATE_UP_ACT; kernels/quant_matmul.py:
gate_up_act_unsupported_reason), the product's epilogue does that work instead, with the same roundings, so the
result is the unfused one bit for bit. Where the product's row is the few-token fragment kernel
(FRAGMENT_GATE_UP_ACT: the same bits as its product then act_and_mul), its act-and-mul epilogue over the weight's
interleaved gate/up layout does that work.
Everywhere else (other weights, more tokens, the CPU) the caller runs the two ops.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from deepinfer.core.ops import dispatch
from deepinfer.core.ops.quant_matmul import ProductCase, product_reason, product_shape, stored_order
from deepinfer.core.ops.quant_matmul_table import (
    FRAGMENT_GATE_UP_ACT,
    GATE_UP_ACT,
    epilogue_serves,
    fragment_takes,
    gate_up_fragment_weight,
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
