"""Launcher of the W8A16 tensor-core product in w8_gemm.cu (1 to 64 tokens, SM80+; wgmma on SM90 from
WGMMA_MIN_TOKENS where it measured faster).

The kernel reads the 8-bit PackedWeight as stored (qweight int32 [N, K / 4], fp16 or fp32 scales and zeros
[N, K / G]): nothing is laid out at load. A launch is a CTA of 8 warps per 1-8 16-row tiles and per tile of 8, 16,
32 or 64 tokens (TT 8-token tiles); the warps that share a row tile split the CTA's K range. On SM90+ K is split
further across a thread-block cluster of up to MAX_SPLITS CTAs where the rows alone leave the GPU short of CTAs
(LAUNCHES says how, by token tiles).

On SM90, where uses_wgmma says (wide products beyond 32 tokens, long-K ones from WGMMA_MIN_TOKENS), w8_wgmma_kernel:
two warpgroups over 128 rows and a block of 16, 32, 48 or 64 tokens (the fewest that cover them, further blocks of
64 along grid.y), the 64-k stages split over a cluster of 4 or MAX_SPLITS CTAs (WgmmaPlan).
"""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

import torch

from deepinfer.kernels import w4_gemm
from deepinfer.kernels.compiler import get_kernel
from deepinfer.kernels.launch import clusters_available, i32, launch, product_operands, ptr
from deepinfer.kernels.quant_matmul import PackedOperands, packed_layout_reason

SOURCE = "w8_gemm.cu"
_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}
WARPS = 8
ROWS_PER_WARP = 16
SEGMENT = 64  # codes of K a warp multiplies per step
TOKEN_TILES = (1, 2, 4, 8)  # 8-token tiles per CTA
MAX_TOKENS = 8 * TOKEN_TILES[-1]  # one CTA column covers up to this many tokens; more run as further columns
ROW_WARP_CHOICES = (1, 2, 4, 8)  # 16-row tiles a CTA can own; its 8 warps then split K 8 / that many ways
MAX_SPLITS = 8  # the portable thread-block cluster size
# (row tiles a CTA, K splits) by 8-token tiles, the fastest of every row-tile count x 1, 2, 4, 8 splits on the H200
# (Qwen2.5-3B's and 7B's products, docs/KERNELS.md); the splits only where the CTAs of one split are fewer than
# SPLIT_BELOW_CTAS_PER_SM a multiprocessor (2048-3584 rows), one split where the rows alone fill the GPU
LAUNCHES = {1: (1, 2), 2: (4, 8), 4: (1, 2), 8: (1, 2)}
SPLIT_BELOW_CTAS_PER_SM = 2
MAX_IN_FEATURES = 1 << 16  # the group index's multiply-high is exact below this K (group_magic)
WGMMA_TOKEN_BLOCKS = (16, 32, 48, 64)  # tokens of a w8_wgmma_kernel CTA (its wgmma N)
WGMMA_ROWS = 128  # rows of a w8_wgmma_kernel CTA: two warpgroups of 64
WGMMA_MIN_TOKENS = 17  # the planned launch takes the wgmma path on SM90 from here at most (uses_wgmma)
WGMMA_MIN_OUT_FEATURES = 2048  # ... and only on products of more rows
WGMMA_WIDE_ROW_BLOCKS = 64  # up to this many 128-row blocks a product is split MAX_SPLITS ways, beyond 4 ways
WGMMA_MIN_STAGES = 2  # 64-k stages a split at least, so the register pipeline's two stages ahead are filled


class Plan(NamedTuple):
    """A launch: 8-token tiles and 16-row tiles a CTA, K splits (a cluster when more than one), segments a split."""

    tiles: int
    row_warps: int
    splits: int
    segs_per_split: int


class WgmmaPlan(NamedTuple):
    """A w8_wgmma_kernel launch: tokens a CTA (the wgmma N), K splits (a cluster when more than one), 64-k stages a
    split."""

    tokens: int
    splits: int
    stages_per_split: int


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


@cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def plan(num_tokens: int, in_features: int, out_features: int, device_index: int, tiles: int | None = None,
         row_warps: int | None = None, splits: int | None = None) -> Plan:
    """The launch of a product; `tiles`, `row_warps`, `splits` override the planned ones (validation, benchmarks).
    Splits need clusters (SM90+) and are cut to what K holds (a split has at least one K step)."""
    tiles = tiles or token_tiles(num_tokens)
    planned_rows, planned_splits = LAUNCHES[tiles]
    row_warps = row_warps or planned_rows
    if row_warps not in ROW_WARP_CHOICES:
        raise ValueError(f"row_warps {row_warps} is not one of {ROW_WARP_CHOICES}")
    k_warps = WARPS // row_warps
    segments = -(-in_features // SEGMENT)
    steps = -(-segments // k_warps)  # K steps of a CTA: a segment for each warp along K
    most = min(MAX_SPLITS, steps) if clusters_available(device_index) else 1
    if splits is None:
        ctas = -(-out_features // (ROWS_PER_WARP * row_warps)) * -(-num_tokens // (8 * tiles))
        splits = planned_splits if ctas < SPLIT_BELOW_CTAS_PER_SM * _num_sms(device_index) else 1
    splits = max(1, min(splits, most))
    # whole steps a split, so the warps of a CTA do equal work
    segs_per_split = -(-steps // splits) * k_warps
    return Plan(tiles, row_warps, -(-segments // segs_per_split), segs_per_split)


def wgmma_token_block(num_tokens: int) -> int:
    """Tokens of a wgmma CTA: the fewest of WGMMA_TOKEN_BLOCKS that cover the tokens, at most the last."""
    return next((block for block in WGMMA_TOKEN_BLOCKS if num_tokens <= block), WGMMA_TOKEN_BLOCKS[-1])


def wgmma_plan(num_tokens: int, in_features: int, out_features: int, device_index: int,
               tokens: int | None = None, splits: int | None = None) -> WgmmaPlan:
    """The wgmma launch of a product; `tokens` / `splits` override the planned ones (validation, benchmarks). The
    planned splits: MAX_SPLITS on products of at most WGMMA_WIDE_ROW_BLOCKS row blocks, 4 on wider ones, at least
    WGMMA_MIN_STAGES stages a split; an override is cut to one stage a split at least."""
    tokens = tokens or wgmma_token_block(num_tokens)
    if tokens not in WGMMA_TOKEN_BLOCKS:
        raise ValueError(f"tokens {tokens} is not one of {WGMMA_TOKEN_BLOCKS}")
    stages = -(-in_features // SEGMENT)
    if splits is None:  # the H200's fastest of 1, 2, 4, 8 splits on Qwen2.5-3B's and 7B's products at 16-64 tokens
        wide = -(-out_features // WGMMA_ROWS) > WGMMA_WIDE_ROW_BLOCKS
        splits = min(4 if wide else MAX_SPLITS, max(1, stages // WGMMA_MIN_STAGES))
    splits = max(1, min(splits, MAX_SPLITS, stages))
    stages_per_split = -(-stages // splits)
    return WgmmaPlan(tokens, -(-stages // stages_per_split), stages_per_split)


def group_magic(group_size: int) -> int:
    """ceil(2^32 / group_size): w8_gemm.cu's group of code k is umulhi(k, this), exact for k * group_size < 2^32."""
    return -(-(1 << 32) // group_size)


def kernel_name(dtype: torch.dtype, tiles: int, row_warps: int, zmode: int, scale_f32: bool) -> str:
    return f"w8_gemm_kernel<{_DTYPE_CODES[dtype]},{tiles},{row_warps},{zmode},{int(scale_f32)}>"


def wgmma_kernel_name(dtype: torch.dtype, tokens: int, zmode: int, scale_f32: bool) -> str:
    return f"w8_wgmma_kernel<{_DTYPE_CODES[dtype]},{tokens},{zmode},{int(scale_f32)}>"


def instantiations() -> tuple[str, ...]:
    """Every instantiation the launcher asks for (compiled ahead by validate-kernels)."""
    return (tuple(f"w8_gemm_kernel<{dt},{tiles},{rows},{zmode},{f32}>" for dt in (0, 1) for tiles in TOKEN_TILES
                  for rows in ROW_WARP_CHOICES for zmode in (0, 1, 2) for f32 in (0, 1))
            + tuple(f"w8_wgmma_kernel<{dt},{tokens},{zmode},{f32}>" for dt in (0, 1) for tokens in WGMMA_TOKEN_BLOCKS
                    for zmode in (0, 1, 2) for f32 in (0, 1)))


def uses_wgmma(num_tokens: int, in_features: int, out_features: int, device_index: int,
               wgmma: bool | None = None) -> bool:
    """Whether a product takes the wgmma path: `wgmma` if given, else (SM90) more than WGMMA_MIN_OUT_FEATURES rows
    and either more than 32 tokens, or WGMMA_MIN_TOKENS or more on a long K (K >= 4 N). Where the H200 measured
    w8_gemm_kernel faster: up to 16 tokens everywhere, up to 32 on short K, and 2048-row products at any token count
    (docs/KERNELS.md, the W8A16 section)."""
    if wgmma is None:
        wide = out_features > WGMMA_MIN_OUT_FEATURES
        many = num_tokens > 32 or (num_tokens >= WGMMA_MIN_TOKENS and in_features >= 4 * out_features)
        return wide and many and w4_gemm.wgmma_available(device_index)
    if wgmma and not w4_gemm.wgmma_available(device_index):
        raise ValueError("the W8 wgmma path needs an SM90 GPU")
    return wgmma


def w8_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
            zero_mode: str, integer_zeros: bool, bias: torch.Tensor | None = None, tiles: int | None = None,
            row_warps: int | None = None, splits: int | None = None, out: torch.Tensor | None = None,
            wgmma: bool | None = None, tokens: int | None = None) -> torch.Tensor:
    """x [M, K] fp16/bf16 (in input_perm order) -> [M, N] in x's dtype. `wgmma` picks the kernel (None: planned,
    uses_wgmma); `tiles`, `row_warps` (w8_gemm_kernel), `tokens` (w8_wgmma_kernel) and `splits` override the
    planned launch (validation, benchmarks)."""
    num_tokens, in_features = x.shape
    out_features = qweight.shape[0]
    if in_features > MAX_IN_FEATURES:
        raise ValueError(f"in_features {in_features} > {MAX_IN_FEATURES}: the W8 kernel's group index is exact below")
    x, bias, out = product_operands(x, bias, out_features, out)
    if num_tokens == 0:
        return out
    index = x.device.index
    zmode = zero_mode_code(zero_mode, integer_zeros)
    scale_f32 = scales.dtype == torch.float32
    if uses_wgmma(num_tokens, in_features, out_features, index, wgmma):
        wplan = wgmma_plan(num_tokens, in_features, out_features, index, tokens, splits)
        grid = (-(-out_features // WGMMA_ROWS), -(-num_tokens // wplan.tokens), wplan.splits)
        args = (ptr(x), ptr(qweight), ptr(scales), ptr(zeros), ptr(bias), ptr(out), i32(num_tokens),
                i32(out_features), i32(in_features), i32(group_size), i32(group_magic(group_size)),
                i32(wplan.stages_per_split))
        launch(get_kernel(SOURCE, wgmma_kernel_name(x.dtype, wplan.tokens, zmode, scale_f32), index), grid,
               (256, 1, 1), args, index, cluster=(1, 1, wplan.splits) if wplan.splits > 1 else None)
        return out
    launch_plan = plan(num_tokens, in_features, out_features, index, tiles, row_warps, splits)
    name = kernel_name(x.dtype, launch_plan.tiles, launch_plan.row_warps, zmode, scale_f32)
    grid = (-(-out_features // (ROWS_PER_WARP * launch_plan.row_warps)), -(-num_tokens // (8 * launch_plan.tiles)),
            launch_plan.splits)
    args = (ptr(x), ptr(qweight), ptr(scales), ptr(zeros), ptr(bias), ptr(out), i32(num_tokens), i32(out_features),
            i32(in_features), i32(group_size), i32(group_magic(group_size)), i32(launch_plan.segs_per_split))
    launch(get_kernel(SOURCE, name, index), grid, (256, 1, 1), args, index,
           cluster=(1, 1, launch_plan.splits) if launch_plan.splits > 1 else None)
    return out
