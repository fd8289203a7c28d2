"""Random 4-bit packed weights for the W4 GEMM's tests (CPU layout checks and GPU products alike)."""

from __future__ import annotations

import torch

from deepinfer.core.quant.packed import PackedWeight
from deepinfer.core.quant.packing import pack_weight


def random_w4_weight(out_features: int, in_features: int, group_size: int, zero_mode: str, integer_zeros: bool,
                     seed: int = 0) -> PackedWeight:
    """Codes uniform in 0..15, scales in [0.005, 0.025); zero points integer 0..15 (+0.25 when not integer_zeros)
    for zero_mode "zero", or small negative offsets for "min"."""
    generator = torch.Generator().manual_seed(seed)
    groups = in_features // group_size
    codes = torch.randint(0, 16, (out_features, in_features), generator=generator)
    scales = (torch.rand(out_features, groups, generator=generator) * 0.02 + 0.005).half()
    if zero_mode == "zero":
        zeros = torch.randint(0, 16, (out_features, groups), generator=generator).half()
        if not integer_zeros:
            zeros = zeros + 0.25
    else:
        zeros = (-torch.rand(out_features, groups, generator=generator) * 0.1).half()
    return pack_weight(codes, scales, zeros, 4, zero_mode)
