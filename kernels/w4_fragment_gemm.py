"""Launcher and load-time layout of the W4A16 product in w4_fragment_gemm.cu (few-token shapes to 32 tokens, more
as 32-token tiles; SM80+). kernels/w4_fragment_batch.py launches the 33-128-token kernel over the same layout.

The kernel reads the weight in its own fragment layout, made once per weight from PackedWeight's tensors by
`fragment_layout` (core/ops prepares it at load; the disk format does not change):

- frag int32 [ceil(N / 16), ceil(K / 64), 32, 4]: atom (row tile, 64 k), lane, k16 step j; nibble i = 4e + p of a
  word holds the code of row 16 tile + g + 8 (p & 1), k 64 atom + 16 j + 2t + 8 (p >> 1) + e (g = lane // 4,
  t = lane % 4): the mma.sync A fragment of the step, pair p = nibbles (p, p + 4). Padding codes are 0.
- sz int32 [ceil(N / 16), K / G, 8, 2]: for each row tile, group and g, the fp16 scale pair (row g, row g + 8)
  and the zero pair -(magic + z) in the activation dtype (magic 128 for bf16, 1024 for fp16); padding rows get
  scale 0.

`dequantize_fragments` is that layout read back the way the kernel reads it (its unpacking emulated bit for bit),
which the CPU tests hold to core.quant.packing.dequantize.

A launch is planned from (tokens, N, K): `FragmentConfig` (16-row tiles a warp, 8-token tiles, warps along N and
along K, atoms a warp a stage, pipeline stages) and the number of K splits; split-K partials and counters are those
of the other split-K kernels (quant_matmul.py), allocated once per device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from deepinfer.kernels.act_and_mul import ACTIVATIONS, fused_epilogue_operands
from deepinfer.kernels.compiler import get_kernel
from deepinfer.kernels.launch import i32, launch, planned_launch, product_operands, ptr
from deepinfer.kernels.quant_matmul import _num_sms, split_k_buffers
from deepinfer.kernels.w4_gemm import _allow_shared_memory

SOURCE = "w4_fragment_gemm.cu"
_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}
MAGIC = {torch.float16: 1024.0, torch.bfloat16: 128.0}  # (magic + q) is what one LOP3 makes of a code
MAX_TOKENS = 32  # the few-token shapes' most tokens a CTA (four 8-token tiles)
PER_CHANNEL_SHIFT = 31  # the kernel's group shift for one group a row
_SHARED_PER_SM = 227 * 1024


@dataclass(frozen=True)
class FragmentConfig:
    """A launch shape of w4_fragment_gemm_kernel."""

    rt: int  # 16-row tiles a warp
    tt: int  # 8-token tiles a CTA
    wn: int  # warps along N
    wk: int  # warps along K (their sums are added in the CTA)
    apw: int  # 64-k atoms a warp a stage
    stages: int  # cp.async pipeline depth

    @property
    def rows(self) -> int:
        return 16 * self.rt * self.wn

    @property
    def tokens(self) -> int:
        return 8 * self.tt

    @property
    def threads(self) -> int:
        return 32 * self.wn * self.wk

    @property
    def bk(self) -> int:
        return 64 * self.apw * self.wk

    def group_steps(self, group_size: int, in_features: int) -> int:
        """The kernel's GS: k16 steps a group where it lies inside a warp's atoms of a stage, else 0."""
        if group_size >= in_features or group_size >= 64 * self.apw:
            return 0
        return group_size // 16

    def shared_bytes(self, gs: int) -> int:
        tiles = self.rt * self.wn
        max_groups = self.bk // (16 * gs) if gs else self.wk
        stage = tiles * self.apw * self.wk * 512 + self.tokens * self.bk * 2 + tiles * max_groups * 64
        reduce = self.wk * self.tokens * self.rows * 4  # the warps' sums at the end
        return max(self.stages * stage, reduce)

    @property
    def label(self) -> str:
        return f"frag<{self.rt},{self.tt},{self.wn},{self.wk},{self.apw},{self.stages}>"

    def name(self, dt: int, gs: int, act: int = -1) -> str:
        return (f"w4_fragment_gemm_kernel<{dt},{self.rt},{self.tt},{self.wn},{self.wk},{self.apw},{gs},"
                f"{self.stages},{act}>")


class FragmentWeight(NamedTuple):
    """A W4 weight in the kernel's layout, for one activation dtype."""

    frag: torch.Tensor  # int32 [ceil(N / 16), ceil(K / 64), 32, 4]
    sz: torch.Tensor  # int32 [ceil(N / 16), K / G, 8, 2]
    out_features: int
    in_features: int
    group_size: int


