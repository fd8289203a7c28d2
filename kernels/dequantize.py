"""Launcher of dequantize.cu: a PackedWeight's codes (3, 4 or 8 bits), scales and zeros -> dense [N, K] fp16/bf16."""

from __future__ import annotations

import torch

from deepinfer.kernels.compiler import get_kernel
from deepinfer.kernels.launch import i32, launch, ptr
from deepinfer.kernels.quant_matmul import PackedOperands, packed_layout_reason

SOURCE = "dequantize.cu"
_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}
_ZERO_MODES = {"zero": 0, "min": 1}


def unsupported_reason(dtype: torch.dtype, weight: PackedOperands) -> str | None:
    """Why the kernel cannot dequantize this weight into `dtype` (None when it can)."""
    if dtype not in _DTYPE_CODES:
        return f"output dtype {dtype} (kernel writes float16/bfloat16)"
    return packed_layout_reason(weight, (3, 4, 8))


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int,
               zero_mode: str, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """qweight int32 [N, K * bits / 32], scales/zeros [N, K / group_size] -> W [N, K] in `dtype`."""
    rows = qweight.shape[0]
    in_features = qweight.shape[1] * 32 // bits
    if out is None:
        out = torch.empty(rows, in_features, dtype=dtype, device=qweight.device)
    units = in_features // (32 if bits == 3 else 8)  # a thread's codes: a word (W4), two (W8) or a 3-word run (W3)
    index = qweight.device.index
    name = (f"dequantize_kernel<{_DTYPE_CODES[dtype]},{bits},{_ZERO_MODES[zero_mode]},"
            f"{int(scales.dtype == torch.float32)}>")
    launch(get_kernel(SOURCE, name, index), (rows, -(-units // 256), 1), (256, 1, 1), (
        ptr(qweight), ptr(scales), ptr(zeros), ptr(out), i32(rows), i32(in_features), i32(group_size)), index)
    return out
