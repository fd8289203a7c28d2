"""Launcher of the W8A16 tensor-core product in w8_gemm.cu (1 to 64 tokens, SM80+).

The kernel reads the 8-bit PackedWeight as stored (qweight int32 [N, K / 4], fp16 or fp32 scales and zeros
[N, K / G]): nothing is laid out at load. A launch is a CTA of 8 warps per row_warps x row_tiles 16-row tiles and
per tile of 8, 16, 32 or 64 tokens (TT 8-token tiles), its activations staged in shared memory a K step at a time
(a ring of `depth` stages); the warps that share row tiles split the CTA's K range. On SM90+ K is split further
across a thread-block cluster of up to MAX_SPLITS CTAs where the rows alone leave the GPU short of CTAs (LAUNCHES
says how, by token tiles).
"""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

import torch

from deepinfer.kernels.compiler import get_kernel
from deepinfer.kernels.launch import clusters_available, i32, launch, product_operands, ptr
from deepinfer.kernels.quant_matmul import PackedOperands, packed_layout_reason

SOURCE = "w8_gemm.cu"
_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}
WARPS = 8
ROWS_PER_TILE = 16
SEGMENT = 64  # codes of K a warp multiplies per step
TOKEN_TILES = (1, 2, 4, 8)  # 8-token tiles per CTA
MAX_TOKENS = 8 * TOKEN_TILES[-1]  # one CTA column covers up to this many tokens; more run as further columns
ROW_WARP_CHOICES = (1, 2, 4, 8)  # warps along the rows of a CTA; its 8 warps then split K 8 / that many ways
ROW_TILE_CHOICES = (1, 2, 4)  # 16-row tiles a warp
MAX_ACCUMULATOR_TILES = 8  # row tiles x token tiles a warp: two fp32 sums of 4 a tile (total and group) in registers
DEPTH_CHOICES = (2, 3, 4)  # activation stages in shared memory
MAX_SPLITS = 8  # the portable thread-block cluster size


class Launch(NamedTuple):
    """The shape of a CTA and where K is split: warps along the rows, 16-row tiles a warp, K splits a cluster
    (where the rows alone leave the GPU short of CTAs), activation stages."""

    row_warps: int
    row_tiles: int
    splits: int
    depth: int


# By 8-token tiles: rows a CTA (16 row_warps row_tiles) large enough that the activations it stages are at most
# the weight bytes it streams from 32 tokens on; K split in a cluster where one split's CTAs are fewer than
# SPLIT_BELOW_CTAS_PER_SM a multiprocessor (2048-3584 rows), one split where the rows alone fill the GPU
LAUNCHES = {1: Launch(1, 1, 2, 2), 2: Launch(4, 1, 8, 2), 4: Launch(4, 2, 4, 3), 8: Launch(8, 1, 4, 3)}
SPLIT_BELOW_CTAS_PER_SM = 2
MAX_IN_FEATURES = 1 << 16  # the group index's multiply-high is exact below this K (group_magic)


class Plan(NamedTuple):
    """A launch: 8-token tiles a CTA, warps along its rows, 16-row tiles a warp, activation stages, K splits (a
    cluster when more than one), segments a split."""

    tiles: int
    row_warps: int
    row_tiles: int
    depth: int
    splits: int
    segs_per_split: int

    @property
    def rows(self) -> int:
        return ROWS_PER_TILE * self.row_warps * self.row_tiles

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory: the activation stages (8 tiles x 64 codes x 2 bytes each of the 8 / row_warps
        warps along K), or the warps' fp32 partial sums after the loop, whichever is larger (w8_gemm.cu)."""
        stages = self.depth * (WARPS // self.row_warps) * 8 * self.tiles * SEGMENT * 2
        partials = WARPS * self.row_tiles * self.tiles * 4 * 32 * 4
        return max(stages, partials)


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


@cache
def _max_shared_bytes(device_index: int) -> int:
    import cupy

    return cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                                device_index)


