"""Launchers of the W4A16/W3A16 kernels in quant_matmul.cu. Which kernel serves a product is core/ops' choice
(core/ops/quant_matmul_table.py, docs/KERNELS.md); the launcher takes it as `kernel=`.

Six kernels compute x @ W.T from the same packed layout (core/quant/packed.py, passed here as plain tensors):
- "gemv": CUDA cores, up to 4 tokens per weight read, 2 rows per warp (`quant_gemv_kernel<DT, BITS, MT, SCALE_F32>`);
- "stream": CUDA cores, up to 4 tokens, 2 rows per warp with 4 chunks of loads in flight per lane and half2
  products (`quant_stream_kernel`);
- "ksplit": tensor cores (mma.sync m16n8k16), 8 or 16 tokens per weight read; a CTA's 8 warps share 16 output
  rows and split K among themselves (`quant_mma_ksplit_kernel`);
- "staged": tensor cores, 8 to 64 tokens per weight read, 128 output rows per CTA with the tokens' activations
  staged once per CTA in shared memory, split along K across CTAs (`quant_mma_staged_kernel`);
- "tc": tensor cores, W4 only, 8/16/32 tokens per weight read, 16 output rows per CTA of 8 or 16 warps splitting
  K (`quant_tc_gemv_kernel`): ksplit's layout with about half the instructions per weight byte, and with integer
  zero points each group's sum is scaled once (`tc_reason` says which weights it takes);
- "tcs": tc's loads and pairs with staged's layout (128 rows per CTA, the activations of a K stage staged once in
  shared memory, split along K) (`quant_tcs_kernel`).
Two more run tc / tcs with an epilogue fused in: quant_matmul_rope_cache (RoPE and the KV-cache write of a merged
q/k/v product) and quant_matmul_act_and_mul (the gated activation of a merged gate/up product).

The capability checks (`unsupported_reason`, `tc_reason`, ...) read plain values (PackedOperands, dtypes, sizes),
not tensors, so core/ops can cache a decision under exactly what it was made from.
"""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

import torch

from deepinfer.kernels import rope_cache
from deepinfer.kernels.act_and_mul import ACTIVATIONS
from deepinfer.kernels.compiler import get_kernel
from deepinfer.kernels.launch import clusters_available, i32, launch, ptr

SOURCE = "quant_matmul.cu"
_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}
MAX_TILE = {"gemv": 4, "stream": 4, "ksplit": 2, "staged": 8, "tc": 4, "tcs": 4}
KERNELS = tuple(MAX_TILE)
STAGED_ROWS_PER_CTA = 128
KSPLIT_ROWS_PER_CTA = 16
TC_ROWS_PER_CTA = 16
TC_SEGMENT = 128  # codes of K per thread-quad step of the tc kernel
MMA_SEGMENT = 128  # codes of K per thread-quad step
_CUDA_CORE_KERNELS = ("gemv", "stream")
_COUNTER_SLOTS = 1 << 14

_counters: dict[int, torch.Tensor] = {}
_workspaces: dict[tuple[int, int], torch.Tensor] = {}
_plans: dict[tuple, tuple] = {}


class PackedOperands(NamedTuple):
    """What the kernels' checks read of a packed weight (`packed_operands` builds it from the tensors)."""

    bits: int
    group_size: int
    scales_dtype: torch.dtype
    zeros_dtype: torch.dtype
    contiguous: bool  # qweight, scales and zeros
    aligned: bool  # qweight starts on a 16-byte boundary


def packed_operands(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                    group_size: int) -> PackedOperands:
    return PackedOperands(bits, group_size, scales.dtype, zeros.dtype,
                          qweight.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous(),
                          qweight.data_ptr() % 16 == 0)


