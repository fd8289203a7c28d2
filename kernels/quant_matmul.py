"""Launchers of the W4A16/W3A16 kernels in quant_matmul.cu.

Three kernels read the same packed layout (core/quant/packed.py, passed here as plain tensors):
- "gemv": CUDA cores, up to 4 tokens per weight read (`quant_gemv_kernel<DT, BITS, MT, SCALE_F32>`);
- "ksplit": tensor cores (mma.sync m16n8k16), 8 or 16 tokens per weight read; a CTA's 8 warps share
  16 output rows and split K among themselves (`quant_mma_ksplit_kernel`), for few tokens;
- "mma": tensor cores, a tile of 8/16/32/64 tokens per weight read, 64 output rows per CTA, split
  along K across CTAs when the output alone gives too few CTAs to fill the GPU (`quant_mma_kernel`).
`pick_kernel` chooses by the number of tokens (from `bench gemv` on an H200); `kernel=` forces one.
"""

from __future__ import annotations

from functools import cache

import torch

from kernels.compiler import get_kernel
from kernels.launch import i32, launch, ptr

SOURCE = "quant_matmul.cu"
_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}
# (largest token count, kernel): the first entry whose bound covers M serves it.
AUTO_KERNELS = ((1, "gemv"), (16, "ksplit"), (1 << 30, "mma"))
MAX_TILE = {"gemv": 4, "ksplit": 2, "mma": 8}
MMA_ROWS_PER_CTA = 64
KSPLIT_ROWS_PER_CTA = 16
MMA_SEGMENT = 128  # codes of K per thread-quad step
_COUNTER_SLOTS = 1 << 14

_counters: dict[int, torch.Tensor] = {}


def unsupported_reason(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                       bits: int, group_size: int) -> str | None:
    """Why the kernels cannot compute this product (None when they can)."""
    if x.dtype not in _DTYPE_CODES:
        return f"activation dtype {x.dtype} (kernels take float16/bfloat16)"
    if bits not in (3, 4):
        return f"{bits}-bit weights"
    if scales.dtype not in (torch.float16, torch.float32) or zeros.dtype != scales.dtype:
        return f"scales {scales.dtype} / zeros {zeros.dtype}"
    if group_size % 32:
        return f"group size {group_size} (kernels need a multiple of 32)"
    if not (qweight.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous()):
        return "non-contiguous packed weight"
    if bits == 4 and qweight.data_ptr() % 16:
        return "qweight not 16-byte aligned"
    return None


def default_tile(kernel: str, num_tokens: int) -> int:
    """Tokens per CTA of the gemv kernel (1, 2, 4) or 8-token tiles per CTA of ksplit (1, 2) / mma (1..8)."""
    sizes = tuple(size for size in (1, 2, 4, 8) if size <= MAX_TILE[kernel])
    unit = 1 if kernel == "gemv" else 8
    return next((size for size in sizes if num_tokens <= size * unit), sizes[-1])


def pick_kernel(num_tokens: int) -> str:
    return next(kernel for bound, kernel in AUTO_KERNELS if num_tokens <= bound)


def weight_read_probe(qweight: torch.Tensor, bits: int, in_features: int) -> None:
    """Diagnostic: the ksplit kernel's weight loads with no math (what its access pattern streams)."""
    index = qweight.device.index
    sink = torch.empty(1, dtype=torch.int32, device=qweight.device)
    fn = get_kernel(SOURCE, f"quant_read_probe_kernel<{bits}>", index)
    out_features = qweight.shape[0]
    launch(fn, ((out_features + KSPLIT_ROWS_PER_CTA - 1) // KSPLIT_ROWS_PER_CTA, 1, 1), (256, 1, 1), (
        ptr(qweight), ptr(sink), i32(out_features), i32(in_features)), index)


@cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _split_counters(device: torch.device) -> torch.Tensor:
    """Per-device split-K tile counters: zeroed once here, and left at zero by every launch. Two split
    launches on one device must not run concurrently (different streams): keep them on one stream."""
    counters = _counters.get(device.index)
    if counters is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("run the quantized matmul once before capturing a CUDA graph "
                               "(its split-K counters are allocated on first use)")
        counters = torch.zeros(_COUNTER_SLOTS, dtype=torch.int32, device=device)
        _counters[device.index] = counters
    return counters


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                 group_size: int, zero_mode: str, bias: torch.Tensor | None = None,
                 kernel: str = "auto", tile: int | None = None, splits: int | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (fp16/bf16, already in input_perm order) -> [M, N] in x's dtype.

    kernel: "auto" | "gemv" | "ksplit" | "mma"; tile: tokens per CTA (gemv: 1/2/4) or 8-token tiles
    (ksplit: 1/2, mma: 1/2/4/8); splits: the mma kernel's K splits (default: enough CTAs for 4 per SM);
    out: a contiguous [M, N] buffer to write into.
    """
    num_tokens, in_features = x.shape
    out_features = qweight.shape[0]
    x = x.contiguous()
    if x.data_ptr() % 16:  # the kernels read activations 16 bytes at a time
        x = x.clone()
    device = x.device
    dt = _DTYPE_CODES[x.dtype]
    scale_f32 = int(scales.dtype == torch.float32)
    mode = 0 if zero_mode == "zero" else 1
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    if out is None:
        out = torch.empty(num_tokens, out_features, dtype=x.dtype, device=device)
    if num_tokens == 0:
        return out
    name = pick_kernel(num_tokens) if kernel == "auto" else kernel
    tile = tile or default_tile(name, num_tokens)
    index = device.index

    if name == "gemv":
        fn = get_kernel(SOURCE, f"quant_gemv_kernel<{dt},{bits},{tile},{scale_f32}>", index)
        grid = ((out_features + 7) // 8, (num_tokens + tile - 1) // tile, 1)
        launch(fn, grid, (128, 1, 1), (
            ptr(x), ptr(qweight), ptr(scales), ptr(zeros), ptr(bias), ptr(out),
            i32(num_tokens), i32(out_features), i32(in_features), i32(group_size), i32(mode)), index)
        return out
    if name == "ksplit":
        fn = get_kernel(SOURCE, f"quant_mma_ksplit_kernel<{dt},{bits},{tile},{scale_f32}>", index)
        grid = ((out_features + KSPLIT_ROWS_PER_CTA - 1) // KSPLIT_ROWS_PER_CTA, (num_tokens + 8 * tile - 1) // (8 * tile), 1)
        launch(fn, grid, (256, 1, 1), (
            ptr(x), ptr(qweight), ptr(scales), ptr(zeros), ptr(bias), ptr(out),
            i32(num_tokens), i32(out_features), i32(in_features), i32(group_size), i32(mode)), index)
        return out

    row_tiles = (out_features + MMA_ROWS_PER_CTA - 1) // MMA_ROWS_PER_CTA
    token_tiles = (num_tokens + 8 * tile - 1) // (8 * tile)
    num_segments = (in_features + MMA_SEGMENT - 1) // MMA_SEGMENT
    if splits is None:
        target_ctas = 4 * _num_sms(index)
        splits = max(1, min(num_segments, -(-target_ctas // (row_tiles * token_tiles))))
    segments_per_split = -(-num_segments // splits)
    splits = -(-num_segments // segments_per_split)  # no empty split
    partials = counters = None
    if splits > 1:
        if row_tiles * token_tiles > _COUNTER_SLOTS:
            raise ValueError(f"{row_tiles * token_tiles} output tiles exceed the split-K counter slots")
        partials = torch.empty(splits, num_tokens, out_features, dtype=torch.float32, device=device)
        counters = _split_counters(device)
    fn = get_kernel(SOURCE, f"quant_mma_kernel<{dt},{bits},{tile},{scale_f32}>", index)
    launch(fn, (row_tiles, token_tiles, splits), (128, 1, 1), (
        ptr(x), ptr(qweight), ptr(scales), ptr(zeros), ptr(bias), ptr(out), ptr(partials), ptr(counters),
        i32(num_tokens), i32(out_features), i32(in_features), i32(group_size), i32(mode),
        i32(segments_per_split)), index)
    return out
