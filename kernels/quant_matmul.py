"""Launchers of the W4A16/W3A16 kernels in quant_matmul.cu.

Eight kernels read the same packed layout (core/quant/packed.py, passed here as plain tensors):
- "gemv": CUDA cores, up to 4 tokens per weight read (`quant_gemv_kernel<DT, BITS, MT, SCALE_F32>`);
- "stream": CUDA cores, up to 4 tokens, 2 rows per warp with 4 chunks of loads in flight per lane and
  half2 products (`quant_stream_kernel`), for one token on long rows;
- "split": CUDA cores, up to 4 tokens, 8-warp CTAs whose warps split K into `ksplit` parts
  (`quant_gemv_split_kernel`), so short-N shapes still get enough warps per SM (`split_ksplit`);
  measured no faster than gemv/stream on an H200 (kernels/PERFORMANCE.md), so dispatch never picks it;
- "ksplit": tensor cores (mma.sync m16n8k16), 8 or 16 tokens per weight read; a CTA's 8 warps share
  16 output rows and split K among themselves (`quant_mma_ksplit_kernel`), for few tokens;
- "mma": tensor cores, a tile of 8/16/32/64 tokens per weight read, 64 output rows per CTA, split
  along K across CTAs when the output alone gives too few CTAs to fill the GPU (`quant_mma_kernel`);
- "staged": tensor cores, 8 to 64 tokens per weight read, 128 output rows per CTA with the tokens'
  activations staged once per CTA in shared memory (`quant_mma_staged_kernel`), split along K;
- "tc": tensor cores, W4 only, 8/16/32 tokens per weight read, 16 output rows per CTA of 8 or 16 warps
  splitting K (`quant_tc_gemv_kernel`): ksplit's layout with about half the instructions per weight
  byte, and with integer zero points each group's sum is scaled once (`tc_reason` says when it serves);
- "tcs": tc's loads and pairs with staged's layout (128 rows per CTA, the activations of a K stage staged
  once in shared memory, split along K), for 9-32 tokens (`quant_tcs_kernel`).
`pick_kernel` chooses by the number of tokens and the shape, from `bench gemv` on an H200
(results/bench_gemv_w4a16-w3a16_nvidia_h200.json, kernels/PERFORMANCE.md); `kernel=` forces one.
"""

from __future__ import annotations

from functools import cache

import torch

from deepinfer.kernels.act_and_mul import ACTIVATIONS
from deepinfer.kernels.compiler import get_kernel
from deepinfer.kernels.launch import clusters_available, i32, launch, ptr

SOURCE = "quant_matmul.cu"
_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}
# (largest token count, kernel): the first entry whose bound covers M serves it. Measured on an H200 at
# 1..64 tokens: ksplit is fastest at 2-16 tokens, staged at 32 and 64 (up to 1.7x the mma kernel), and
# mma stays for more than 64 tokens, where staged was not measured.
AUTO_KERNELS = ((1, "gemv"), (16, "ksplit"), (64, "staged"), (1 << 30, "mma"))
MAX_TILE = {"gemv": 4, "stream": 4, "split": 4, "ksplit": 2, "staged": 8, "mma": 8, "tc": 4, "tcs": 4}
KERNELS = tuple(MAX_TILE)
MMA_ROWS_PER_CTA = 64
STAGED_ROWS_PER_CTA = 128
KSPLIT_ROWS_PER_CTA = 16
TC_ROWS_PER_CTA = 16
TC_SEGMENT = 128  # codes of K per thread-quad step of the tc kernel
TC_MAX_TOKENS = 32  # 4 token tiles of 8
TC_LONG_K = 4096  # from this many input features tc also wins at 1 and 9-32 tokens
SPLIT_WARPS = 8  # warps per CTA of the split GEMV
SPLIT_PARTS = (1, 2, 4, 8)  # K-parts per row pair it can take
SPLIT_CTAS_PER_SM = 4  # CTAs per SM the split plan aims the grid at
_CUDA_CORE_KERNELS = ("gemv", "stream", "split")
MMA_SEGMENT = 128  # codes of K per thread-quad step
_COUNTER_SLOTS = 1 << 14