def packed_layout_reason(weight: PackedOperands, bit_widths: tuple[int, ...] = (3, 4)) -> str | None:
    """Why a packed weight is outside what every W4/W3 kernel reads (None when it is inside); `bit_widths`: the
    code widths of the kernel asking (dequantize.cu and w8_gemm.cu read 8-bit codes too)."""
    if weight.bits not in bit_widths:
        return f"{weight.bits}-bit weights"
    if weight.scales_dtype not in (torch.float16, torch.float32) or weight.zeros_dtype != weight.scales_dtype:
        return f"scales {weight.scales_dtype} / zeros {weight.zeros_dtype}"
    if weight.group_size % 32:
        return f"group size {weight.group_size} (kernels need a multiple of 32)"
    if not weight.contiguous:
        return "non-contiguous packed weight"
    return None


def unsupported_reason(dtype: torch.dtype, weight: PackedOperands) -> str | None:
    """Why the kernels cannot multiply `dtype` activations by this weight (None when they can)."""
    if dtype not in _DTYPE_CODES:
        return f"activation dtype {dtype} (kernels take float16/bfloat16)"
    reason = packed_layout_reason(weight)
    if reason:
        return reason
    if weight.bits == 4 and not weight.aligned:
        return "qweight not 16-byte aligned"
    return None


def default_tile(kernel: str, num_tokens: int) -> int:
    """Tokens per CTA of gemv/stream (1, 2, 4) or 8-token tiles per CTA of ksplit (1, 2), staged (1..8), tc and
    tcs (1, 2, 4)."""
    sizes = tuple(size for size in (1, 2, 4, 8) if size <= MAX_TILE[kernel])
    unit = 1 if kernel in _CUDA_CORE_KERNELS else 8
    return next((size for size in sizes if num_tokens <= size * unit), sizes[-1])


