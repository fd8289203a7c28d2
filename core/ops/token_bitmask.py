"""Structured outputs' token masks on a step's logits, in place: kernel when one serves the case, torch otherwise."""

from __future__ import annotations

from typing import NamedTuple

import torch

from deepinfer.core.ops import dispatch
from deepinfer.kernels import token_bitmask as kernels

OP = "token_bitmask"


class BitmaskCase(NamedTuple):
    devices: tuple[torch.device, ...]  # logits', rows', bitmask's
    logits_dtype: torch.dtype
    unit_column_stride: bool
    rows_dtype: torch.dtype
    bitmask_dtype: torch.dtype

    @classmethod
    def of(cls, logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> BitmaskCase:
        return cls((logits.device, rows.device, bitmask.device), logits.dtype, logits.stride(1) == 1, rows.dtype,
                   bitmask.dtype)


def _reason(case: BitmaskCase) -> str | None:
    return kernels.unsupported_reason(case.logits_dtype, case.unit_column_stride, case.rows_dtype, case.bitmask_dtype)


def apply_token_bitmask_reference(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits[rows[c], v] = -inf where bit v % 32 of bitmask[c, v // 32] is 0 (bits [C, W, 32] expanded)."""
    num_rows, vocab = rows.shape[0], logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [C, W, 32]
    allowed = bits.view(num_rows, -1)[:, :vocab].bool().to(logits.device)  # [C, V]
    index = rows.to(device=logits.device, dtype=torch.int64)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(~allowed, float("-inf")))


def apply_token_bitmask_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [N, V] (modified in place), rows [C] int, bitmask [C, ceil(V / 32)] int32: the disallowed tokens of
    each listed row become -inf; the other rows and the allowed tokens keep their values."""
    if dispatch.decide(OP, BitmaskCase.of(logits, rows, bitmask), _reason, (logits,)):
        kernels.apply_token_bitmask_(logits, rows, bitmask)
    else:
        apply_token_bitmask_reference(logits, rows, bitmask)
