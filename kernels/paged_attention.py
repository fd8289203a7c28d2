"""Launchers of the paged attention kernels in paged_attention.cu: decode (one query token per sequence) on one of
three paths, and prefill tiles. Which path serves a batch is core/ops' choice (core/ops/paged_attention_table.py,
docs/KERNELS.md); the launcher takes it as `path=`.

Decode: one CTA per (kv head, 16-query-head tile, sequence, context split):
- "combined": one split, a CTA of COMBINED_WARPS warps that take the sequence's 16-token tiles round robin up to
  its real seq_len and combine their softmax states in shared memory. One kernel, no partials, no dependent reduce
  launch. The grid does not depend on max_seq_len and the work follows the real context, so a CUDA graph captured
  at a 1024-token bound runs a 300-token context at the cost of 300 tokens.
- "clustered" (SM90+): the combined path's kernel with each (KV head tile, sequence) spread over a thread-block
  cluster of CLUSTER_CTAS CTAs, whose warps take the tiles round robin and combine their states through
  distributed shared memory: one kernel, spread over more SMs.
- "split": one warp a CTA, the context cut into splits of at least MIN_TOKENS_PER_SPLIT tokens whose count fills
  whole waves of the CTAs the GPU holds at once (a partial last wave would leave SMs idle at the end); with more
  than one split, paged_reduce_kernel combines the splits' partial outputs. The split count, hence the grid,
  depends only on max_seq_len, and splits past a sequence's end write an empty partial.
- "combined_split": the combined path's CTAs, each over one split of the context (about one CTA an SM in whole
  waves, at most REDUCE_HELD_SPLITS splits: combined_split_plan), then paged_reduce_kernel. Long contexts: one-warp
  splits numerous enough to fill the GPU would each write a partial of all the KV head's query heads for a few
  tiles of keys, and the partials would outweigh the cache; a CTA's warps combine theirs in shared memory and
  write one.

With at most HEADS_N_MAX_GROUP query heads a KV head, head_dim in HEADS_N_HEAD_DIMS and blocks of 8 tokens or more
(any cache dtype), every path runs paged_decode_heads_n_kernel (`heads_n_serves`): the KV head's query heads as the
mma's N dimension (S^T = K Q^T, O^T += V^T P^T; kernels/paged_attention.cu), one CTA per (KV head, sequence, split
or cluster rank), half the mma and half the instructions a cache byte of paged_decode_kernel's heads-as-rows tiles,
which serve everything else.

For CUDA-graph capture pass a fixed `max_seq_len` (the longest context the graph must serve): the grid depends
only on it, the path and the batch's shape.
"""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

import torch

from deepinfer.kernels.compiler import get_kernel
from deepinfer.kernels.launch import clusters_available, f32, i32, launch, ptr