def instantiations() -> tuple[str, ...]:
    """Every template instantiation the launcher can ask for (compiled ahead by validate-kernels)."""
    tiles = {"gemv": (1, 2, 4), "stream": (1, 2, 4), "ksplit": (1, 2), "staged": (1, 2, 4, 8)}
    kernels = {"gemv": "quant_gemv_kernel", "stream": "quant_stream_kernel", "ksplit": "quant_mma_ksplit_kernel",
               "staged": "quant_mma_staged_kernel"}
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
    """Why the tc and tcs kernels cannot take this weight (None when they can): they read whole 16-row tiles and
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


def split_k_buffers(device: torch.device, splits: int, tiles: int,
                    tile_outputs: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(fp32 partials, arrival counters) of a split-K launch over `tiles` output tiles of `tile_outputs` sums each;
    (None, None) for one split."""
    if splits <= 1:
        return None, None
    if tiles > _COUNTER_SLOTS:
        raise ValueError(f"{tiles} output tiles exceed the split-K counter slots")
    return _split_workspace(device, splits * tiles * tile_outputs), _split_counters(device)


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
        # two K-splits even that out (docs/KERNELS.md). From 9 tokens one split stays fastest.
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
    if name in _CUDA_CORE_KERNELS:
        rows = 8  # 4 warps x 2 rows
        fn = get_kernel(SOURCE, f"quant_{name}_kernel{template}", index)
        plan = (fn, ((out_features + rows - 1) // rows, (num_tokens + tile - 1) // tile, 1), (128, 1, 1), 1, 0)
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
    else:  # staged
        row_tiles = (out_features + STAGED_ROWS_PER_CTA - 1) // STAGED_ROWS_PER_CTA
        token_tiles = (num_tokens + 8 * tile - 1) // (8 * tile)
        num_segments = (in_features + MMA_SEGMENT - 1) // MMA_SEGMENT
        splits, per_split = _split_plan(num_segments, row_tiles * token_tiles, 8 * tile * token_tiles,
                                        in_features, index, splits)
        if splits > 1 and row_tiles * token_tiles > _COUNTER_SLOTS:
            raise ValueError(f"{row_tiles * token_tiles} output tiles exceed the split-K counter slots")
        fn = get_kernel(SOURCE, f"quant_mma_staged_kernel{template}", index)
        plan = (fn, (row_tiles, token_tiles, splits), (256, 1, 1), splits, per_split)
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
                 group_size: int, zero_mode: str, bias: torch.Tensor | None = None, *, kernel: str,
                 tile: int | None = None, splits: int | None = None, out: torch.Tensor | None = None,
                 integer_zeros: bool = False) -> torch.Tensor:
    """x [M, K] (fp16/bf16, already in input_perm order) -> [M, N] in x's dtype, on `kernel` (one of KERNELS).

    tile: tokens per CTA (gemv, stream: 1/2/4) or 8-token tiles (ksplit: 1/2, staged: 1/2/4/8, tc and tcs: 1/2/4;
    default `default_tile`); splits: K splits across CTAs of the staged and tcs kernels (default: enough CTAs to
    fill the GPU); out: a contiguous [M, N] buffer; integer_zeros: every zero point is a whole number
    (PackedWeight.integer_zeros), which lets the tc and tcs kernels scale group sums instead of weights.
    """
    if kernel not in MAX_TILE:
        raise ValueError(f"unknown kernel {kernel!r}; choose from {', '.join(KERNELS)}")
    num_tokens, in_features = x.shape
    out_features = qweight.shape[0]
    x, bias = _activation_operands(x, bias)
    device = x.device
    if out is None:
        out = torch.empty(num_tokens, out_features, dtype=x.dtype, device=device)
    if num_tokens == 0:
        return out
    tile = tile or default_tile(kernel, num_tokens)
    index = device.index
    dt = _DTYPE_CODES[x.dtype]
    mode = 0
    if kernel in ("tc", "tcs"):
        reason = tc_reason(bits, in_features, out_features, group_size)
        if reason:
            raise ValueError(f"the {kernel} kernel does not take {reason}")
        mode = tc_mode(zero_mode, integer_zeros, group_size)
    fn, grid, block, split_count, per_split = _plan(index, dt, bits, int(scales.dtype == torch.float32), num_tokens,
                                                    out_features, in_features, kernel, tile, splits, mode)
    head = (ptr(x), ptr(qweight), ptr(scales), ptr(zeros), ptr(bias), ptr(out))
    sizes = (i32(num_tokens), i32(out_features), i32(in_features), i32(group_size),
             i32(0 if zero_mode == "zero" else 1))
    if kernel in ("tc", "tcs"):
        sizes = sizes[:3] + (i32(tc_group_shift(in_features, group_size)),) + sizes[4:]
    if kernel in ("gemv", "stream", "ksplit", "tc"):
        launch(fn, grid, block, head + sizes, index)
        return out
    partials = counters = None
    if split_count > 1:
        partials = _split_workspace(device, split_count * num_tokens * out_features)
        counters = _split_counters(device)
    launch(fn, grid, block, head + (ptr(partials), ptr(counters)) + sizes + (i32(per_split),), index)
    return out


QKV_ROPE_MAX_TOKENS = 8  # one token tile of quant_tc_rope_kernel


def qkv_rope_unsupported_reason(bits: int, group_size: int, in_features: int, out_features: int, num_heads: int,
                                num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype, block_size: int,
                                dtype: torch.dtype) -> str | None:
    """Why quant_matmul_rope_cache cannot serve this merged q/k/v projection ([N, K] weight, `dtype` activations, a
    `kv_dtype` cache of `block_size`-token blocks), None when it can: a weight the tc kernel takes, heads that tile
    into rotation pairs, and a cache in the activations' dtype, int8 or e4m3 (an int8 row's scale is one warp's
    reduction over the head: head_dim up to rope_cache.MAX_HEAD_DIM)."""
    reason = tc_reason(bits, in_features, out_features, group_size)
    if reason:
        return f"the tc kernel does not take {reason}"
    if head_dim % 16:
        return f"head_dim {head_dim} (needs a multiple of 16: a tile is 8 rotation pairs)"
    if out_features != (num_heads + 2 * num_kv_heads) * head_dim:
        return f"{out_features} outputs are not ({num_heads} + 2 x {num_kv_heads}) heads x {head_dim}"
    if kv_dtype not in (dtype, *rope_cache.KV_CODES):
        return f"KV cache dtype {kv_dtype} with activations {dtype}"
    if kv_dtype == torch.int8 and head_dim > rope_cache.MAX_HEAD_DIM:
        return f"head_dim {head_dim} over an int8 cache (at most {rope_cache.MAX_HEAD_DIM})"
    if block_size & (block_size - 1):
        return f"block_size {block_size} is not a power of two"
    return None


def quant_matmul_rope_cache(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                            bias: torch.Tensor | None, group_size: int, zero_mode: str, integer_zeros: bool,
                            num_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
                            key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                            key_scales: torch.Tensor | None = None, value_scales: torch.Tensor | None = None,
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The merged q/k/v product x [M, K] @ W.T (+ bias) with RoPE on q and k and the k/v cache write fused into its
    epilogue (quant_tc_rope_kernel, for weights qkv_rope_unsupported_reason accepts; core/ops sends it decode steps).
    cos/sin [M, D/2] (or [M, 1, D/2]) in x's dtype, slot_mapping [M] int64; key_scales/value_scales: an int8
    cache's [NB, KVH, BS] fp16 or an e4m3 cache's [KVH] fp32 (core/kv/cache.py). Returns (rotated query [M, H, D],
    rotated key [M, KVH, D], value [M, KVH, D] as a view of the product's v columns): what the tc product followed
    by rope_cache.rope_and_cache_write give, bit for bit."""
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
    kv = rope_cache.KV_CODES.get(key_cache.dtype, 0)
    if kv and (key_scales is None or value_scales is None):
        raise ValueError(f"a {key_cache.dtype} cache needs its key and value scales")
    # an int8 cache's heads count their CTAs' arrivals: 2 KVH counters per token tile
    counters = _split_counters(device) if key_cache.dtype == torch.int8 else None
    fn = get_kernel(SOURCE, f"quant_tc_rope_kernel<{_DTYPE_CODES[x.dtype]},{mode},{scale_f32},{kv}>", index)
    launch(fn, grid, block, (
        ptr(x), ptr(qweight), ptr(scales), ptr(zeros), ptr(bias), ptr(out), ptr(query), ptr(key), ptr(cos), ptr(sin),
        ptr(key_cache), ptr(value_cache), ptr(key_scales if kv else None), ptr(value_scales if kv else None),
        ptr(counters), ptr(slot_mapping.to(torch.int64).contiguous()), i32(num_tokens),
        i32(out_features), i32(in_features), i32(tc_group_shift(in_features, group_size)),
        i32(0 if zero_mode == "zero" else 1), i32(num_heads), i32(num_kv_heads), i32(head_dim),
        i32(key_cache.shape[2].bit_length() - 1)), index)
    return query, key, value


def gate_up_act_unsupported_reason(bits: int, group_size: int, in_features: int, out_features: int,
                                   activation: str) -> str | None:
    """Why quant_matmul_act_and_mul cannot serve this merged [gate | up] projection ([N, K] weight), None when it
    can: a weight the tcs kernel takes, halves of whole 16-row tiles, and an activation act_and_mul has."""
    reason = tc_reason(bits, in_features, out_features, group_size)
    if reason:
        return f"the tcs kernel does not take {reason}"
    if out_features % (2 * TC_ROWS_PER_CTA):
        return f"{out_features} outputs are not two halves of whole {TC_ROWS_PER_CTA}-row tiles"
    if activation not in ACTIVATIONS:
        return f"activation {activation!r}"
    return None


MAX_CLUSTER_SPLITS = 8  # the portable thread-block cluster size


def quant_matmul_act_and_mul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                             bias: torch.Tensor | None, group_size: int, zero_mode: str, integer_zeros: bool,
                             activation: str, cluster_splits: bool | None = None) -> torch.Tensor:
    """The merged [gate | up] product x [M, K] @ W.T (+ bias), W [2I, K], with the gated activation in its epilogue
    (quant_tcs_act_kernel, for weights gate_up_act_unsupported_reason accepts): act(gate) * up
    [M, I], what the tcs product followed by act_and_mul.act_and_mul gives, bit for bit.
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
