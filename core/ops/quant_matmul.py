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

from core.ops import dispatch
from core.quant.packed import PackedWeight
from core.quant.packing import dequantize

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


def norm_and_quant_matmul(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight_offset: float,
                          residual: torch.Tensor | None, packed: PackedWeight) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(RMSNorm(x + residual) @ W.T (+ bias), x + residual) in ONE kernel, or None where no kernel takes the pair
    (the caller then runs core.ops.norm.rms_norm and quant_matmul apart). x, residual: [T, K]; without a residual
    the second value is x itself.

    The tc and tcs kernels apply the norm to their activations as they load them (kernels/quant_matmul.py,
    FusedNorm), for up to 8 tokens on W4 weights without an act-order permutation: a decode step then skips the
    separate norm launch before qkv and before gate_up, two links of its kernel chain per layer."""
    from kernels import registry
    from kernels.quant_matmul import NORM_MAX_TOKENS, FusedNorm, default_tile, norm_reason, pick_kernel

    num_tokens = x.shape[0]
    if num_tokens == 0 or num_tokens > NORM_MAX_TOKENS or packed.input_perm is not None or x.dim() != 2:
        return None
    op, norm_op = registry.get("quant_matmul"), registry.get("rms_norm")
    if not dispatch.decide(op.name, _signature(x, packed), lambda: (
            dispatch.kernel_blocker(x, packed.qweight)
            or op.unsupported_reason(x, packed.qweight, packed.scales, packed.zeros, packed.bits, packed.group_size))):
        return None
    key = (x.device, x.dtype, x.shape[-1], norm_weight.device, norm_weight.dtype,
           None if residual is None else residual.device)
    if not dispatch.decide(norm_op.name, key, lambda: dispatch.kernel_blocker(x, norm_weight, residual)
                           or norm_op.unsupported_reason(x, norm_weight)):
        return None
    kernel = pick_kernel(num_tokens, packed.in_features, packed.out_features, packed.bits, packed.group_size)
    x = x.contiguous()
    residual = None if residual is None else residual.contiguous()
    norm = FusedNorm(norm_weight.contiguous(), eps, weight_offset, residual,
                     None if residual is None else torch.empty_like(x))
    if norm_reason(kernel, default_tile(kernel, num_tokens), num_tokens, x, norm) is not None:
        return None
    out = op.launch(x, packed.qweight, packed.scales, packed.zeros, packed.bits, packed.group_size, packed.zero_mode,
                    packed.bias, integer_zeros=packed.integer_zeros, norm=norm)  # [T, N]
    return out, (x if residual is None else norm.residual_out)