_counters: dict[int, torch.Tensor] = {}
_workspaces: dict[tuple[int, int], torch.Tensor] = {}
_plans: dict[tuple, tuple] = {}


def packed_layout_reason(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                         group_size: int) -> str | None:
    """Why a packed weight is outside what every W4/W3 kernel reads (None when it is inside)."""
    if bits not in (3, 4):
        return f"{bits}-bit weights"
    if scales.dtype not in (torch.float16, torch.float32) or zeros.dtype != scales.dtype:
        return f"scales {scales.dtype} / zeros {zeros.dtype}"
    if group_size % 32:
        return f"group size {group_size} (kernels need a multiple of 32)"
    if not (qweight.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous()):
        return "non-contiguous packed weight"
    return None


def unsupported_reason(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                       bits: int, group_size: int) -> str | None:
    """Why the kernels cannot compute this product (None when they can)."""
    if x.dtype not in _DTYPE_CODES:
        return f"activation dtype {x.dtype} (kernels take float16/bfloat16)"
    reason = packed_layout_reason(qweight, scales, zeros, bits, group_size)
    if reason:
        return reason
    if bits == 4 and qweight.data_ptr() % 16:
        return "qweight not 16-byte aligned"
    return None


def default_tile(kernel: str, num_tokens: int) -> int:
    """Tokens per CTA of gemv/stream/split (1, 2, 4) or 8-token tiles per CTA of ksplit (1, 2) / staged, mma (1..8)."""
    sizes = tuple(size for size in (1, 2, 4, 8) if size <= MAX_TILE[kernel])
    unit = 1 if kernel in _CUDA_CORE_KERNELS else 8
    return next((size for size in sizes if num_tokens <= size * unit), sizes[-1])


def instantiations() -> tuple[str, ...]:
    """Every template instantiation the launcher can ask for (compiled ahead by validate-kernels)."""
    tiles = {"gemv": (1, 2, 4), "stream": (1, 2, 4), "split": (1, 2, 4), "ksplit": (1, 2), "staged": (1, 2, 4, 8), "mma": (1, 2, 4, 8)}
    kernels = {"gemv": "quant_gemv_kernel", "stream": "quant_stream_kernel", "split": "quant_gemv_split_kernel",
               "ksplit": "quant_mma_ksplit_kernel",
               "staged": "quant_mma_staged_kernel", "mma": "quant_mma_kernel"}
    packed_kernels = tuple(f"{kernels[name]}<{dt},{bits},{tile},{f32}>" for name in tiles for dt in (0, 1)
                           for bits in (4, 3) for tile in tiles[name] for f32 in (0, 1))
    tc = tuple(f"quant_{kernel}<{dt},{tile},{mode},{f32}>" for kernel in ("tc_gemv_kernel", "tcs_kernel")
               for dt in (0, 1) for tile in (1, 2, 4) for mode in (0, 1) for f32 in (0, 1))
    return packed_kernels + tc


def tc_group_shift(in_features: int, group_size: int) -> int | None:
    """The tc kernel finds a chunk's group as chunk >> shift: log2(G / 32), or 31 for one group per row
    (per-channel scales); None when G / 32 is not a power of two."""
    if group_size == in_features:
        return 31
    chunks = group_size // 32
    return chunks.bit_length() - 1 if chunks & (chunks - 1) == 0 else None


