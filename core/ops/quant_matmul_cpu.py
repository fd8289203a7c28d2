"""quant_matmul on the CPU: y = x @ W.T (+ bias) for a PackedWeight, its weight laid out once, never per step.

The layouts, chosen by DEEPINFER_CPU_WEIGHTS (`packed`, the default, `int4` or `dense`):

  packed  torch's CPU int4 matmul (`aten._weight_int4pack_mm_for_cpu`, the tinygemm layout). It computes
          W[n, k] = (c - 8) * S[g, n, 0] + S[g, n, 1] from unsigned 4-bit codes c and a scale/zero pair per group,
          so both of deepinfer's zero modes map exactly onto it:
              "zero": (q - z) * s = (q - 8) * s + (8 - z) * s      "min": q * s + m = (q - 8) * s + (m + 8 * s)
          3-bit codes (0..7) are 4-bit codes too, so W3 weights take it as well. Its vectorized path needs
          bfloat16 activations (fp32 and fp16 take a scalar loop tens of times slower), so activations, scales
          and zeros are rounded to bf16 and the fp32 result cast back: each product carries bf16 rounding
          (within 2**-7 of sum |x| (|w| + |zero term|), tests/test_quant_matmul_cpu.py), fp32 accumulation. Group sizes
          the kernel lacks (it takes 32, 64, 128, 256) are served with the largest of those dividing the group,
          the scale pair repeated: the same weight. It needs out_features % 16 == 0.
          `packed` serves products of fewer than DENSE_PREFILL_TOKENS rows (decode steps) this way and longer
          ones (prefill chunks) with a bf16 copy of the dequantized weight, made once, through the bf16 GEMM
          (2-3x the int4 kernel's speed there, at 2 more bytes per weight); `int4` keeps to the int4 kernel.
  dense   the weight dequantized once (core/quant/packing.py: dequantize, the reference's bits), then a plain
          matmul in the activations' dtype: the reference's results, at 32 / bits times the weight memory.

8-bit weights and shapes the int4 kernel cannot take are dense (fp32) in every mode. The layout is made on a weight's
first CPU product and kept while its buffers live and are not written in place (their `_version` is checked).
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

import torch

from deepinfer.core.quant.packed import PackedWeight
from deepinfer.core.quant.packing import dequantize, unpack_codes

CPU_WEIGHTS_ENV = "DEEPINFER_CPU_WEIGHTS"
CPU_WEIGHT_MODES = ("packed", "int4", "dense")
DENSE_PREFILL_TOKENS = 64  # packed mode: products of this many rows or more take the bf16 dense copy
INT4_GROUP_SIZES = (256, 128, 64, 32)  # what _weight_int4pack_mm_for_cpu takes, largest first
INT4_CODE_OFFSET = 8  # the kernel's codes are c - 8
_INNER_K_TILES = 2  # the CPU layout ignores it; the op's signature wants one


def cpu_weights_mode() -> str:
    """DEEPINFER_CPU_WEIGHTS: 'packed' (default), 'int4' or 'dense'; anything else is an error, not a default."""
    mode = os.environ.get(CPU_WEIGHTS_ENV, "").strip().lower() or "packed"
    if mode not in CPU_WEIGHT_MODES:
        raise ValueError(f"{CPU_WEIGHTS_ENV} must be packed, int4 or dense, got {os.environ[CPU_WEIGHTS_ENV]!r}")
    return mode


def int4_group_size(packed: PackedWeight) -> int | None:
    """The kernel group size that serves this weight, or None when the int4 kernel cannot take it."""
    if packed.bits not in (3, 4) or packed.out_features % 16:
        return None
    return next((g for g in INT4_GROUP_SIZES if packed.group_size % g == 0), None)


@dataclass(frozen=True)
class CpuWeight:
    """A PackedWeight laid out for CPU products.

    int4: weight uint8 [N, K / 2] (the kernel's layout), scales_and_zeros bf16 [K / g, N, 2], group_size g.
    dense: weight [N, K] in the activations' dtype, original input order; scales_and_zeros None.
    """

    weight: torch.Tensor
    scales_and_zeros: torch.Tensor | None
    group_size: int
    input_perm: torch.Tensor | None  # int64 [K] (int4 only: the dense weight is already unpermuted)
    versions: tuple[int, ...]  # the source buffers' _version when laid out

    @property
    def is_int4(self) -> bool:
        return self.scales_and_zeros is not None


def int4_layout(packed: PackedWeight) -> CpuWeight:
    """The int4 kernel's operands for a 3- or 4-bit weight that int4_group_size serves."""
    group = int4_group_size(packed)
    if group is None:
        raise ValueError(f"the CPU int4 kernel cannot take a {packed.bits}-bit {packed.out_features} x "
                         f"{packed.in_features} weight with group size {packed.group_size}")
    codes = unpack_codes(packed.qweight, packed.bits)  # int32 [N, K], stored (input_perm) order
    weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), _INNER_K_TILES)  # uint8 [N, K/2]
    scales, zeros = packed.scales.to(torch.float32), packed.zeros.to(torch.float32)  # [N, K / G]
    if packed.zero_mode == "zero":
        offsets = (INT4_CODE_OFFSET - zeros) * scales
    else:
        offsets = zeros + INT4_CODE_OFFSET * scales
    pairs = torch.stack((scales, offsets), dim=-1)  # [N, K / G, 2]
    pairs = pairs.repeat_interleave(packed.group_size // group, dim=1)  # [N, K / g, 2]
    pairs = pairs.transpose(0, 1).contiguous().to(torch.bfloat16)  # [K / g, N, 2]
    perm = None if packed.input_perm is None else packed.input_perm.to(torch.int64)
    return CpuWeight(weight, pairs, group, perm, _versions(packed))


def dense_layout(packed: PackedWeight, dtype: torch.dtype) -> CpuWeight:
    return CpuWeight(dequantize(packed, dtype).contiguous(), None, packed.group_size, None, _versions(packed))


def _versions(packed: PackedWeight) -> tuple[int, ...]:
    return tuple(t._version for t in (packed.qweight, packed.scales, packed.zeros))


# id(qweight) -> (weakref to qweight, {(mode, dtype): CpuWeight}); an entry leaves with its qweight
_layouts: dict[int, tuple[weakref.ref, dict[tuple[str, torch.dtype], CpuWeight]]] = {}


def cpu_weight(packed: PackedWeight, dtype: torch.dtype, mode: str | None = None, rows: int = 1) -> CpuWeight:
    """The layout `mode` (default: DEEPINFER_CPU_WEIGHTS) gives this weight for a product of `rows` rows of
    `dtype` activations, made once."""
    mode = mode or cpu_weights_mode()
    if mode in ("packed", "int4") and int4_group_size(packed) is None:
        mode = "dense"
    elif mode == "packed" and rows >= DENSE_PREFILL_TOKENS:
        mode, dtype = "dense", torch.bfloat16
    elif mode == "packed":
        mode = "int4"
    key = id(packed.qweight)
    entry = _layouts.get(key)
    if entry is None or entry[0]() is not packed.qweight:
        ref = weakref.ref(packed.qweight, lambda _, key=key: _layouts.pop(key, None))
        entry = _layouts[key] = (ref, {})
    per_mode = entry[1]
    layout_key = (mode, torch.bfloat16 if mode == "int4" else dtype)
    layout = per_mode.get(layout_key)
    if layout is None or layout.versions != _versions(packed):
        layout = per_mode[layout_key] = int4_layout(packed) if mode == "int4" else dense_layout(packed, dtype)
    return layout


def quant_matmul_cpu(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """x [..., K] on the CPU -> [..., N] in x's dtype, through the weight's CPU layout (see the module doc)."""
    rows = x.reshape(-1, packed.in_features)  # [M, K]
    layout = cpu_weight(packed, x.dtype, rows=rows.shape[0])
    if layout.is_int4:
        if layout.input_perm is not None:
            rows = rows.index_select(1, layout.input_perm)  # stored column j multiplies x[input_perm[j]]
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows.to(torch.bfloat16).contiguous(), layout.weight, layout.group_size, layout.scales_and_zeros)
        out = out.to(x.dtype)  # [M, N]
    else:
        out = (rows.to(layout.weight.dtype) @ layout.weight.T).to(x.dtype)  # [M, N]
    if packed.bias is not None:
        out = out + packed.bias.to(x.dtype)
    return out.view(*x.shape[:-1], packed.out_features)
