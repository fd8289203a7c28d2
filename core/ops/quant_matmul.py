"""quant_matmul: y = x @ W.T (+ bias) for a W4A16/W3A16 PackedWeight; every QuantLinear routes here.

On CUDA with fp16/bf16 activations the kernels in kernels/quant_matmul.cu read the packed weight
directly (the act-order permutation is gathered on the activation side first) for products that
`uses_dense` leaves to them; the others (prefill chunks, large decode batches) dequantize the weight
once with kernels/dequantize.cu and multiply on cuBLAS: one read of the packed weight plus a write
and a read of the dense copy, whatever the token count. Which is faster was measured per token count
and shape on an H200 (`deepinfer bench gemv`, results/bench_gemv_dense_w4_nvidia_h200.json): the
kernels up to 32 tokens (2048x2048 at 32 tokens: 7.0 us against 13.4 dense), and on outputs at
least 3x the input up to 64 (2048x22016 at 64: staged 67.7 us, dense 88.0); dense beyond.
Anywhere else, or with DEEPINFER_FORCE_REFERENCE=1, the torch reference dequantizes the whole
weight and multiplies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.core.ops import dispatch
from deepinfer.core.quant.packed import PackedWeight
from deepinfer.core.quant.packing import dequantize

KERNEL_MAX_TOKENS = 32  # the packed-weight kernels serve up to this many tokens on any shape
WIDE_KERNEL_MAX_TOKENS = 64  # ... and up to this many where out_features >= 3 * in_features


def uses_dense(num_tokens: int, in_features: int, out_features: int) -> bool:
    """Whether an M-token product goes through dequantize + cuBLAS rather than a packed-weight kernel."""
    most = WIDE_KERNEL_MAX_TOKENS if out_features >= 3 * in_features else KERNEL_MAX_TOKENS
    return num_tokens > most


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
    from deepinfer.kernels import registry

    op = registry.get("quant_matmul")
    signature = _signature(x, packed)
    if not dispatch.decide(op.name, signature, lambda: (
            dispatch.kernel_blocker(x, packed.qweight)
            or op.unsupported_reason(x, packed.qweight, packed.scales, packed.zeros, packed.bits, packed.group_size))):
        return quant_matmul_reference(x, packed)
    rows = x.reshape(-1, packed.in_features)  # [M, K]
    if packed.input_perm is not None:
        rows = rows.index_select(1, packed.input_perm)  # stored column j multiplies x[input_perm[j]]
    if uses_dense(rows.shape[0], packed.in_features, packed.out_features):
        dense = registry.get("dequantize")
        if dispatch.decide(dense.name, signature, lambda: dense.unsupported_reason(
                x.dtype, packed.qweight, packed.scales, packed.zeros, packed.bits, packed.group_size)):
            weight = dense.launch(packed.qweight, packed.scales, packed.zeros, packed.bits, packed.group_size,
                                  packed.zero_mode, x.dtype)  # [N, K], stored column order
            return F.linear(rows, weight, packed.bias).view(*x.shape[:-1], packed.out_features)
    out = op.launch(rows, packed.qweight, packed.scales, packed.zeros, packed.bits, packed.group_size,
                    packed.zero_mode, packed.bias, integer_zeros=packed.integer_zeros)  # [M, N]
    return out.view(*x.shape[:-1], packed.out_features)