def tc_reason(bits: int, in_features: int, out_features: int, group_size: int) -> str | None:
    """Why the tc kernel cannot take this weight (None when it can): it reads whole 16-row tiles and
    128-code segments of 4-bit codes."""
    if bits != 4:
        return f"{bits}-bit weights"
    if in_features % TC_SEGMENT or out_features % TC_ROWS_PER_CTA:
        return f"shape {in_features}x{out_features} (needs K % {TC_SEGMENT} and N % {TC_ROWS_PER_CTA} == 0)"
    if tc_group_shift(in_features, group_size) is None:
        return f"group size {group_size} (needs 32 * 2^i or per-channel)"
    return None


def tc_mode(zero_mode: str, integer_zeros: bool, group_size: int) -> int:
    """0: codes minus whole zero points, exact, and each 128-code segment's sum scaled once (a segment must
    lie in one group); 1: weights dequantized before the product, as the other kernels do."""
    return 0 if zero_mode == "zero" and integer_zeros and group_size % TC_SEGMENT == 0 else 1


def pick_kernel(num_tokens: int, in_features: int = 0, out_features: int = 0, bits: int = 4,
                group_size: int = 128) -> str:
    """The kernel measured fastest for M tokens (H200, bf16, Qwen2.5-3B's merged shapes:
    results/bench_gemv_tcs_bf16_nvidia_h200.json). W4 weights tc / tcs take, up to 32 tokens:
    - outputs at least 3x the input (gate_up): tcs (2048x22016: 14.7 us at one token against gemv 15.4,
      12.9 with two K-splits, see _plan; 18.3 at 16 tokens against staged 27.2, 26.6 at 32 against 35.7);
    - K >= 4096 (down): tc (11008x2048: 8.6 us at one token against stream 12.6, 22.0 at 32 against
      ksplit 23.5);
    - otherwise tc at 1-8 tokens (2048x2560 at 4 tokens 4.6 us against ksplit 5.3; at one token it ties gemv
      alone, but under programmatic dependent launch its first weight loads overlap the kernel before it: a
      one-stream decode step of Qwen2.5-3B took 1693 us against 1817 with gemv), and as below at 9-32 tokens,
      where tc loses to ksplit.
    Others: one token, stream where K >= 4096 and N <= K, gemv elsewhere; 17-32 tokens, ksplit (two 16-token
    tiles) unless the output is at least 3x the input, where staged shares its staged activations over
    more rows; then AUTO_KERNELS by token count."""
    wide = out_features >= 3 * in_features
    long_k = in_features >= TC_LONG_K
    if num_tokens <= TC_MAX_TOKENS and tc_reason(bits, in_features, out_features, group_size) is None:
        if wide:
            return "tcs"
        if long_k or num_tokens <= 8:
            return "tc"
    if num_tokens == 1 and long_k and out_features <= in_features:
        return "stream"
    if 16 < num_tokens <= 32 and not wide:
        return "ksplit"
    return next(kernel for bound, kernel in AUTO_KERNELS if num_tokens <= bound)


def weight_read_probe(qweight: torch.Tensor, bits: int, in_features: int) -> None:
    """Diagnostic: the ksplit kernel's weight loads with no math (what its access pattern streams)."""
    index = qweight.device.index
    sink = torch.empty(1, dtype=torch.int32, device=qweight.device)
    fn = get_kernel(SOURCE, f"quant_read_probe_kernel<{bits}>", index)
    out_features = qweight.shape[0]
    launch(fn, ((out_features + KSPLIT_ROWS_PER_CTA - 1) // KSPLIT_ROWS_PER_CTA, 1, 1), (256, 1, 1), (
        ptr(qweight), ptr(sink), i32(out_features), i32(in_features)), index)


