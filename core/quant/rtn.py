"""Round-to-nearest (RTN) weight quantization to a PackedWeight, and its error against the source.

Asymmetric (default): per group, scale = (max - min) / (2**bits - 1) and an integer zero point
round(-min / scale), so the group's range (widened to hold 0.0) maps onto all 2**bits codes.
Symmetric: scale = absmax / (2**(bits-1) - 1) and zero point 2**(bits-1), so 0.0 is exact.
Scales are rounded to fp16 before the codes are chosen, so the codes fit the scales that are stored.
Bits 3, 4 or 8 (zero points up to 255 are fp16-exact).
"""

from __future__ import annotations

import torch

from deepinfer.core.quant.packed import SUPPORTED_BITS, PackedWeight
from deepinfer.core.quant.packing import dequantize, pack_weight

_FP16_MAX = float(torch.finfo(torch.float16).max)


def quantize_rtn(
    weight: torch.Tensor,
    bits: int = 4,
    group_size: int = 128,
    sym: bool = False,
    bias: torch.Tensor | None = None,
) -> PackedWeight:
    """weight [N, K] float -> PackedWeight (zero_mode "zero", fp16 scales); group_size -1 or K = per-channel."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"RTN supports 3, 4 or 8 bits, got {bits}")
    out_features, in_features = weight.shape
    group_size = in_features if group_size in (-1, 0) else group_size
    if in_features % group_size:
        raise ValueError(f"group size {group_size} does not divide the {in_features} input features")
    groups = weight.to(torch.float32).reshape(out_features, in_features // group_size, group_size)
    if not torch.isfinite(groups).all():
        raise ValueError("weight holds NaN or infinite values")
    max_code = 2**bits - 1
    if sym:
        scales = groups.abs().amax(dim=-1) / (2 ** (bits - 1) - 1)  # [N, G]
    else:
        # the range always holds 0.0, as in GPTQ, so the integer zero point lies in [0, 2**bits)
        low = groups.amin(dim=-1).clamp(max=0.0)  # [N, G]
        high = groups.amax(dim=-1).clamp(min=0.0)
        scales = (high - low) / max_code
    if scales.max() > _FP16_MAX:
        raise ValueError("weight values are too large for fp16 group scales")
    scales = scales.to(torch.float16).to(torch.float32)
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)  # a constant group: any scale is exact
    if sym:
        zeros = torch.full_like(scales, 2 ** (bits - 1))
    else:
        zeros = torch.clamp(torch.round(-low / scales), 0, max_code)
    codes = torch.clamp(torch.round(groups / scales[..., None]) + zeros[..., None], 0, max_code)
    return pack_weight(
        codes.reshape(out_features, in_features).to(torch.int32),
        scales.to(torch.float16),
        zeros.to(torch.float16),
        bits,
        bias=bias,
    )


def default_group_size(in_features: int, preferred: int = 128) -> int:
    """The largest of `preferred`, 64 and 32 that divides `in_features` (576 -> 64 for preferred 128)."""
    for group_size in (preferred, 64, 32):
        if group_size <= preferred and in_features % group_size == 0:
            return group_size
    raise ValueError(f"{in_features} input features are not a multiple of 32, which packing needs")


def quantization_error(reference: torch.Tensor, packed: PackedWeight) -> tuple[float, float]:
    """(max, mean) absolute difference between `reference` [N, K] and the dequantized `packed`."""
    diff = (dequantize(packed, torch.float32) - reference.to(torch.float32)).abs()
    return float(diff.max()), float(diff.mean())
