"""Launcher of token_bitmask.cu: a structured-output step's token masks applied in place to its logits."""

from __future__ import annotations

import torch

from deepinfer.kernels.compiler import get_kernel
from deepinfer.kernels.launch import i32, i64, launch, ptr

SOURCE = "token_bitmask.cu"
KERNEL = "token_bitmask_kernel"
TOKENS_PER_CTA = 1024  # token_bitmask.cu's


def unsupported_reason(logits_dtype: torch.dtype, unit_column_stride: bool, rows_dtype: torch.dtype,
                       bitmask_dtype: torch.dtype) -> str | None:
    """Why the kernel cannot mask these logits (None when it can)."""
    if logits_dtype != torch.float32:
        return f"logits dtype {logits_dtype} (kernel takes float32)"
    if not unit_column_stride:
        return "logits rows are not contiguous"
    if rows_dtype != torch.int32 or bitmask_dtype != torch.int32:
        return f"rows {rows_dtype} / bitmask {bitmask_dtype} (kernel takes int32 both)"
    return None


def apply_token_bitmask_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [N, V] float32 (contiguous rows); rows [C] int32; bitmask [C, W >= ceil(V / 32)] int32, contiguous:
    sets logits[rows[c], v] to -inf where bit v % 32 of bitmask[c, v // 32] is 0."""
    num_rows, vocab = rows.shape[0], logits.shape[1]
    if num_rows == 0 or vocab == 0:
        return
    index = logits.device.index
    launch(get_kernel(SOURCE, KERNEL, index), (-(-vocab // TOKENS_PER_CTA), num_rows, 1), (256, 1, 1),
           (ptr(logits), ptr(rows), ptr(bitmask), i32(vocab), i32(bitmask.shape[1]), i64(logits.stride(0))), index)
