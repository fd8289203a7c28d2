"""quant_matmul: y = x @ W.T (+ bias) for a W4A16/W3A16 PackedWeight; every QuantLinear routes here."""

from __future__ import annotations

import torch

from core.quant.packed import PackedWeight
from core.quant.packing import dequantize


def quant_matmul(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype. The torch reference: dequantize the whole weight, then matmul."""
    weight = dequantize(packed, x.dtype)  # [N, K], original input order
    out = x @ weight.T
    if packed.bias is not None:
        out = out + packed.bias.to(x.dtype)
    return out