def split_ksplit(num_rows: int, in_features: int, num_sms: int) -> int:
    """K-parts per row pair of the split GEMV: the fewest that give at least SPLIT_CTAS_PER_SM full CTAs
    of warps per SM (a CTA holds SPLIT_WARPS / ksplit row pairs), but no more parts than K has 32-chunk
    strides for its lanes (32 * ksplit <= K / 32), so that every lane of every part has a chunk."""
    row_pairs = -(-num_rows // 2)
    num_chunks = in_features // 32
    allowed = [parts for parts in SPLIT_PARTS if parts == 1 or 32 * parts <= num_chunks]
    wanted_warps = SPLIT_CTAS_PER_SM * num_sms * SPLIT_WARPS
    for parts in allowed:
        if -(-row_pairs // (SPLIT_WARPS // parts)) * SPLIT_WARPS >= wanted_warps:
            return parts
    return allowed[-1]


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


def _split_workspace(device: torch.device, numel: int) -> torch.Tensor:
    """An fp32 buffer of at least `numel` elements for split-K partials, cached per device and size
    class (a power of two) and kept for the life of the process, since captured CUDA graphs hold its
    address. Under capture with no cached buffer large enough, a fresh one comes from the graph's pool."""
    size = 1 << max(0, numel - 1).bit_length()
    key = (device.index, size)
    buffer = _workspaces.get(key)
    if buffer is None:
        buffer = torch.empty(size, dtype=torch.float32, device=device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return buffer
        _workspaces[key] = buffer
    return buffer


def _split_plan(num_segments: int, tiles: int, num_tokens: int, in_features: int, device_index: int,
                splits: int | None) -> tuple[int, int]:
    """(splits, segments per split) of a tiled kernel: about one CTA per SM, but never so many splits
    that the fp32 partials (splits x M x N) outweigh the packed weights (N x K / 2 bytes) / 2."""
    if splits is None:
        wanted = round(_num_sms(device_index) / tiles)
        splits = max(1, min(num_segments, wanted, in_features // (16 * num_tokens)))
    per_split = -(-num_segments // splits)
    return -(-num_segments // per_split), per_split  # no empty split


def _tc_grid_block(index: int, tile: int, num_tokens: int, out_features: int) -> tuple[tuple, tuple]:
    """(grid, block) of quant_tc_gemv_kernel and quant_tc_rope_kernel: a CTA per 16-row tile and token tile, of 16
    warps when every CTA is resident at once (one per SM at ~120 registers), else 8 (two per SM)."""
    row_tiles = out_features // TC_ROWS_PER_CTA
    warps = 16 if tile == 1 and row_tiles <= _num_sms(index) else 8
    return (row_tiles, (num_tokens + 8 * tile - 1) // (8 * tile), 1), (32 * warps, 1, 1)


def _tcs_grid_splits(index: int, tile: int, num_tokens: int, row_tiles: int, in_features: int,
                     splits: int | None) -> tuple:
    """(grid, block, splits, segments per split) of quant_tcs_kernel and quant_tcs_act_kernel: 8-warp CTAs of 128
    output rows and `tile` token tiles, split along K."""
    token_tiles = (num_tokens + 8 * tile - 1) // (8 * tile)
    if splits is None and tile == 1 and row_tiles * token_tiles < 2 * _num_sms(index):
        # Up to 8 tokens, between one and two CTAs per SM leave some SMs with twice the work of others;
        # two K-splits even that out (2048x22016, H200: one token 12.9 us against 14.7 unsplit;
        # results/sweep_tcs_splits_bf16_nvidia_h200_55cc580.json). From 9 tokens one split stays fastest.
        splits = 2
    splits, per_split = _split_plan(in_features // TC_SEGMENT, row_tiles * token_tiles, 8 * tile * token_tiles,
                                    in_features, index, splits)
    if splits > 1 and row_tiles * token_tiles > _COUNTER_SLOTS:
        raise ValueError(f"{row_tiles * token_tiles} output tiles exceed the split-K counter slots")
    return (row_tiles, token_tiles, splits), (256, 1, 1), splits, per_split


def _plan(index: int, dt: int, bits: int, scale_f32: int, num_tokens: int, out_features: int, in_features: int,
          name: str, tile: int, splits: int | None, mode: int = 0) -> tuple:
    """(kernel, grid, block, splits, segments per split) of one launch, cached per shape and dtype; `mode` is
    the tc / tcs kernels' tc_mode."""
    key = (index, dt, bits, scale_f32, num_tokens, out_features, in_features, name, tile, splits, mode)
    plan = _plans.get(key)
    if plan is not None:
        return plan
    template = f"<{dt},{bits},{tile},{scale_f32}>"
    if name in ("gemv", "stream"):
        rows = 8  # 4 warps x 2 rows
        fn = get_kernel(SOURCE, f"quant_{name}_kernel{template}", index)
        plan = (fn, ((out_features + rows - 1) // rows, (num_tokens + tile - 1) // tile, 1), (128, 1, 1), 1, 0)
    elif name == "split":
        if splits is None:
            splits = split_ksplit(out_features, in_features, _num_sms(index))
        elif splits not in SPLIT_PARTS:
            raise ValueError(f"the split kernel takes {SPLIT_PARTS} K-parts, not splits={splits}")
        rows = 2 * (SPLIT_WARPS // splits)
        fn = get_kernel(SOURCE, f"quant_gemv_split_kernel{template}", index)
        plan = (fn, ((out_features + rows - 1) // rows, (num_tokens + tile - 1) // tile, 1), (32 * SPLIT_WARPS, 1, 1),
                splits, 0)
    elif name == "tc":
        fn = get_kernel(SOURCE, f"quant_tc_gemv_kernel<{dt},{tile},{mode},{scale_f32}>", index)
        plan = (fn, *_tc_grid_block(index, tile, num_tokens, out_features), 1, 0)
    elif name == "ksplit":
        fn = get_kernel(SOURCE, f"quant_mma_ksplit_kernel{template}", index)
        plan = (fn, ((out_features + KSPLIT_ROWS_PER_CTA - 1) // KSPLIT_ROWS_PER_CTA,
                     (num_tokens + 8 * tile - 1) // (8 * tile), 1), (256, 1, 1), 1, 0)
    elif name == "tcs":
        fn = get_kernel(SOURCE, f"quant_tcs_kernel<{dt},{tile},{mode},{scale_f32}>", index)
        plan = (fn, *_tcs_grid_splits(index, tile, num_tokens, -(-out_features // STAGED_ROWS_PER_CTA), in_features,
                                      splits))
    else:
        rows, threads = (STAGED_ROWS_PER_CTA, 256) if name == "staged" else (MMA_ROWS_PER_CTA, 128)
        row_tiles = (out_features + rows - 1) // rows
        token_tiles = (num_tokens + 8 * tile - 1) // (8 * tile)
        num_segments = (in_features + MMA_SEGMENT - 1) // MMA_SEGMENT
        if name == "staged":
            splits, per_split = _split_plan(num_segments, row_tiles * token_tiles, 8 * tile * token_tiles,
                                            in_features, index, splits)
        else:
            if splits is None:
                target_ctas = 4 * _num_sms(index)
                splits = max(1, min(num_segments, -(-target_ctas // (row_tiles * token_tiles))))
            per_split = -(-num_segments // splits)
            splits = -(-num_segments // per_split)
        if splits > 1 and row_tiles * token_tiles > _COUNTER_SLOTS:
            raise ValueError(f"{row_tiles * token_tiles} output tiles exceed the split-K counter slots")
        kernel_name = "quant_mma_staged_kernel" if name == "staged" else "quant_mma_kernel"
        fn = get_kernel(SOURCE, f"{kernel_name}{template}", index)
        plan = (fn, (row_tiles, token_tiles, splits), (threads, 1, 1), splits, per_split)
    _plans[key] = plan
    return plan


def _activation_operands(x: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x as the kernels read it (contiguous, 16-byte aligned: they load activations 16 bytes at a time) and the
    bias in x's dtype, contiguous."""
    x = x.contiguous()
    if x.data_ptr() % 16:
        x = x.clone()
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
        bias = bias.to(x.dtype).contiguous()
    return x, bias


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                 group_size: int, zero_mode: str, bias: torch.Tensor | None = None,
                 kernel: str = "auto", tile: int | None = None, splits: int | None = None,
                 out: torch.Tensor | None = None, integer_zeros: bool = False) -> torch.Tensor:
    """x [M, K] (fp16/bf16, already in input_perm order) -> [M, N] in x's dtype.

    kernel: "auto" | "gemv" | "stream" | "split" | "ksplit" | "staged" | "mma" | "tc" | "tcs"; tile: tokens
    per CTA (gemv, stream, split: 1/2/4) or 8-token tiles (ksplit: 1/2, staged and mma: 1/2/4/8, tc and tcs:
    1/2/4); splits: K splits across CTAs of the staged, mma and tcs kernels (default: enough CTAs to fill
    the GPU), or K-parts within a CTA of the split kernel (1/2/4/8, default `split_ksplit`); out: a
    contiguous [M, N] buffer;
    integer_zeros: every zero point is a whole number (PackedWeight.integer_zeros), which lets the tc and tcs
    kernels scale group sums instead of weights.
    """
    num_tokens, in_features = x.shape
    out_features = qweight.shape[0]
    x, bias = _activation_operands(x, bias)
    device = x.device
    if out is None:
        out = torch.empty(num_tokens, out_features, dtype=x.dtype, device=device)
    if num_tokens == 0:
        return out
    name = (pick_kernel(num_tokens, in_features, out_features, bits, group_size) if kernel == "auto" else kernel)
    tile = tile or default_tile(name, num_tokens)
    index = device.index
    dt = _DTYPE_CODES[x.dtype]
    mode = 0
    if name in ("tc", "tcs"):
        # an automatic pick already passed tc_reason; an explicit kernel is checked here
        reason = tc_reason(bits, in_features, out_features, group_size) if kernel != "auto" else None
        if reason:
            raise ValueError(f"the {name} kernel does not take {reason}")
        mode = tc_mode(zero_mode, integer_zeros, group_size)
    fn, grid, block, split_count, per_split = _plan(index, dt, bits, int(scales.dtype == torch.float32), num_tokens,
                                                    out_features, in_features, name, tile, splits, mode)
    head = (ptr(x), ptr(qweight), ptr(scales), ptr(zeros), ptr(bias), ptr(out))
    sizes = (i32(num_tokens), i32(out_features), i32(in_features), i32(group_size),
             i32(0 if zero_mode == "zero" else 1))
    if name in ("tc", "tcs"):
        sizes = sizes[:3] + (i32(tc_group_shift(in_features, group_size)),) + sizes[4:]
    if name in ("gemv", "stream", "ksplit", "tc"):
        launch(fn, grid, block, head + sizes, index)
        return out
    if name == "split":
        launch(fn, grid, block, head + sizes + (i32(split_count),), index)
        return out
    partials = counters = None
    if split_count > 1:
        partials = _split_workspace(device, split_count * num_tokens * out_features)
        counters = _split_counters(device)
    launch(fn, grid, block, head + (ptr(partials), ptr(counters)) + sizes + (i32(per_split),), index)
    return out


QKV_ROPE_MAX_TOKENS = 8  # one token tile of quant_tc_rope_kernel


def qkv_rope_unsupported_reason(qweight: torch.Tensor, bits: int, group_size: int, in_features: int, num_heads: int,
                                num_kv_heads: int, head_dim: int, key_cache: torch.Tensor,
                                dtype: torch.dtype) -> str | None:
    """Why quant_matmul_rope_cache cannot serve this merged q/k/v projection at any token count (None when it can;
    qkv_rope_takes then says which token counts): a weight the tc kernel takes, heads that tile into rotation
    pairs, and a cache in the activations' dtype (an int8 cache's per-head scale needs the whole head, which spans
    CTAs)."""
    out_features = qweight.shape[0]
    reason = tc_reason(bits, in_features, out_features, group_size)
    if reason:
        return f"the tc kernel does not take {reason}"
    if head_dim % 16:
        return f"head_dim {head_dim} (needs a multiple of 16: a tile is 8 rotation pairs)"
    if out_features != (num_heads + 2 * num_kv_heads) * head_dim:
        return f"{out_features} outputs are not ({num_heads} + 2 x {num_kv_heads}) heads x {head_dim}"
    if key_cache.dtype != dtype:
        return f"KV cache dtype {key_cache.dtype} with activations {dtype}"
    block_size = key_cache.shape[2]
    if block_size & (block_size - 1):
        return f"block_size {block_size} is not a power of two"
    return None


def qkv_rope_takes(num_tokens: int, in_features: int, out_features: int) -> bool:
    """Whether quant_matmul_rope_cache serves an M-token product of a weight qkv_rope_unsupported_reason accepts:
    where dispatch would pick tc for the plain product, up to one token tile (decode steps)."""
    return 0 < num_tokens <= QKV_ROPE_MAX_TOKENS and pick_kernel(num_tokens, in_features, out_features) == "tc"


def quant_matmul_rope_cache(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                            bias: torch.Tensor | None, group_size: int, zero_mode: str, integer_zeros: bool,
                            num_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
                            key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The merged q/k/v product x [M, K] @ W.T (+ bias) with RoPE on q and k and the k/v cache write fused into its
    epilogue (quant_tc_rope_kernel; for weights qkv_rope_unsupported_reason accepts, at token counts qkv_rope_takes).
    cos/sin [M, D/2] (or [M, 1, D/2]) in x's dtype, slot_mapping [M] int64. Returns (rotated query [M, H, D],
    rotated key [M, KVH, D], value [M, KVH, D] as a view of the product's v columns): what quant_matmul followed by
    rope_cache.rope_and_cache_write give, bit for bit."""
    num_tokens, in_features = x.shape
    out_features = qweight.shape[0]
    x, bias = _activation_operands(x, bias)
    device = x.device
    out = torch.empty(num_tokens, out_features, dtype=x.dtype, device=device)
    query = torch.empty(num_tokens, num_heads, head_dim, dtype=x.dtype, device=device)
    key = torch.empty(num_tokens, num_kv_heads, head_dim, dtype=x.dtype, device=device)
    value = out[:, (num_heads + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    if num_tokens == 0:
        return query, key, value
    cos = cos.reshape(num_tokens, head_dim // 2).contiguous()
    sin = sin.reshape(num_tokens, head_dim // 2).contiguous()
    index = device.index
    mode = tc_mode(zero_mode, integer_zeros, group_size)
    grid, block = _tc_grid_block(index, 1, num_tokens, out_features)
    scale_f32 = int(scales.dtype == torch.float32)
    fn = get_kernel(SOURCE, f"quant_tc_rope_kernel<{_DTYPE_CODES[x.dtype]},{mode},{scale_f32}>", index)
    launch(fn, grid, block, (
        ptr(x), ptr(qweight), ptr(scales), ptr(zeros), ptr(bias), ptr(out), ptr(query), ptr(key), ptr(cos), ptr(sin),
        ptr(key_cache), ptr(value_cache), ptr(slot_mapping.to(torch.int64).contiguous()), i32(num_tokens),
        i32(out_features), i32(in_features), i32(tc_group_shift(in_features, group_size)),
        i32(0 if zero_mode == "zero" else 1), i32(num_heads), i32(num_kv_heads), i32(head_dim),
        i32(key_cache.shape[2].bit_length() - 1)), index)
    return query, key, value


def gate_up_act_unsupported_reason(qweight: torch.Tensor, bits: int, group_size: int, in_features: int,
                                   activation: str) -> str | None:
    """Why quant_matmul_act_and_mul cannot serve this merged [gate | up] projection at any token count (None when
    it can; gate_up_act_takes then says which token counts): a weight the tcs kernel takes, halves of whole 16-row
    tiles, and an activation act_and_mul has."""
    out_features = qweight.shape[0]
    reason = tc_reason(bits, in_features, out_features, group_size)
    if reason:
        return f"the tcs kernel does not take {reason}"
    if out_features % (2 * TC_ROWS_PER_CTA):
        return f"{out_features} outputs are not two halves of whole {TC_ROWS_PER_CTA}-row tiles"
    if activation not in ACTIVATIONS:
        return f"activation {activation!r}"
    return None


def gate_up_act_takes(num_tokens: int, in_features: int, out_features: int) -> bool:
    """Whether quant_matmul_act_and_mul serves an M-token product of a weight gate_up_act_unsupported_reason
    accepts: where dispatch would pick tcs for the plain product (1-32 tokens)."""
    return num_tokens > 0 and pick_kernel(num_tokens, in_features, out_features) == "tcs"


MAX_CLUSTER_SPLITS = 8  # the portable thread-block cluster size


def quant_matmul_act_and_mul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                             bias: torch.Tensor | None, group_size: int, zero_mode: str, integer_zeros: bool,
                             activation: str, cluster_splits: bool | None = None) -> torch.Tensor:
    """The merged [gate | up] product x [M, K] @ W.T (+ bias), W [2I, K], with the gated activation in its epilogue
    (quant_tcs_act_kernel; for weights gate_up_act_unsupported_reason accepts, at token counts gate_up_act_takes):
    act(gate) * up [M, I], what quant_matmul followed by act_and_mul.act_and_mul gives, bit for bit.
    cluster_splits: with K splits, a tile's splits meet in a thread-block cluster's shared memory instead of fp32
    partials in global memory (None: where the device has clusters and there are at most MAX_CLUSTER_SPLITS)."""
    num_tokens, in_features = x.shape
    inner = qweight.shape[0] // 2
    x, bias = _activation_operands(x, bias)
    device = x.device
    out = torch.empty(num_tokens, inner, dtype=x.dtype, device=device)
    if num_tokens == 0:
        return out
    index = device.index
    tile = default_tile("tcs", num_tokens)
    mode = tc_mode(zero_mode, integer_zeros, group_size)
    scale_f32 = int(scales.dtype == torch.float32)
    # a CTA's 128 rows are 64 of gate and the 64 matching rows of up
    grid, block, splits, per_split = _tcs_grid_splits(index, tile, num_tokens, -(-inner // (STAGED_ROWS_PER_CTA // 2)),
                                                      in_features, None)
    if cluster_splits is None:
        cluster_splits = 1 < splits <= MAX_CLUSTER_SPLITS and clusters_available(index)
    elif cluster_splits and not (1 < splits <= MAX_CLUSTER_SPLITS and clusters_available(index)):
        raise ValueError(f"cluster_splits needs 2-{MAX_CLUSTER_SPLITS} K splits (this product has {splits}) on SM90+")
    name = f"quant_tcs_act_kernel<{_DTYPE_CODES[x.dtype]},{tile},{mode},{scale_f32},{ACTIVATIONS[activation]}"
    fn = get_kernel(SOURCE, name + (",1>" if cluster_splits else ">"), index)
    partials = counters = None
    if splits > 1 and not cluster_splits:
        partials = _split_workspace(device, splits * num_tokens * 2 * inner)
        counters = _split_counters(device)
    launch(fn, grid, block, (
        ptr(x), ptr(qweight), ptr(scales), ptr(zeros), ptr(bias), ptr(out), ptr(partials), ptr(counters),
        i32(num_tokens), i32(inner), i32(in_features), i32(tc_group_shift(in_features, group_size)),
        i32(0 if zero_mode == "zero" else 1), i32(per_split)), index,
        cluster=(1, 1, splits) if cluster_splits else None)
    return out