def fragment_reason(bits: int, group_size: int, in_features: int, zero_mode: str, integer_zeros: bool,
                    scales_dtype: torch.dtype) -> str | None:
    """Why this kernel cannot take the weight (None when it can)."""
    if bits != 4:
        return f"{bits}-bit weights (the fragment layout holds 4-bit codes)"
    if zero_mode != "zero" or not integer_zeros:
        return "float zero points (the fragment kernel subtracts integer zeros exactly)"
    if scales_dtype != torch.float16:
        return f"{scales_dtype} scales (the fragment layout holds fp16 scales)"
    if group_size < in_features and (group_size < 32 or group_size & (group_size - 1)):
        return f"group size {group_size} (the fragment kernel takes 32 * 2^i or one group a row)"
    return None


def group_shift(group_size: int, in_features: int) -> int:
    return PER_CHANNEL_SHIFT if group_size >= in_features else group_size.bit_length() - 1


def fragment_codes(qweight: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """qweight int32 [N, K / 8] (code j of word w is k = 8w + j) -> frag int32 [ceil(N / 16), ceil(K / 64), 32, 4]."""
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
    codes = ((qweight[..., None] >> shifts) & 0xF).reshape(out_features, in_features)  # [N, K]
    tiles, atoms = -(-out_features // 16), -(-in_features // 64)
    codes = torch.nn.functional.pad(codes, (0, atoms * 64 - in_features, 0, tiles * 16 - out_features))
    # row = 16 tile + 8 h + g, k = 64 atom + 16 j + 8 hk + 2 t + e; nibble i = 4 e + 2 hk + h of word (lane, j)
    codes = codes.view(tiles, 2, 8, atoms, 4, 2, 4, 2)  # (tile, h, g, atom, j, hk, t, e)
    codes = codes.permute(0, 3, 2, 6, 4, 7, 5, 1)  # (tile, atom, g, t, j, e, hk, h)
    codes = codes.reshape(tiles, atoms, 32, 4, 8).to(torch.int64)
    words = (codes << torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int64)).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


_EXACT_RANGE = {torch.bfloat16: 127, torch.float16: 1023}  # |magic + z| stays an integer of the type up to here


def zeros_fit(zeros: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether integer zero points [N, K / G] fit the layout for `dtype` activations: each -(magic + z), and each
    q - z of a 4-bit code, exact in `dtype`."""
    z = zeros.to(torch.float64)
    return torch.equal(z, torch.round(z)) and not bool((z.abs() > _EXACT_RANGE[dtype] - 16).any())


def fragment_scales(scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp16 scales and integer zeros [N, K / G] -> sz int32 [ceil(N / 16), K / G, 8, 2] for `dtype` activations.
    Raises ValueError where a zero's -(magic + z) or a q - z is not exact in `dtype`."""
    out_features, num_groups = scales.shape
    z = zeros.to(torch.float64)
    term = -(z + MAGIC[dtype])
    if not zeros_fit(zeros, dtype):
        raise ValueError("the fragment layout needs integer zero points of at most "
                         f"{_EXACT_RANGE[dtype] - 16} in magnitude for {dtype} activations")
    tiles = -(-out_features // 16)
    padded = tiles * 16 - out_features
    s = scales.to(torch.float16)
    if padded:
        s = torch.cat([s, s.new_zeros(padded, num_groups)])
        term = torch.cat([term, term.new_full((padded, num_groups), -MAGIC[dtype])])

    def pairs(bits: torch.Tensor) -> torch.Tensor:
        bits = bits.to(torch.int64) & 0xFFFF  # [tiles * 16, G]
        bits = bits.view(tiles, 2, 8, num_groups)  # row 16 tile + 8 h + g
        word = bits[:, 0] | (bits[:, 1] << 16)  # [tiles, 8, G]: lo = row g, hi = row g + 8
        return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)

    sz = torch.stack([pairs(s.view(torch.int16)), pairs(term.to(dtype).view(torch.int16))], dim=-1)
    return sz.permute(0, 2, 1, 3).contiguous()  # [tiles, G, 8, 2]


def fragment_layout(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    out_features: int, in_features: int, dtype: torch.dtype) -> FragmentWeight:
    return FragmentWeight(fragment_codes(qweight, out_features, in_features).contiguous(),
                          fragment_scales(scales, zeros, dtype), out_features, in_features, group_size)


def gate_up_order(inner: int, device: torch.device | None = None) -> torch.Tensor:
    """Row order of a merged [gate; up] weight of 2 x `inner` rows for the fused activation: row 16 t + j is gate row
    8 t + j and row 16 t + 8 + j is up row 8 t + j (inner + 8 t + j), so one 16-row tile, and one thread's mma
    fragment (rows g and g + 8), holds a gate row and its up row."""
    if inner % 8:
        raise ValueError(f"the fused activation interleaves 8-row blocks: {inner} inner features is not a multiple of 8")
    blocks = torch.arange(inner, device=device).view(-1, 8)
    return torch.stack([blocks, blocks + inner], dim=1).reshape(-1)


def gate_up_layout(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                   in_features: int, dtype: torch.dtype) -> FragmentWeight:
    """The fragment layout of a merged [gate; up] weight (qweight int32 [2I, K / 8], scales / zeros [2I, K / G]) with
    its rows in `gate_up_order`: what `w4_fragment_gemm_act_and_mul` reads."""
    order = gate_up_order(qweight.shape[0] // 2, qweight.device)
    return fragment_layout(qweight[order], scales[order], zeros[order], group_size, qweight.shape[0], in_features,
                           dtype)


def _halves(words: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 32-bit words -> their (low, high) 16-bit halves as float64 values of `dtype`."""
    def value(bits: torch.Tensor) -> torch.Tensor:
        bits = torch.where(bits >= 2**15, bits - 2**16, bits).to(torch.int16)
        return bits.view(dtype).to(torch.float64)
    return value(words & 0xFFFF), value((words >> 16) & 0xFFFF)


def dequantize_fragments(weight: FragmentWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] as the kernel multiplies it, in fp32: each pair unpacked with the kernel's masks, shifts
    and magic exponents from the lane's word, the zero pair added in `dtype` (checked exact), times the fp32 group
    scale. Indexes the layout as the kernel does: (tile, atom, lane, j), nibble i = 4e + p."""
    frag = weight.frag.to(torch.int64) & 0xFFFFFFFF  # [T, A, 32, 4]
    sz = weight.sz.to(torch.int64) & 0xFFFFFFFF  # [T, G, 8, 2]
    tiles, atoms = frag.shape[:2]
    n_idx, k_idx = weight.out_features, weight.in_features
    shift = group_shift(weight.group_size, weight.in_features)
    out = torch.zeros(tiles * 16, atoms * 64, dtype=torch.float64)
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4
    tile = torch.arange(tiles)
    for atom in range(atoms):
        for j in range(4):
            word = frag[:, atom, :, j]  # [T, 32]
            for p in range(4):
                half = p & 1  # row g or g + 8
                if dtype == torch.bfloat16:
                    bits = ((word >> (4 * p)) & 0x000F000F) | 0x43004300
                    lo, hi = _halves(bits, dtype)
                else:
                    mask = 0x00F000F0 if p & 1 else 0x000F000F
                    bits = ((word >> (8 * (p >> 1))) & mask) | 0x64006400
                    lo, hi = _halves(bits, dtype)
                    if p & 1:
                        lo, hi = lo / 16, hi / 16  # the fma with 1/16, exact
                for e, codes in enumerate((lo, hi)):
                    k = 64 * atom + 16 * j + 2 * t + 8 * (p >> 1) + e  # [32]
                    group = torch.zeros_like(k) if shift == PER_CHANNEL_SHIFT else k >> shift
                    group = group.clamp(max=sz.shape[1] - 1)
                    entry = sz[:, group, g]  # [T, 32, 2]: the lane's scale and zero pairs
                    s_lo, s_hi = _halves(entry[..., 0], torch.float16)
                    z_lo, z_hi = _halves(entry[..., 1], dtype)
                    zero = z_hi if half else z_lo
                    if dtype == torch.float16 and p & 1:
                        zero = zero + 960  # -(1024 + z) + 960 = -(64 + z)
                    value = codes + zero
                    if not torch.equal(value.to(dtype).to(torch.float64), value):
                        raise AssertionError("an unpacked pair is not exact in the activation dtype")
                    scale = (s_hi if half else s_lo).to(torch.float32).to(torch.float64)
                    rows = 16 * tile[:, None] + g[None, :] + 8 * half  # [T, 32]
                    out[rows, k[None, :].expand_as(rows)] = (value.to(torch.float32) * scale.to(torch.float32)
                                                             ).to(torch.float64)
    return out[:n_idx, :k_idx].to(torch.float32)


# The launch shapes: 4 warps side by side along N, each with 4 atoms (256 k) a stage. Up to 16 tokens one row tile a
# warp (64-row CTAs, 50-66 KiB of shared memory: 3-4 CTAs an SM); at 32 tokens two (128-row CTAs: a 64-row CTA's
# activation copies cost more issue slots than the budget, scripts/sass_budget.py), 3 or 2 stages (2 CTAs an SM).
# More than 32 tokens run as 32-token tiles along grid.y.
CONFIGS = (FragmentConfig(rt=1, tt=1, wn=4, wk=1, apw=4, stages=4), FragmentConfig(rt=1, tt=2, wn=4, wk=1, apw=4, stages=4),
           FragmentConfig(rt=2, tt=4, wn=4, wk=1, apw=4, stages=3), FragmentConfig(rt=2, tt=4, wn=4, wk=1, apw=4, stages=2))


def plan(num_tokens: int, out_features: int, in_features: int, device_index: int) -> tuple[FragmentConfig, int]:
    """(launch shape, K splits): the first CONFIGS shape of the token count (1-8, 9-16, 17-32 tokens; more: the
    32-token shape, as many along grid.y as the tokens need); K split into as many parts as one wave of CTAs holds
    (the CTAs an SM's shared memory takes, times the SMs), never below two stages a part. On the H200 sweep of
    scripts/tune_w4_fragment.py a second wave cost up to 1.5x, and fewer parts than a wave holds up to 2x on the
    long-K products."""
    tt = 1 if num_tokens <= 8 else 2 if num_tokens <= 16 else 4
    config = next(c for c in CONFIGS if c.tt == tt)
    per_sm = max(1, min(4, _SHARED_PER_SM // (config.shared_bytes(0) + 1024)))
    ctas = -(-out_features // config.rows) * -(-num_tokens // config.tokens)
    num_kb = -(-in_features // config.bk)
    splits = max(1, min(per_sm * _num_sms(device_index) // ctas, num_kb // 2))
    return config, splits


def instantiations() -> tuple[str, ...]:
    """Every launch shape for both dtypes: the product at every group-step variant, the fused activations at those
    of G >= 128 (the table's; compiled ahead by validate-kernels, the others on first use)."""
    def steps(config: FragmentConfig, group_sizes: tuple[int, ...]) -> list[int]:
        return sorted({config.group_steps(g, 1 << 20) for g in group_sizes})
    return tuple(name for config in CONFIGS for dt in (0, 1)
                 for name in (*(config.name(dt, gs) for gs in steps(config, (32, 64, 128, 256))),
                              *(config.name(dt, gs, act) for gs in steps(config, (128, 256))
                                for act in ACTIVATIONS.values())))


_configured: set[tuple[str, int]] = set()


def _kernel(config: FragmentConfig, dt: int, gs: int, act: int, device_index: int):
    name = config.name(dt, gs, act)
    fn = get_kernel(SOURCE, name, device_index)
    if (name, device_index) not in _configured:
        _allow_shared_memory(fn, config.shared_bytes(gs), device_index)
        _configured.add((name, device_index))
    return fn


def w4_fragment_gemm(x: torch.Tensor, weight: FragmentWeight, bias: torch.Tensor | None = None,
                     config: FragmentConfig | None = None, splits: int | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp16/bf16 (in input_perm order) -> [M, N] in x's dtype; `weight` from `fragment_layout` for x's
    dtype. `config` / `splits` override the plan (benchmarks, validation)."""
    return _launch(x, weight, bias, -1, config, splits, out)


def w4_fragment_gemm_act_and_mul(x: torch.Tensor, weight: FragmentWeight, activation: str,
                                 bias: torch.Tensor | None = None, config: FragmentConfig | None = None,
                                 splits: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """act(x @ gate.T + b_gate) * (x @ up.T + b_up) [M, I] in x's dtype, the same bits as the product followed by
    act_and_mul_kernel; `weight` from `gate_up_layout` (2I rows), `bias` [2I] in `gate_up_order`."""
    act, out = fused_epilogue_operands(x, activation, weight.out_features, out)
    return _launch(x, weight, bias, act, config, splits, out)


def _launch(x: torch.Tensor, weight: FragmentWeight, bias: torch.Tensor | None, act: int,
            config: FragmentConfig | None, splits: int | None, out: torch.Tensor | None) -> torch.Tensor:
    num_tokens, in_features = x.shape
    out_features = weight.out_features
    if in_features != weight.in_features:
        raise ValueError(f"x has {in_features} features, the weight {weight.in_features}")
    x, bias, out = product_operands(x, bias, out_features, out)
    if num_tokens == 0:
        return out
    index = x.device.index
    config, splits = planned_launch(plan(num_tokens, out_features, in_features, index), config, splits)
    gs = config.group_steps(weight.group_size, in_features)
    tiles = -(-out_features // 16)
    grid = (-(-tiles // (config.rt * config.wn)), -(-num_tokens // config.tokens), splits)
    partials, counters = split_k_buffers(x.device, splits, grid[0] * grid[1], config.rows * config.tokens)
    fn = _kernel(config, _DTYPE_CODES[x.dtype], gs, act, index)
    args = (ptr(x), ptr(weight.frag), ptr(weight.sz), ptr(bias), ptr(out), ptr(partials), ptr(counters),
            i32(num_tokens), i32(out_features), i32(in_features),
            i32(group_shift(weight.group_size, in_features)), i32(weight.sz.shape[1]))
    launch(fn, grid, (config.threads, 1, 1), args, index, shared_mem=config.shared_bytes(gs))
    return out
