"""Launcher of the W8A16 tensor-core product in w8_gemm.cu (1 to 64 tokens, SM80+).

The kernel reads the 8-bit PackedWeight as stored (qweight int32 [N, K / 4], fp16 or fp32 scales and zeros
[N, K / G]): nothing is laid out at load. A launch is a CTA per 16 output rows and per tile of 8, 16, 32 or 64
tokens (TT 8-token tiles); within a CTA 8 warps split K.
"""

from __future__ import annotations

import torch

from deepinfer.kernels.compiler import get_kernel
from deepinfer.kernels.launch import i32, launch, product_operands, ptr
from deepinfer.kernels.quant_matmul import PackedOperands, packed_layout_reason

SOURCE = "w8_gemm.cu"
_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}
ROWS_PER_CTA = 16
TOKEN_TILES = (1, 2, 4, 8)  # 8-token tiles per CTA
MAX_TOKENS = 8 * TOKEN_TILES[-1]  # one CTA column covers up to this many tokens; more run as further columns


def unsupported_reason(dtype: torch.dtype, weight: PackedOperands) -> str | None:
    """Why the kernel cannot multiply `dtype` activations by this weight (None when it can)."""
    if dtype not in _DTYPE_CODES:
        return f"activation dtype {dtype} (the kernel takes float16/bfloat16)"
    reason = packed_layout_reason(weight, (8,))
    if reason:
        return reason
    if not weight.aligned:
        return "qweight not 16-byte aligned"
    return None


def zero_mode_code(zero_mode: str, integer_zeros: bool) -> int:
    """ZMODE of w8_gemm.cu: 0 whole zero points, 1 "min", 2 zero points that are not whole numbers."""
    if zero_mode == "min":
        return 1
    return 0 if integer_zeros else 2


def token_tiles(num_tokens: int) -> int:
    """8-token tiles per CTA: the fewest that cover the tokens, at most TOKEN_TILES[-1]."""
    return next((tiles for tiles in TOKEN_TILES if num_tokens <= 8 * tiles), TOKEN_TILES[-1])


def kernel_name(dtype: torch.dtype, tiles: int, zmode: int, scale_f32: bool) -> str:
    return f"w8_gemm_kernel<{_DTYPE_CODES[dtype]},{tiles},{zmode},{int(scale_f32)}>"


def instantiations() -> tuple[str, ...]:
    """Every instantiation the launcher asks for (compiled ahead by validate-kernels)."""
    return tuple(f"w8_gemm_kernel<{dt},{tiles},{zmode},{f32}>" for dt in (0, 1) for tiles in TOKEN_TILES
                 for zmode in (0, 1, 2) for f32 in (0, 1))


def w8_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
            zero_mode: str, integer_zeros: bool, bias: torch.Tensor | None = None,
            tiles: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp16/bf16 (in input_perm order) -> [M, N] in x's dtype. `tiles` overrides the 8-token tiles per
    CTA (validation)."""
    num_tokens, in_features = x.shape
    out_features = qweight.shape[0]
    x, bias, out = product_operands(x, bias, out_features, out)
    if num_tokens == 0:
        return out
    tiles = tiles or token_tiles(num_tokens)
    index = x.device.index
    name = kernel_name(x.dtype, tiles, zero_mode_code(zero_mode, integer_zeros), scales.dtype == torch.float32)
    grid = (-(-out_features // ROWS_PER_CTA), -(-num_tokens // (8 * tiles)), 1)
    args = (ptr(x), ptr(qweight), ptr(scales), ptr(zeros), ptr(bias), ptr(out), i32(num_tokens), i32(out_features),
            i32(in_features), i32(group_size))
    launch(get_kernel(SOURCE, name, index), grid, (256, 1, 1), args, index)
    return out
