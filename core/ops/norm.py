"""RMSNorm with an optional fused residual add: kernel when one serves the case, torch otherwise.

Numerics are the decoder's (core/models/layers.RMSNorm): Llama normalizes in fp32, casts back, then
scales by the weight in the model dtype; Gemma (weight_offset 1.0) computes `x * (1 + w)` in fp32.
With a residual, the sum `x + residual` is rounded to the model dtype first, as `hidden + attn_out` is.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from deepinfer.core.ops import dispatch
from deepinfer.kernels import rms_norm as kernels

OP = "rms_norm"


class NormCase(NamedTuple):
    devices: tuple[torch.device, ...]  # x's, the weight's, the residual's
    dtype: torch.dtype
    weight_dtype: torch.dtype
    hidden: int


def _reason(case: NormCase) -> str | None:
    return kernels.unsupported_reason(case.dtype, case.weight_dtype, case.hidden)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0,
                       residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight_offset:
        out = (normed * (weight_offset + weight.float())).type_as(x)
    else:
        out = weight * normed.to(x.dtype)
    return out, (x if residual is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., hidden] -> (normed, new residual): normed = RMSNorm(x + residual), new residual = x + residual.

    Without `residual` the second value is None. weight_offset is 1.0 for Gemma's `1 + weight`.
    """
    devices = (x.device, weight.device) if residual is None else (x.device, weight.device, residual.device)
    if dispatch.decide(OP, NormCase(devices, x.dtype, weight.dtype, x.shape[-1]), _reason, (x, weight, residual)):
        shape = x.shape
        out, summed = kernels.rms_norm(x.reshape(-1, shape[-1]), weight, eps, weight_offset,
                                       None if residual is None else residual.reshape(-1, shape[-1]))
        return out.view(shape), (None if summed is None else summed.view(shape))
    return rms_norm_reference(x, weight, eps, weight_offset, residual)
