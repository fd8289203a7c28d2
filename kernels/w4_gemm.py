"""Launcher of the W4A16 tensor-core GEMM in w4_gemm.cu (batches of 9 to 256 tokens, SM80+).

The kernel reads the packed codes as PackedWeight stores them (qweight int32 [N, K / 8]) and its group scales
and zero terms as `gemm_scales` lays them out once per weight and activation dtype: for each 16-row tile and
group, 8 (scale pair, zero pair) entries whose pairs hold rows g and g + 8, in the activation dtype, which is
what one thread's mma fragment needs in one 8-byte load. That tensor is as large as the fp16 scales and zeros
together (N x K / G x 4 bytes).

A launch is planned from (tokens, N, K): `TileConfig` (warps, 16-row tiles per warp, 8-token tiles per CTA,
pipeline stages) and the number of K splits; the split-K partials and counters are the ones the other
split-K kernels use (quant_matmul.py), so they are allocated once per device.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from deepinfer.kernels.compiler import get_kernel
from deepinfer.kernels.launch import i32, launch, planned_launch, product_operands, ptr
from deepinfer.kernels.quant_matmul import _num_sms, split_k_buffers

SOURCE = "w4_gemm.cu"
_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}
# (1024 + q) in fp16 and (128 + q) in bf16 come from OR-ing a code into these exponents (w4_gemm.cu)
_MAGIC = {torch.float16: 1024.0, torch.bfloat16: 128.0}
BK = 128  # k per pipeline stage
_MAX_GROUPS = BK // 32  # groups a stage can touch (group sizes are multiples of 32)
NARROW_OUT = 4608  # outputs up to which `plan` takes 64-row CTAs at up to 32 tokens


@dataclass(frozen=True)
class TileConfig:
    """An mma.sync launch shape (w4_gemm_kernel<..., false, ...>, SM80+)."""

    warps: int  # warps per CTA
    rw: int  # 16-row weight tiles per warp
    tt: int  # 8-token tiles per CTA (every warp multiplies all of them)
    stages: int  # cp.async pipeline depth

    @property
    def rows(self) -> int:
        return self.warps * self.rw * 16

    @property
    def tokens(self) -> int:
        return self.tt * 8

    @property
    def threads(self) -> int:
        return self.warps * 32

    @property
    def shared_bytes(self) -> int:
        return self.stages * (self.tokens * BK * 2 + self.rows * BK // 2 + self.rows // 16 * _MAX_GROUPS * 64)

    @property
    def label(self) -> str:
        """How sweeps and docs name the shape: mma<warps,rw,tt,stages>."""
        return f"mma<{self.warps},{self.rw},{self.tt},{self.stages}>"

    def name(self, dt: int, zmode: int) -> str:
        return f"w4_gemm_kernel<{dt},{zmode},false,{self.warps},{self.rw},{self.tt},{self.stages}>"


@dataclass(frozen=True)
class WgmmaConfig:
    """A wgmma launch shape (w4_gemm_kernel<..., true, ...>, SM90a)."""

    wg: int  # warpgroups per CTA
    mt: int  # 64-row tiles per warpgroup
    ntok: int  # tokens per CTA: the wgmma N (16, 32, 64, or 64-wide sub-tiles up to 256)
    stages: int

    @property
    def rows(self) -> int:
        return self.wg * self.mt * 64

    @property
    def tokens(self) -> int:
        return self.ntok

    @property
    def threads(self) -> int:
        return self.wg * 128

    @property
    def shared_bytes(self) -> int:
        stage = self.ntok * BK * 2 + self.rows * BK // 2 + self.rows // 16 * _MAX_GROUPS * 64
        return self.stages * (-(-stage // 1024) * 1024) + 1024  # + 1 KiB to align the swizzled blocks

    @property
    def label(self) -> str:
        """How sweeps and docs name the shape: wgmma<wg,mt,ntok,stages>."""
        return f"wgmma<{self.wg},{self.mt},{self.ntok},{self.stages}>"

    def name(self, dt: int, zmode: int) -> str:
        return f"w4_gemm_kernel<{dt},{zmode},true,{self.wg},{self.mt},{self.ntok},{self.stages}>"


def unsupported_reason(x: torch.Tensor, qweight: torch.Tensor, bits: int, group_size: int) -> str | None:
    """Why the GEMM cannot compute x @ W.T for this weight (None when it can)."""
    if bits != 4:
        return f"{bits}-bit weights (the GEMM reads 4-bit codes)"
    if x.dtype not in _DTYPE_CODES:
        return f"activation dtype {x.dtype} (the GEMM takes float16/bfloat16)"
    if not qweight.is_contiguous():
        return "non-contiguous packed weight"
    if group_size % 32:
        return f"group size {group_size} (the GEMM takes multiples of 32)"
    return None


def gemm_scales(scales: torch.Tensor, zeros: torch.Tensor, zero_mode: str, dtype: torch.dtype
                ) -> tuple[torch.Tensor, int]:
    """PackedWeight scales / zeros [N, G] -> (sz int32 [ceil(N / 16), G, 8, 2], zmode) for `dtype` activations.

    sz[tile, group, g] = (scale pair, zero pair), each pair (row 16 tile + g, row 16 tile + g + 8) in `dtype`.
    zmode 0: W = (q - z) * s with integer z, stored as -(magic + z) (exact in both dtypes for 4-bit zeros);
    zmode 1: W = q * s + m ("min" mode, or a zero point that is not a whole number: m = -z * s).
    Rows past N (the last tile's padding) get scale 0, so they contribute nothing.
    """
    out_features, num_groups = scales.shape
    s = scales.to(torch.float64)
    z = zeros.to(torch.float64)
    if zero_mode == "zero" and torch.equal(z, torch.round(z)):
        zmode, term, pad_term = 0, -(z + _MAGIC[dtype]), -_MAGIC[dtype]
    else:
        zmode, term, pad_term = 1, (z if zero_mode == "min" else -z * s), 0.0
    tiles = -(-out_features // 16)
    padded = tiles * 16 - out_features
    if padded:
        s = torch.cat([s, s.new_zeros(padded, num_groups)])
        term = torch.cat([term, term.new_full((padded, num_groups), pad_term)])

    def pairs(values: torch.Tensor) -> torch.Tensor:
        bits = values.to(dtype).view(torch.int16).to(torch.int64) & 0xFFFF  # [tiles * 16, G]
        bits = bits.view(tiles, 2, 8, num_groups)  # row 16 tile + 8 h + g
        word = bits[:, 0] | (bits[:, 1] << 16)  # [tiles, 8, G]: lo = row g, hi = row g + 8
        return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)

    sz = torch.stack([pairs(s), pairs(term)], dim=-1)  # [tiles, 8, G, 2]
    return sz.permute(0, 2, 1, 3).contiguous(), zmode


def dequantize_like_kernel(qweight: torch.Tensor, sz: torch.Tensor, zmode: int, group_size: int,
                           out_features: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] the kernel multiplies, computed the way it computes it (float64 products, one rounding
    to `dtype`): the reference `gemm_scales` is tested against."""
    in_features = qweight.shape[1] * 8
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
    codes = ((qweight[..., None] >> shifts) & 0xF).reshape(out_features, in_features).to(torch.float64)

    def unpair(index: int) -> torch.Tensor:
        words = sz[..., index].to(torch.int64) & 0xFFFFFFFF  # [tiles, G, 8]
        halves = torch.stack([words & 0xFFFF, words >> 16], dim=1)  # [tiles, 2, G, 8]
        halves = torch.where(halves >= 2**15, halves - 2**16, halves).to(torch.int16)
        values = halves.view(dtype).to(torch.float64).permute(0, 1, 3, 2)  # [tiles, 2, 8, G]
        return values.reshape(-1, values.shape[-1])[:out_features].repeat_interleave(group_size, dim=1)

    scale, term = unpair(0), unpair(1)
    if zmode == 0:
        weight = (codes + _MAGIC[dtype] + term) * scale
    else:
        weight = codes * scale + term
    return weight.to(dtype)


@cache
def _max_shared_bytes(device_index: int) -> int:
    import cupy

    return cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                                device_index)


