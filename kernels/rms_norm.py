"""Launcher of rms_norm.cu: RMSNorm with an optional fused residual add (Llama or Gemma weights)."""

from __future__ import annotations

import torch

from deepinfer.kernels.compiler import get_kernel
from deepinfer.kernels.launch import f32, i32, launch, ptr

SOURCE = "rms_norm.cu"
_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}


def unsupported_reason(dtype: torch.dtype, weight_dtype: torch.dtype, hidden: int) -> str | None:
    """Why the kernel cannot normalize rows of `hidden` `dtype` values with a `weight_dtype` weight (None: it can)."""
    if dtype not in _DTYPE_CODES:
        return f"dtype {dtype} (kernel takes float16/bfloat16)"
    if weight_dtype != dtype:
        return f"weight dtype {weight_dtype} differs from input {dtype}"
    if hidden % 8:
        return f"hidden size {hidden} is not a multiple of 8"
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0,
             residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
             residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, hidden] -> (normed [T, hidden], x + residual or None); out/residual_out: buffers to fill."""
    x = x.contiguous()
    hidden = x.shape[-1]
    rows = x.numel() // hidden
    out = torch.empty_like(x) if out is None else out
    if residual is None:
        residual_out = None
    else:
        residual = residual.contiguous()
        residual_out = torch.empty_like(x) if residual_out is None else residual_out
    if rows == 0:
        return out, residual_out
    index = x.device.index
    name = (f"rms_norm_kernel<{_DTYPE_CODES[x.dtype]},{int(residual is not None)},"
            f"{int(weight_offset != 0.0)}>")
    threads = min(256, max(32, -(-hidden // 8 // 32) * 32))
    launch(get_kernel(SOURCE, name, index), (rows, 1, 1), (threads, 1, 1), (
        ptr(x), ptr(residual), ptr(weight.contiguous()), ptr(out), ptr(residual_out), i32(hidden), f32(eps),
        f32(weight_offset)), index)
    return out, residual_out
