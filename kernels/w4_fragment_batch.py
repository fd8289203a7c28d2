"""Launcher of the 33-128-token W4A16 product in w4_fragment_batch.cu (SM80+), over the fragment layout that
kernels/w4_fragment_gemm.py makes at load (`fragment_layout`: the few-token kernel's weight form, so one copy of a
weight serves both).

A launch is a `BatchConfig` (the CTA tile) and a number of persistent CTAs P: the tiles x k blocks iterations are
cut into P equal runs (stream-K), each CTA one run; the parts of tiles that two CTAs share meet in fp32 partials
[P, 2, tile outputs] (kernels/quant_matmul.py: split_k_buffers) and per-tile counters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.kernels.compiler import get_kernel
from deepinfer.kernels.launch import i32, launch, planned_launch, product_operands, ptr
from deepinfer.kernels.quant_matmul import _COUNTER_SLOTS, _num_sms, split_k_buffers
from deepinfer.kernels.w4_fragment_gemm import _DTYPE_CODES, FragmentWeight, group_shift
from deepinfer.kernels.w4_gemm import _allow_shared_memory, wgmma_available

SOURCE = "w4_fragment_batch.cu"
MIN_TOKENS, MAX_TOKENS = 33, 128  # the token range it is built for (more run as further 64-token blocks)
MIN_ITERATIONS = 3  # k blocks a CTA at least, so a CTA's pipeline fill is spread over some work


@dataclass(frozen=True)
class BatchConfig:
    """A launch shape of w4_fragment_batch_kernel: WN x WK warps, RT 16-row tiles a warp, TT 8-token tiles, APW
    64-k atoms a warp a stage, STAGES ring slots."""

    rt: int = 2
    tt: int = 8
    wn: int = 4
    wk: int = 2  # the kernel adds at most two K halves
    apw: int = 2
    stages: int = 4
    wgmma: bool = False  # wgmma (SM90a: m64n(8 TT)k16, A from registers) in place of mma.sync

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
        return self.stages * (tiles * self.apw * self.wk * 512 + self.tokens * self.bk * 2 + tiles * max_groups * 64)

    @property
    def label(self) -> str:
        return f"batch<{self.rt},{self.tt},{self.wn},{self.wk},{self.apw},{self.stages}{',wgmma' if self.wgmma else ''}>"

    def name(self, dt: int, gs: int) -> str:
        return (f"w4_fragment_batch_kernel<{dt},{self.rt},{self.tt},{self.wn},{self.wk},{self.apw},{gs},"
                f"{self.stages},{'true' if self.wgmma else 'false'}>")


# 8 warps (4 along N, 2 along K) of 2 row tiles and all 64 tokens: 128 x 64 outputs a CTA, 256 k a stage (at
# G = 128 one group a warp a stage), 4 stages of 49 KiB: one CTA an SM.
CONFIG = BatchConfig()
WGMMA_CONFIG = BatchConfig(wgmma=True)  # the same tile on wgmma (SM90)
# On wgmma, 8 warps along N (two warpgroups of 128 rows): 256 x 64 outputs a CTA, each warp all 4 atoms of a 256-k
# stage, 3 stages of 66 KiB. A stage's 32 KiB of activations serve 32 KiB of weights (the 128-row tile's serve 16).
WIDE_WGMMA_CONFIG = BatchConfig(wn=8, wk=1, apw=4, stages=3, wgmma=True)
WIDE_48_WGMMA_CONFIG = BatchConfig(tt=6, wn=8, wk=1, apw=4, stages=3, wgmma=True)  # 48-token blocks (m64n48k16)
CONFIGS = (CONFIG, WGMMA_CONFIG, WIDE_WGMMA_CONFIG, WIDE_48_WGMMA_CONFIG)


def iterations(num_tokens: int, out_features: int, in_features: int, config: BatchConfig = CONFIG) -> int:
    """Tiles x k blocks: the work the CTAs share."""
    row_tiles = -(-out_features // 16)
    row_blocks = -(-row_tiles // (config.rt * config.wn))
    return row_blocks * -(-num_tokens // config.tokens) * -(-in_features // config.bk)


def plan(num_tokens: int, out_features: int, in_features: int, device_index: int,
         config: BatchConfig | None = None) -> tuple[BatchConfig, int]:
    """(launch shape, persistent CTAs): on SM90 the wide wgmma tile, over 48-token blocks where they pad the tokens
    less than 64-token ones (33-48, 65-96: on the H200 7B gate/up at 48 tokens 44.9 us against 53.7, at 96 83.8
    against 97.6), else 64-token blocks (the wide tile ran 1.1-1.15x faster than the 128-row one on the gate/up
    products); mma.sync's 128-row tile elsewhere. As many CTAs as the SMs hold at once, fewer where a CTA would get
    under MIN_ITERATIONS k blocks (one CTA an SM; on the H200 half as many CTAs took 1.9x as long)."""
    if config is None:
        if not wgmma_available(device_index):
            config = CONFIG
        elif -(-num_tokens // 48) * 48 < -(-num_tokens // 64) * 64:
            config = WIDE_48_WGMMA_CONFIG
        else:
            config = WIDE_WGMMA_CONFIG
    total = iterations(num_tokens, out_features, in_features, config)
    return config, max(1, min(_num_sms(device_index), total // MIN_ITERATIONS))


def instantiations() -> tuple[str, ...]:
    """Every launch shape at each of its group-step variants, both dtypes (compiled ahead by validate-kernels)."""
    return tuple(config.name(dt, gs) for config in CONFIGS for dt in (0, 1)
                 for gs in sorted({config.group_steps(g, 1 << 20) for g in (32, 64, 128, 256)}))


_configured: set[tuple[str, int]] = set()


def _kernel(config: BatchConfig, dt: int, gs: int, device_index: int):
    name = config.name(dt, gs)
    fn = get_kernel(SOURCE, name, device_index)
    if (name, device_index) not in _configured:
        _allow_shared_memory(fn, config.shared_bytes(gs), device_index)
        _configured.add((name, device_index))
    return fn


def w4_fragment_batch(x: torch.Tensor, weight: FragmentWeight, bias: torch.Tensor | None = None,
                      config: BatchConfig | None = None, ctas: int | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp16/bf16 (in input_perm order) -> [M, N] in x's dtype; `weight` from `fragment_layout` for x's
    dtype. `config` / `ctas` override the plan (benchmarks, validation); any M works, the plan is made for 33-128."""
    num_tokens, in_features = x.shape
    out_features = weight.out_features
    if in_features != weight.in_features:
        raise ValueError(f"x has {in_features} features, the weight {weight.in_features}")
    x, bias, out = product_operands(x, bias, out_features, out)
    if num_tokens == 0:
        return out
    index = x.device.index
    config, ctas = planned_launch(plan(num_tokens, out_features, in_features, index), config, ctas)
    if config.wgmma and not wgmma_available(index):
        raise ValueError("the wgmma launch shape needs an SM90 GPU")
    total = iterations(num_tokens, out_features, in_features, config)
    ctas = min(ctas, total)
    tiles = total // -(-in_features // config.bk)
    if tiles > _COUNTER_SLOTS:
        raise ValueError(f"{tiles} output tiles exceed the split-K counter slots")
    gs = config.group_steps(weight.group_size, in_features)
    partials, counters = split_k_buffers(x.device, 2, ctas, config.rows * config.tokens)
    if partials is None or ctas == 1:  # one CTA covers every tile whole: nothing meets in the partials
        partials, counters = None, None
    fn = _kernel(config, _DTYPE_CODES[x.dtype], gs, index)
    args = (ptr(x), ptr(weight.frag), ptr(weight.sz), ptr(bias), ptr(out), ptr(partials), ptr(counters),
            i32(num_tokens), i32(out_features), i32(in_features),
            i32(group_shift(weight.group_size, in_features)), i32(weight.sz.shape[1]))
    launch(fn, (ctas, 1, 1), (config.threads, 1, 1), args, index, shared_mem=config.shared_bytes(gs))
    return out