@cache
def wgmma_available(device_index: int) -> bool:
    from deepinfer.kernels.compiler import device_arch

    return device_arch(device_index) == "90"


def plan(num_tokens: int, out_features: int, in_features: int, device_index: int
         ) -> tuple[TileConfig | WgmmaConfig, int]:
    """(launch shape, K splits) of one product: token tiles of 16, 32 or 64; CTAs of 128 rows, or of 64 on
    outputs of at most NARROW_OUT at up to 32 tokens (128-row CTAs leave most SMs idle there); split along K
    until every SM holds about two CTAs, four of the 64-row ones (never below two pipeline stages per split). On
    the H200 sweep of Qwen2.5-3B's and 7B's products, at the points the dispatch sends here this was within
    10% of the sweep's fastest launch at most, and 1.4x it at worst (3B's o-projection at 64 tokens, 7B's
    down-projection at 128): 8ad1055:results/w4_gemm_sweep_nvidia_h200.json, scripts/tune_w4_gemm.py."""
    ctas_per_sm = 2
    if wgmma_available(device_index):
        ntok = 16 if num_tokens <= 16 else 32 if num_tokens <= 32 else 64
        wg = 1 if out_features <= NARROW_OUT and num_tokens <= 32 else 2
        config = WgmmaConfig(wg=wg, mt=1, ntok=ntok, stages=4)
        ctas_per_sm = 4 if wg == 1 else 2
    else:
        tt = 1 if num_tokens <= 8 else 2 if num_tokens <= 16 else 4 if num_tokens <= 32 else 8
        config = TileConfig(warps=4, rw=2, tt=tt, stages=4)
        if config.shared_bytes > _max_shared_bytes(device_index):
            config = TileConfig(warps=4, rw=2, tt=tt, stages=3)
    ctas = -(-out_features // config.rows) * -(-num_tokens // config.tokens)
    num_kb = -(-in_features // BK)
    splits = max(1, min(round(ctas_per_sm * _num_sms(device_index) / ctas), num_kb // 2))
    return config, splits


_configured: set[tuple[str, int]] = set()


def _allow_shared_memory(fn, shared_bytes: int, device_index: int) -> None:
    """Beyond 48 KiB a kernel must ask for its dynamic shared memory (once per kernel and device)."""
    import cupy

    with cupy.cuda.Device(device_index):
        fn.max_dynamic_shared_size_bytes = shared_bytes


def _kernel(config: TileConfig | WgmmaConfig, dt: int, zmode: int, device_index: int):
    name = config.name(dt, zmode)
    fn = get_kernel(SOURCE, name, device_index)
    if (name, device_index) not in _configured:
        _allow_shared_memory(fn, config.shared_bytes, device_index)
        _configured.add((name, device_index))
    return fn


def instantiations() -> tuple[str, ...]:
    """The launch shapes `plan` picks, for both dtypes and zero modes (compiled ahead by validate-kernels)."""
    shapes = [WgmmaConfig(1, 1, n, 4) for n in (16, 32)] + [WgmmaConfig(2, 1, n, 4) for n in (16, 32, 64)]
    shapes += [TileConfig(4, 2, tt, stages) for tt in (1, 2, 4, 8) for stages in (4, 3)]
    return tuple(shape.name(dt, zmode) for shape in shapes for dt in (0, 1) for zmode in (0, 1))


def w4_gemm(x: torch.Tensor, qweight: torch.Tensor, sz: torch.Tensor, zmode: int, group_size: int,
            bias: torch.Tensor | None = None, config: TileConfig | WgmmaConfig | None = None,
            splits: int | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp16/bf16 (in input_perm order) -> [M, N] in x's dtype; sz, zmode from `gemm_scales` for x's
    dtype. `config` / `splits` override the plan (benchmarks, validation)."""
    num_tokens, in_features = x.shape
    out_features = qweight.shape[0]
    x, bias, out = product_operands(x, bias, out_features, out)
    if num_tokens == 0:
        return out
    index = x.device.index
    config, splits = planned_launch(plan(num_tokens, out_features, in_features, index), config, splits)
    grid = (-(-out_features // config.rows), -(-num_tokens // config.tokens), splits)
    partials, counters = split_k_buffers(x.device, splits, grid[0] * grid[1], config.rows * config.tokens)
    fn = _kernel(config, _DTYPE_CODES[x.dtype], zmode, index)
    power_of_two = group_size & (group_size - 1) == 0
    group_shift = group_size.bit_length() - 1 if power_of_two else -1
    if group_size % BK == 0 or group_size == in_features:
        slot_shift = 31  # every stage lies in one group
    elif power_of_two:
        slot_shift = group_shift  # groups of 32 or 64 divide the stage
    else:
        slot_shift = -1
    args = (ptr(x), ptr(qweight), ptr(sz), ptr(bias), ptr(out), ptr(partials), ptr(counters),
            i32(num_tokens), i32(out_features), i32(in_features), i32(group_size), i32(group_shift),
            i32(slot_shift), i32(sz.shape[1]))
    launch(fn, grid, (config.threads, 1, 1), args, index, shared_mem=config.shared_bytes)
    return out
