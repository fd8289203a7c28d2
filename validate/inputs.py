"""Random inputs of the kernel checks: packed weights (any bits, zero mode, scale dtype, act order), the tc kernels'
weights with named kinds of zero points, and RoPE tables. Paged KV caches come from core/bench/paged_kv.py."""

from __future__ import annotations

from dataclasses import replace

import torch

from deepinfer.core.quant.packing import pack_weight


def random_packed(out_features: int, in_features: int, group_size: int, bits: int, zero_mode: str,
                  scale_dtype: torch.dtype, device, act_order: bool = False, bias_dtype: torch.dtype | None = None):
    """A PackedWeight with uniform random codes, positive scales, integer ("zero") or float ("min") zeros."""
    groups = in_features // group_size
    codes = torch.randint(0, 2**bits, (out_features, in_features), device=device)
    scales = (torch.rand(out_features, groups, device=device) * 0.02 + 0.005).to(scale_dtype)
    if zero_mode == "zero":
        zeros = torch.randint(0, 2**bits, (out_features, groups), device=device).to(scale_dtype)
    else:
        zeros = (-(2 ** (bits - 1)) * scales.float() * (0.5 + torch.rand_like(scales.float()))).to(scale_dtype)
    perm = torch.randperm(in_features, device=device) if act_order else None
    bias = torch.randn(out_features, device=device).to(bias_dtype) if bias_dtype is not None else None
    return pack_weight(codes, scales, zeros, bits, zero_mode, input_perm=perm, bias=bias)


def tc_case_weight(out_features: int, in_features: int, group_size: int, zeros_kind: str, f32_scales: bool,
                   bias_dtype: torch.dtype | None, device):
    """A random W4 PackedWeight with the zero points a tc case names ("int", "frac" or "min"; see TC_CASES)."""
    zero_mode = "min" if zeros_kind == "min" else "zero"
    packed = random_packed(out_features, in_features, group_size, 4, zero_mode,
                           torch.float32 if f32_scales else torch.float16, device, bias_dtype=bias_dtype)
    if zeros_kind == "frac":
        packed = replace(packed, zeros=(packed.zeros.float() + 0.37).to(packed.zeros.dtype))
    assert packed.integer_zeros == (zeros_kind == "int"), "the case's zero points are not what it says"
    return packed


def w8_case_weight(out_features: int, in_features: int, group_size: int, zeros_kind: str, f32_scales: bool,
                   bias_dtype: torch.dtype | None, device):
    """A random 8-bit PackedWeight with the zero points a W8 case names (validate/quant_matmul_checks.py W8_CASES)."""
    scale_dtype = torch.float32 if f32_scales else torch.float16
    packed = random_packed(out_features, in_features, group_size, 8, "min" if zeros_kind == "min" else "zero",
                           scale_dtype, device, bias_dtype=bias_dtype)
    if zeros_kind == "q8_0":
        packed = replace(packed, zeros=torch.full_like(packed.zeros, 128.0))
    elif zeros_kind == "frac":
        packed = replace(packed, zeros=(packed.zeros.float() + 0.37).to(scale_dtype))
    return packed


def rope_tables(num_tokens: int, head_dim: int, dtype: torch.dtype, device):
    """cos/sin [T, D/2] of random positions (base 10000), in `dtype`."""
    positions = torch.randint(0, 4096, (num_tokens,), device=device).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = positions[:, None] * inv_freq[None, :]  # [T, D/2]
    return angles.cos().to(dtype), angles.sin().to(dtype)

