"""quant_matmul: y = x @ W.T (+ bias) for a W4A16/W3A16 PackedWeight; every QuantLinear routes here.

On CUDA with fp16/bf16 activations the kernels in kernels/quant_matmul.cu read the packed weight
directly for up to DENSE_MIN_TOKENS - 1 tokens (the act-order permutation is gathered on the
activation side first). From DENSE_MIN_TOKENS tokens on (prefill chunks, large decode batches) the
weight is dequantized once by kernels/dequantize.cu and the product runs on cuBLAS: one read of the
packed weight plus a write and a read of the dense copy cost less than the W4 tensor-core kernels
once that many tokens share the weight (they reach a tenth of the weight-read floor there, see
kernels/PERFORMANCE.md). Anywhere else, or with DEEPINFER_FORCE_REFERENCE=1, the torch reference
dequantizes the whole weight and multiplies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core.ops import dispatch
from core.quant.packed import PackedWeight
from core.quant.packing import dequantize

DENSE_MIN_TOKENS = 17


def quant_matmul_reference(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype. The torch reference: dequantize the whole weight, then matmul."""
    weight = dequantize(packed, x.dtype)  # [N, K], original input order
    out = x @ weight.T
    if packed.bias is not None:
        out = out + packed.bias.to(x.dtype)
    return out


def _signature(x: torch.Tensor, packed: PackedWeight) -> tuple:
    """Everything the kernel-or-reference decision reads, none of it changing with the token count."""
    weights = (packed.qweight, packed.scales, packed.zeros)
    return (x.device, x.dtype, packed.qweight.device, packed.bits, packed.group_size, packed.scales.dtype,
            packed.zeros.dtype, all(t.is_contiguous() for t in weights), packed.qweight.data_ptr() % 16)


def quant_matmul(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype: the CUDA kernel when it serves the case, else the reference.
    The decision is made once per signature (dispatch.decide); the launcher caches its launch plan per
    shape, so a call costs a couple of dict lookups besides the launch."""
    from kernels import registry

    op = registry.get("quant_matmul")
    signature = _signature(x, packed)
    if not dispatch.decide(op.name, signature, lambda: (
            dispatch.kernel_blocker(x, packed.qweight)
            or op.unsupported_reason(x, packed.qweight, packed.scales, packed.zeros, packed.bits, packed.group_size))):
        return quant_matmul_reference(x, packed)
    rows = x.reshape(-1, packed.in_features)  # [M, K]
    if packed.input_perm is not None:
        rows = rows.index_select(1, packed.input_perm)  # stored column j multiplies x[input_perm[j]]
    if rows.shape[0] >= DENSE_MIN_TOKENS:
        dense = registry.get("dequantize")
        if dispatch.decide(dense.name, signature, lambda: dense.unsupported_reason(
                x.dtype, packed.qweight, packed.scales, packed.zeros, packed.bits, packed.group_size)):
            weight = dense.launch(packed.qweight, packed.scales, packed.zeros, packed.bits, packed.group_size,
                                  packed.zero_mode, x.dtype)  # [N, K], stored column order
            return F.linear(rows, weight, packed.bias).view(*x.shape[:-1], packed.out_features)
    out = op.launch(rows, packed.qweight, packed.scales, packed.zeros, packed.bits, packed.group_size,
                    packed.zero_mode, packed.bias)  # [M, N]
    return out.view(*x.shape[:-1], packed.out_features)