SOURCE = "paged_attention.cu"
_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}
# The kernels' KVQ template argument of a quantized cache (0: the query dtype): kernels/paged_attention.cu
_KV_CODES = {torch.int8: 1, torch.float8_e4m3fn: 2}
MAX_HEAD_DIM = 256
TILE_TOKENS = 16
DECODE_PATHS = ("split", "combined", "clustered", "combined_split")
# Down to two 16-token tiles a split: the reduce reads the splits in parallel, so short splits cost little there
# (docs/KERNELS.md).
MIN_TOKENS_PER_SPLIT = 32
TARGET_TOKENS_PER_SPLIT = 256
# paged_reduce_kernel keeps a weight per split in shared memory (4 bytes each, 32 KiB at most): contexts past
# 8192 x 32 tokens take longer splits instead.
MAX_SPLITS = 8192
# Beyond this many waves of CTAs the GPU is busy anyway; more splits would only grow the partials
# (steps of many tokens, each a query of its own: [tokens, heads, splits, head_dim] fp32).
MAX_WAVES = 16
# The combined path's CTA: 8 warps is the most one SM holds of the pipelined tile code (up to 255 registers a
# thread: 8 x 32 x 256 = 65536, the whole register file; more warps would cap it at 128 and spill), and a round
# of 8 warps covers 128 tokens (a 300-token context: 3 tiles a warp).
COMBINED_WARPS = 8
# paged_reduce_kernel holds up to this many splits' partials in registers (kernels/paged_attention.cu); the
# combined_split path cuts a context into at most this many splits, of at least MIN_TOKENS_PER_COMBINED_SPLIT
# tokens (a round of COMBINED_WARPS warps over 32-token code tiles).
REDUCE_HELD_SPLITS = 64
MIN_TOKENS_PER_COMBINED_SPLIT = 256
# Where SMs // (CTAs a split) splits would leave more than a tenth of the last wave's SMs idle (a CTA a sequence
# and KV head past half the SMs, or more CTAs than SMs), the combined_split path takes the count up to
# BALANCED_MAX_SPLITS that fills its waves best: 96 CTAs a split run 4 splits (384 CTAs in 3 waves of 132).
WAVE_FILL = 0.9
BALANCED_MAX_SPLITS = 8
# paged_decode_heads_n_kernel: query heads a KV head (the mma's n), head dims (its row slices), the least block
# (a thread's 2 K and 4 V tokens in one block)
HEADS_N_MAX_GROUP = 8
HEADS_N_HEAD_DIMS = (64, 128)
HEADS_N_MIN_BLOCK = 8
# The clustered path's cluster: CTAs a (KV head tile, sequence) spreads over. 4 x 8 warps cover a 512-token round
# (a 1024 bound: two tiles a warp); clusters of 4 full-SM CTAs fit the H200's GPCs of 16-18 SMs.
CLUSTER_CTAS = 4
# cudaDeviceGetAttribute numbers
_ATTR_MULTIPROCESSORS, _ATTR_THREADS_PER_SM, _ATTR_REGISTERS_PER_SM, _ATTR_BLOCKS_PER_SM = 16, 39, 82, 106


class AttentionOperands(NamedTuple):
    """What the attention kernels' checks read (`attention_operands` builds it from the query and the cache)."""

    dtype: torch.dtype  # the query's
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: torch.dtype
    block_size: int


def attention_operands(query: torch.Tensor, key_cache: torch.Tensor) -> AttentionOperands:
    """query [..., H, D]; key_cache [num_blocks, KVH, block_size, D]."""
    return AttentionOperands(query.dtype, query.shape[-2], key_cache.shape[1], query.shape[-1], key_cache.dtype,
                             key_cache.shape[2])


def unsupported_reason(operands: AttentionOperands) -> str | None:
    """Why the decode kernel cannot serve these operands (None when it can)."""
    if operands.dtype not in _DTYPE_CODES:
        return f"query dtype {operands.dtype} (kernel takes float16/bfloat16)"
    head_dim = operands.head_dim
    if head_dim % 32 or head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} (kernel needs a multiple of 32, at most {MAX_HEAD_DIM})"
    if operands.kv_dtype not in (operands.dtype, *_KV_CODES):
        return f"KV cache dtype {operands.kv_dtype} with query {operands.dtype}"
    if operands.block_size & (operands.block_size - 1):
        return f"block_size {operands.block_size} is not a power of two"
    if operands.kv_dtype in _KV_CODES and operands.block_size < 8:
        return f"block_size {operands.block_size} with a {operands.kv_dtype} cache (code tiles need 8 or more)"
    if operands.num_heads % operands.num_kv_heads:
        return f"{operands.num_heads} query heads over {operands.num_kv_heads} KV heads"
    return None


def heads_n_serves(operands: AttentionOperands) -> bool:
    """Whether paged_decode_heads_n_kernel reads these operands (where unsupported_reason lets the decode kernels
    serve them)."""
    return (operands.num_heads // operands.num_kv_heads <= HEADS_N_MAX_GROUP and operands.head_dim in HEADS_N_HEAD_DIMS
            and operands.block_size >= HEADS_N_MIN_BLOCK)


@cache
def _device_limits(device_index: int) -> tuple[int, int, int, int]:
    """(multiprocessors, threads, registers, blocks) per device / per SM."""
    import cupy

    return tuple(cupy.cuda.runtime.deviceGetAttribute(attr, device_index) for attr in (
        _ATTR_MULTIPROCESSORS, _ATTR_THREADS_PER_SM, _ATTR_REGISTERS_PER_SM, _ATTR_BLOCKS_PER_SM))


