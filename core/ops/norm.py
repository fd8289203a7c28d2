"""RMSNorm with an optional fused residual add: kernel when one serves the case, torch otherwise.

Numerics are the decoder's (core/models/layers.RMSNorm): Llama normalizes in fp32, casts back, then
scales by the weight in the model dtype; Gemma (weight_offset 1.0) computes `x * (1 + w)` in fp32.
With a residual, the sum `x + residual` is rounded to the model dtype first, as `hidden + attn_out` is.
"""

from __future__ import annotations

import torch

from deepinfer.core.ops import dispatch


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
    from deepinfer.kernels import registry

    op = registry.get("rms_norm")
    key = (x.device, x.dtype, x.shape[-1], weight.device, weight.dtype, None if residual is None else residual.device)
    if dispatch.decide(op.name, key, lambda: dispatch.kernel_blocker(x, weight, residual)
                       or op.unsupported_reason(x, weight)):
        shape = x.shape
        out, summed = op.launch(x.reshape(-1, shape[-1]), weight, eps, weight_offset,
                                None if residual is None else residual.reshape(-1, shape[-1]))
        return out.view(shape), (None if summed is None else summed.view(shape))
    return rms_norm_reference(x, weight, eps, weight_offset, residual)