def plan(num_tokens: int, in_features: int, out_features: int, device_index: int, tiles: int | None = None,
         row_warps: int | None = None, splits: int | None = None, row_tiles: int | None = None,
         depth: int | None = None) -> Plan:
    """The launch of a product; `tiles`, `row_warps`, `splits`, `row_tiles`, `depth` override the planned ones
    (validation, benchmarks). Splits need clusters (SM90+) and are cut to what K holds (a split has at least one K
    step); a launch whose shared memory the device lacks has fewer stages (down to DEPTH_CHOICES[0])."""
    tiles = tiles or token_tiles(num_tokens)
    planned = LAUNCHES[tiles]
    row_warps = row_warps or planned.row_warps
    row_tiles = row_tiles or planned.row_tiles
    depth = depth or planned.depth
    if row_warps not in ROW_WARP_CHOICES:
        raise ValueError(f"row_warps {row_warps} is not one of {ROW_WARP_CHOICES}")
    if row_tiles not in ROW_TILE_CHOICES or row_tiles * tiles > MAX_ACCUMULATOR_TILES:
        raise ValueError(f"row_tiles {row_tiles} at {tiles} token tiles: one of {ROW_TILE_CHOICES}, and row tiles "
                         f"x token tiles at most {MAX_ACCUMULATOR_TILES}")
    if depth not in DEPTH_CHOICES:
        raise ValueError(f"depth {depth} is not one of {DEPTH_CHOICES}")
    k_warps = WARPS // row_warps
    segments = -(-in_features // SEGMENT)
    steps = -(-segments // k_warps)  # K steps of a CTA: a segment for each warp along K
    most = min(MAX_SPLITS, steps) if clusters_available(device_index) else 1
    if splits is None:
        rows = ROWS_PER_TILE * row_warps * row_tiles
        ctas = -(-out_features // rows) * -(-num_tokens // (8 * tiles))
        splits = planned.splits if ctas < SPLIT_BELOW_CTAS_PER_SM * _num_sms(device_index) else 1
    splits = max(1, min(splits, most))
    # whole steps a split, so the warps of a CTA do equal work
    segs_per_split = -(-steps // splits) * k_warps
    launch_plan = Plan(tiles, row_warps, row_tiles, depth, -(-segments // segs_per_split), segs_per_split)
    while launch_plan.depth > DEPTH_CHOICES[0] and launch_plan.shared_bytes > _max_shared_bytes(device_index):
        launch_plan = launch_plan._replace(depth=launch_plan.depth - 1)
    return launch_plan


def group_magic(group_size: int) -> int:
    """ceil(2^32 / group_size): w8_gemm.cu's group of code k is umulhi(k, this), exact for k * group_size < 2^32."""
    return -(-(1 << 32) // group_size)


def kernel_name(dtype: torch.dtype, launch_plan: Plan, zmode: int, scale_f32: bool) -> str:
    return (f"w8_gemm_kernel<{_DTYPE_CODES[dtype]},{launch_plan.tiles},{launch_plan.row_warps},"
            f"{launch_plan.row_tiles},{launch_plan.depth},{zmode},{int(scale_f32)}>")


def instantiations() -> tuple[str, ...]:
    """The launches of LAUNCHES for both dtypes, zero modes and scale types (compiled ahead by validate-kernels);
    overrides compile on first use."""
    return tuple(f"w8_gemm_kernel<{dt},{tiles},{launch.row_warps},{launch.row_tiles},{launch.depth},{zmode},{f32}>"
                 for dt in (0, 1) for tiles, launch in LAUNCHES.items() for zmode in (0, 1, 2) for f32 in (0, 1))


_configured: set[tuple[str, int]] = set()


def _kernel(name: str, shared_bytes: int, device_index: int):
    """The compiled kernel, allowed the dynamic shared memory of its launches (beyond 48 KiB a kernel must ask)."""
    import cupy

    fn = get_kernel(SOURCE, name, device_index)
    if (name, device_index) not in _configured:
        with cupy.cuda.Device(device_index):
            fn.max_dynamic_shared_size_bytes = shared_bytes
        _configured.add((name, device_index))
    return fn


def w8_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
            zero_mode: str, integer_zeros: bool, bias: torch.Tensor | None = None, tiles: int | None = None,
            row_warps: int | None = None, splits: int | None = None, out: torch.Tensor | None = None,
            row_tiles: int | None = None, depth: int | None = None) -> torch.Tensor:
    """x [M, K] fp16/bf16 (in input_perm order) -> [M, N] in x's dtype. `tiles`, `row_warps`, `splits`,
    `row_tiles`, `depth` override the planned launch (validation, benchmarks)."""
    num_tokens, in_features = x.shape
    out_features = qweight.shape[0]
    if in_features > MAX_IN_FEATURES:
        raise ValueError(f"in_features {in_features} > {MAX_IN_FEATURES}: the W8 kernel's group index is exact below")
    if num_tokens * in_features >= 1 << 32:
        raise ValueError(f"{num_tokens} x {in_features} activations: the W8 kernel addresses them in 32 bits")
    x, bias, out = product_operands(x, bias, out_features, out)
    if num_tokens == 0:
        return out
    index = x.device.index
    launch_plan = plan(num_tokens, in_features, out_features, index, tiles, row_warps, splits, row_tiles, depth)
    name = kernel_name(x.dtype, launch_plan, zero_mode_code(zero_mode, integer_zeros), scales.dtype == torch.float32)
    grid = (-(-out_features // launch_plan.rows), -(-num_tokens // (8 * launch_plan.tiles)), launch_plan.splits)
    args = (ptr(x), ptr(qweight), ptr(scales), ptr(zeros), ptr(bias), ptr(out), i32(num_tokens), i32(out_features),
            i32(in_features), i32(group_size), i32(group_magic(group_size)), i32(launch_plan.segs_per_split))
    launch(_kernel(name, launch_plan.shared_bytes, index), grid, (256, 1, 1), args, index,
           shared_mem=launch_plan.shared_bytes,
           cluster=(1, 1, launch_plan.splits) if launch_plan.splits > 1 else None)
    return out