def multiprocessors(device_index: int) -> int:
    return _device_limits(device_index)[0]


def resident_ctas(registers_per_thread: int, device_index: int) -> int:
    """How many one-warp CTAs of a kernel using this many registers the whole GPU holds at once."""
    sms, threads, registers, blocks = _device_limits(device_index)
    per_warp = -(-registers_per_thread // 8) * 8 * 32
    return sms * max(1, min(blocks, threads // 32, registers // per_warp))


def ctas_per_split(num_seqs: int, num_heads: int, num_kv_heads: int) -> int:
    """CTAs a context split takes: one per (sequence, KV head, 16-query-head tile)."""
    return num_seqs * num_kv_heads * ((num_heads // num_kv_heads + 15) // 16)


def split_plan(num_seqs: int, num_heads: int, num_kv_heads: int, max_seq_len: int, resident: int,
               tokens_per_split: int | None = None) -> tuple[int, int]:
    """(splits, tokens per split): pieces of ~TARGET_TOKENS_PER_SPLIT tokens, their count rounded to
    whole waves of `resident` CTAs, at most MAX_WAVES of them."""
    if tokens_per_split is None:
        units = ctas_per_split(num_seqs, num_heads, num_kv_heads)
        waves = max(1, min(MAX_WAVES, round(units * -(-max_seq_len // TARGET_TOKENS_PER_SPLIT) / resident)))
        most = max(1, min(MAX_SPLITS, -(-max_seq_len // MIN_TOKENS_PER_SPLIT)))
        splits = max(1, min(most, waves * resident // units))
        tokens_per_split = -(-max_seq_len // splits)
    tokens_per_split = -(-tokens_per_split // TILE_TOKENS) * TILE_TOKENS
    return max(1, -(-max_seq_len // tokens_per_split)), tokens_per_split


def combined_split_plan(num_seqs: int, num_heads: int, num_kv_heads: int, max_seq_len: int, multiprocessors: int,
                        tokens_per_split: int | None = None) -> tuple[int, int]:
    """(splits, tokens per split) of the combined_split path: about one CTA an SM (the combined kernel's CTA fills
    one), at most REDUCE_HELD_SPLITS splits of at least MIN_TOKENS_PER_COMBINED_SPLIT tokens; where that fills
    less than WAVE_FILL of its waves' SMs, the count up to BALANCED_MAX_SPLITS that fills them best."""
    if tokens_per_split is None:
        units = ctas_per_split(num_seqs, num_heads, num_kv_heads)
        most = max(1, min(REDUCE_HELD_SPLITS, -(-max_seq_len // MIN_TOKENS_PER_COMBINED_SPLIT)))

        def fill(count: int) -> float:  # busy share of the SMs over the waves of units x count CTAs
            return units * count / (-(-units * count // multiprocessors) * multiprocessors)

        splits = max(1, min(most, multiprocessors // units))
        if fill(splits) < WAVE_FILL:
            splits = max(range(1, min(most, BALANCED_MAX_SPLITS) + 1), key=lambda count: (fill(count), -count))
        tokens_per_split = -(-max_seq_len // splits)
    tokens_per_split = -(-tokens_per_split // TILE_TOKENS) * TILE_TOKENS
    return max(1, -(-max_seq_len // tokens_per_split)), tokens_per_split


def _kernel_name(query: torch.Tensor, key_cache: torch.Tensor, pipelined: bool, warps: int = 1,
                 cluster: int = 1, heads_as_n: bool = False) -> str:
    """The split path's kernel (warps == 1) leaves WARPS at its default, the combined path's CLUSTER: the names
    the registry compiles ahead. heads_as_n: paged_decode_heads_n_kernel (always loading a tile ahead; CLUSTER left
    out off the clustered path)."""
    dt, head_dim, kvq = _DTYPE_CODES[query.dtype], query.shape[-1], _KV_CODES.get(key_cache.dtype, 0)
    if heads_as_n:
        return f"paged_decode_heads_n_kernel<{dt},{head_dim},{kvq},{warps}" + (f",{cluster}>" if cluster > 1 else ">")
    name = f"paged_decode_kernel<{dt},{head_dim},{kvq},{int(pipelined)}"
    return name + (f",{warps},{cluster}>" if cluster > 1 else f",{warps}>" if warps > 1 else ">")


def plan_for(query: torch.Tensor, key_cache: torch.Tensor, max_seq_len: int, path: str, pipelined: bool,
             tokens_per_split: int | None = None, heads_as_n: bool | None = None) -> tuple[int, int]:
    """The (splits, tokens per split) paged_decode_attention launches on `path` (heads_as_n as it takes it): on the
    combined and clustered paths one split of max_seq_len in whole tiles; on the combined_split path
    combined_split_plan; on the split path split_plan with the residency of its one-warp kernel (compiled here to
    read its register count)."""
    if path not in DECODE_PATHS:
        raise ValueError(f"unknown decode path {path!r}; choose from {', '.join(DECODE_PATHS)}")
    index = query.device.index
    if path == "combined_split":
        return combined_split_plan(query.shape[0], query.shape[1], key_cache.shape[1], max_seq_len,
                                   multiprocessors(index), tokens_per_split)
    if path != "split":
        if tokens_per_split is not None:
            raise ValueError(f"tokens_per_split sizes the split paths' splits; the {path} path has one")
        return 1, -(-max_seq_len // TILE_TOKENS) * TILE_TOKENS
    heads_as_n = _takes_heads_as_n(query, key_cache, path, heads_as_n)
    kernel = get_kernel(SOURCE, _kernel_name(query, key_cache, pipelined, heads_as_n=heads_as_n), index)
    return split_plan(query.shape[0], query.shape[1], key_cache.shape[1], max_seq_len,
                      resident_ctas(kernel.num_regs, index), tokens_per_split)


def _takes_heads_as_n(query: torch.Tensor, key_cache: torch.Tensor, path: str, heads_as_n: bool | None) -> bool:
    """paged_decode_attention's kernel choice: None takes paged_decode_heads_n_kernel wherever it serves the
    operands (on every path); True insists on it; False takes paged_decode_kernel."""
    serves = heads_n_serves(attention_operands(query, key_cache))
    if heads_as_n and not serves:
        raise ValueError(f"paged_decode_heads_n_kernel does not serve {attention_operands(query, key_cache)}")
    return serves if heads_as_n is None else heads_as_n


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, scale: float,
                           sliding_window: int | None = None, softcap: float | None = None,
                           key_scales: torch.Tensor | None = None, value_scales: torch.Tensor | None = None,
                           out: torch.Tensor | None = None, *, path: str, pipelined: bool,
                           tokens_per_split: int | None = None, fresh_tokens: int = 1,
                           heads_as_n: bool | None = None) -> torch.Tensor:
    """query [B, H, D] (one token per sequence) -> [B, H, D], on `path` (one of DECODE_PATHS).

    key_cache/value_cache [num_blocks, KVH, block_size, D] (query dtype; int8 with fp16
    key_scales/value_scales [num_blocks, KVH, block_size]; or float8_e4m3fn with fp32 key_scales/value_scales
    [KVH]); block_tables [B, max_blocks] int32;
    seq_lens [B] int32 (context length including this token); max_seq_len >= every seq_len;
    pipelined: each tile's K/V loaded one tile ahead of its math (more bytes in flight per warp, fewer warps per SM;
    paged_decode_heads_n_kernel always does);
    tokens_per_split: the split path's split size (default split_plan's);
    fresh_tokens: at most this many of each sequence's newest positions were written by the launch just before
    this one (the kernel reads the older ones before waiting for it);
    heads_as_n: the kernel (_takes_heads_as_n: by default paged_decode_heads_n_kernel wherever it serves).
    """
    num_seqs, num_heads, head_dim = query.shape
    _, num_kv_heads, block_size, _ = key_cache.shape
    device = query.device
    index = device.index
    query = query.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if path == "clustered" and not clusters_available(index):
        raise ValueError("the clustered path needs thread-block clusters (SM90+)")
    dt = _DTYPE_CODES[query.dtype]
    quantized = key_cache.dtype in _KV_CODES
    heads_as_n = _takes_heads_as_n(query, key_cache, path, heads_as_n)
    splits, per_split = plan_for(query, key_cache, max_seq_len, path, pipelined, tokens_per_split, heads_as_n)
    warps = 1 if path == "split" else COMBINED_WARPS
    cluster = CLUSTER_CTAS if path == "clustered" else 1
    fn = get_kernel(SOURCE, _kernel_name(query, key_cache, pipelined, warps, cluster, heads_as_n), index)
    if splits > MAX_SPLITS:
        raise ValueError(f"{splits} context splits exceed {MAX_SPLITS} (the reduce's shared memory): "
                         f"pass a larger tokens_per_split")
    group = num_heads // num_kv_heads
    head_tiles = 1 if heads_as_n else (group + 15) // 16
    part_out = part_stats = None
    if splits > 1:
        part_out = torch.empty(num_seqs, num_heads, splits, head_dim, dtype=torch.float32, device=device)
        part_stats = torch.empty(num_seqs, num_heads, splits, 2, dtype=torch.float32, device=device)
    launch(fn, (num_kv_heads * head_tiles, num_seqs, splits * cluster), (32 * warps, 1, 1), (
        ptr(query), ptr(key_cache), ptr(value_cache), ptr(key_scales if quantized else None),
        ptr(value_scales if quantized else None), ptr(block_tables), ptr(seq_lens), ptr(out), ptr(part_out),
        ptr(part_stats), i32(num_heads), i32(num_kv_heads), i32(block_size.bit_length() - 1),
        i32(block_tables.shape[1]), i32(per_split), f32(scale), f32(softcap or 0.0), i32(sliding_window or 0),
        i32(fresh_tokens)), index, cluster=(1, 1, cluster) if cluster > 1 else None)
    if splits > 1:
        reduce = get_kernel(SOURCE, f"paged_reduce_kernel<{dt}>", index)
        launch(reduce, (num_heads, num_seqs, 1), (128, 1, 1), (
            ptr(part_out), ptr(part_stats), ptr(out), i32(num_heads), i32(splits), i32(head_dim)), index,
            shared_mem=4 * splits)  # a weight per split
    return out


# paged_prefill_kernel's CTA: PREFILL_WARPS warps of 16 query rows each (as in kernels/paged_attention.cu).
PREFILL_WARPS = 4
PREFILL_HEAD_DIMS = (64, 128)
# Its CTAs (128 registers a thread, 35 KiB of shared memory at head_dim 128) fit 4 an SM: fewer tiles than that
# fill over the GPU split their keys, in pieces of at least 256 (16 key tiles a CTA walks one after another).
PREFILL_CTAS_PER_SM = 4
MIN_TOKENS_PER_PREFILL_SPLIT = 256


def prefill_tile_tokens(num_heads: int, num_kv_heads: int) -> int | None:
    """Query tokens a paged_prefill_kernel CTA takes: each warp's 16 mma rows hold 16 // G tokens of G query heads
    (G = num_heads / num_kv_heads). None where G > 16 (a token's heads would not fit one warp's rows)."""
    group = num_heads // num_kv_heads
    return PREFILL_WARPS * (16 // group) if group <= 16 else None


def prefill_unsupported_reason(operands: AttentionOperands) -> str | None:
    """Why paged_prefill_attention cannot serve these operands (None when it can)."""
    reason = unsupported_reason(operands)
    if reason is not None:
        return reason
    if operands.head_dim not in PREFILL_HEAD_DIMS:
        return f"head_dim {operands.head_dim} (the prefill kernel takes {' or '.join(map(str, PREFILL_HEAD_DIMS))})"
    if prefill_tile_tokens(operands.num_heads, operands.num_kv_heads) is None:
        return (f"{operands.num_heads // operands.num_kv_heads} query heads a KV head "
                "(the prefill kernel takes at most 16)")
    return None


def prefill_split_plan(num_tokens: int, tile_tokens: int, num_kv_heads: int, max_seq_len: int,
                       device_index: int) -> tuple[int, int]:
    """(splits, tokens per split) of paged_prefill_attention's keys: one split where the CTAs of num_tokens in
    full tiles fill PREFILL_CTAS_PER_SM per SM, else about as many as fill them, each of at least
    MIN_TOKENS_PER_PREFILL_SPLIT keys. Host values only (the grid a CUDA graph fixes)."""
    units = -(-num_tokens // tile_tokens) * num_kv_heads
    wanted = PREFILL_CTAS_PER_SM * multiprocessors(device_index) // units
    splits = max(1, min(wanted, -(-max_seq_len // MIN_TOKENS_PER_PREFILL_SPLIT)))
    keys = -(-max_seq_len // splits)
    per_split = -(-keys // TILE_TOKENS) * TILE_TOKENS
    return -(-max_seq_len // per_split), per_split


def _prefill_kernel_name(query: torch.Tensor, key_cache: torch.Tensor) -> str:
    """A 16-bit cache's kernel leaves KVQ at its default: the names the registry compiles ahead."""
    dt, head_dim, kvq = _DTYPE_CODES[query.dtype], query.shape[-1], _KV_CODES.get(key_cache.dtype, 0)
    return f"paged_prefill_kernel<{dt},{head_dim},{kvq}>" if kvq else f"paged_prefill_kernel<{dt},{head_dim}>"


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, tiles: torch.Tensor, max_seq_len: int,
                            scale: float, sliding_window: int | None = None, softcap: float | None = None,
                            key_scales: torch.Tensor | None = None, value_scales: torch.Tensor | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of prefill tiles: query [T, H, D] -> out [T, H, D], where only the rows of the tiles' tokens are
    written (the others keep what `out` held).

    tiles [N, 2] int32: (first token row, token count) of up to prefill_tile_tokens consecutive tokens of one
    sequence at consecutive positions (count 0: an unused entry); block_tables [T, max_blocks] int32
    and seq_lens [T] int32 per token (context length including the token); max_seq_len >= every seq_len, a host
    value (fixed for CUDA graphs: the split plan depends on it); key/value_cache [num_blocks, KVH, block_size, D]
    in the query's dtype, or int8 / float8_e4m3fn codes with key_scales/value_scales as paged_decode_attention's.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, num_kv_heads, block_size, _ = key_cache.shape
    index = query.device.index
    if out is None:
        out = torch.empty_like(query)
    if tiles.shape[0] == 0 or num_tokens == 0:
        return out
    dt = _DTYPE_CODES[query.dtype]
    block_tables = block_tables.to(torch.int32).contiguous()
    tiles = tiles.to(torch.int32).contiguous()
    tile_tokens = prefill_tile_tokens(num_heads, num_kv_heads)
    splits, per_split = prefill_split_plan(num_tokens, tile_tokens, num_kv_heads, max_seq_len, index)
    part_out = part_stats = None
    if splits > 1:
        part_out = torch.empty(num_tokens, num_heads, splits, head_dim, dtype=torch.float32, device=query.device)
        part_stats = torch.empty(num_tokens, num_heads, splits, 2, dtype=torch.float32, device=query.device)
    fn = get_kernel(SOURCE, _prefill_kernel_name(query, key_cache), index)
    quantized = key_cache.dtype in _KV_CODES
    launch(fn, (num_kv_heads, tiles.shape[0], splits), (32 * PREFILL_WARPS, 1, 1), (
        ptr(query.contiguous()), ptr(key_cache), ptr(value_cache), ptr(key_scales if quantized else None),
        ptr(value_scales if quantized else None), ptr(block_tables),
        ptr(seq_lens.to(torch.int32).contiguous()), ptr(tiles), ptr(out), ptr(part_out), ptr(part_stats),
        i32(num_heads), i32(num_kv_heads), i32(block_size.bit_length() - 1), i32(block_tables.shape[1]),
        i32(per_split), f32(scale), f32(softcap or 0.0), i32(sliding_window or 0)), index)
    if splits > 1:
        reduce = get_kernel(SOURCE, f"paged_prefill_reduce_kernel<{dt}>", index)
        launch(reduce, (num_heads, tiles.shape[0] * tile_tokens, 1), (128, 1, 1), (
            ptr(part_out), ptr(part_stats), ptr(tiles), ptr(out), i32(num_heads), i32(splits), i32(head_dim),
            i32(tile_tokens)), index, shared_mem=4 * splits)
    return out
