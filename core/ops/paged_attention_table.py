"""Which paged-attention kernel serves a step: the decode path per batch and context bound, the decode kernel's
load variant, which CUDA-graph buckets attend prefill chunks in tiles, and how much attention a graphed step may
carry. The numbers behind each threshold are in docs/KERNELS.md.

Decode: one table, the first row that serves a DecodeShape wins (kernels/paged_attention.py describes the paths).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import NamedTuple

from deepinfer.kernels import paged_attention as kernels

# Bounds up to this may take the combined and clustered paths. Their latency follows the real context: a warp
# walks up to bound / 16 / COMBINED_WARPS tiles (8 at 1024), about one memory round trip each (a tile's math
# overlaps the next tile's loads, not the one after), where the split path walks 2 tiles a split at any context and
# then pays a second, dependent kernel. At a 2048 bound a lone long context would walk 16 tiles a warp. 1024 is
# also the engine's smallest CUDA-graph context bound (the next is 4096).
COMBINED_MAX_SEQ_LEN = 1024
# The combined path by default only from this many CTAs (sequences x KV heads x head tiles): with one CTA a
# sequence and KV head, a few sequences leave most SMs idle while each warp walks its tiles one after another.
COMBINED_MIN_CTAS = 64
# Long bounds with at most multiprocessors / FEW_STREAMS_SM_SHARE CTAs a split (8 Qwen2.5-3B streams on an H200's 132
# SMs) take the combined_split path: one-warp splits enough to fill the GPU would each cover a few tiles and write a
# partial of every query head of the KV head. At 16 streams the two paths are even in FP16 and split is faster for
# int8 (52.7 against 62.1 µs at 16k, pipelined code tiles).
FEW_STREAMS_SM_SHARE = 8
# Each tile's K/V loaded one tile ahead of its math (the pipelined variant; head_dim <= 128 takes it), except the
# code tiles of int8 / e4m3 caches in CTAs of 8 warps (combined, clustered, combined_split paths), whose pipelined
# variants spill 32-148 bytes: 8 Qwen2.5-3B streams at 32k on combined_split 54.6 against 62.4 µs (int8) and 46.3
# against 47.6 (e4m3) in step (H200; on the split path the pipelined code tiles stay ahead, 191.8 against 215.5 µs
# at 64 streams of 16k for int8, 172.6 against 231.7 for e4m3).
PIPELINED = True
# Buckets of at least this many tokens attend prefill chunks in tiles (paged_prefill_attention); smaller steps
# carry short chunks, often at long contexts, which the decode kernel spreads over more CTAs than a few tiles.
MIN_TILED_TOKENS = 128
# Sum over a graphed step's queries of the context each walks, times the KV heads, above which the step runs
# eagerly. 2**21: a 512-token chunk at ~2k context with 2 KV heads, or eight 256-token prompts with 8 KV heads.
GRAPH_ATTENTION_WORK = 1 << 21


class DecodeShape(NamedTuple):
    """Everything a decode row's choice reads (host values: a CUDA graph fixes them at capture)."""

    num_seqs: int
    num_heads: int
    num_kv_heads: int
    max_seq_len: int  # the bound of the batch's context lengths
    clusters: bool  # the device launches thread-block clusters (SM90+)
    multiprocessors: int
    heads_as_n: bool = False  # paged_decode_heads_n_kernel serves the operands (kernels.heads_n_serves)


def ctas(shape: DecodeShape) -> int:
    """CTAs a context split takes: one per (sequence, KV head, 16-query-head tile)."""
    return kernels.ctas_per_split(shape.num_seqs, shape.num_heads, shape.num_kv_heads)


def short_bound(shape: DecodeShape) -> bool:
    return shape.max_seq_len <= COMBINED_MAX_SEQ_LEN


class DecodeRow(NamedTuple):
    path: str  # kernels/paged_attention.py: DECODE_PATHS
    serves: Callable[[DecodeShape], bool]
    measured: str


DECODE_TABLE = (
    DecodeRow("clustered", lambda s: (short_bound(s) and s.clusters and ctas(s) < COMBINED_MIN_CTAS
                                      and ctas(s) * kernels.CLUSTER_CTAS <= s.multiprocessors),
              "few sequences under short bounds whose clusters all fit the SMs at once: even with split at one "
              "stream, faster at 8 (e378c94:results/decode_step_experiments_qwen2.5-3b_nvidia_h200.json, 'clustered')"),
    DecodeRow("combined", lambda s: short_bound(s) and ctas(s) >= COMBINED_MIN_CTAS,
              "many sequences under short bounds: faster than split at 32 streams, slower at one (2 CTAs) "
              "(e0c504d:results/fused_norm_and_combined_attention_experiments_qwen2.5-3b_nvidia_h200.json, 'run1')"),
    DecodeRow("combined_split", lambda s: s.heads_as_n and not short_bound(s),
              "G <= 8 at long bounds, any batch and cache dtype: the heads-as-n kernel's 8-warp CTAs, one an SM, "
              "over splits that fill whole waves (combined_split_plan), one partial a CTA where the split path's "
              "one-warp CTAs write one a few tiles; H200, Qwen2.5-3B heads at 32k, 64 streams: 503 / 261 µs "
              "(FP16 / int8) against 593 / 352 on the split path "
              "(results/bench_kv_cache_dtypes_qwen2.5-3b-w4a16_nvidia_h200.json, 'decode_attention')"),
    DecodeRow("combined_split", lambda s: not short_bound(s) and ctas(s) * FEW_STREAMS_SM_SHARE <= s.multiprocessors,
              "few sequences at long bounds: the combined path's CTAs over splits, one partial a CTA; H200, "
              "Qwen2.5-3B heads at 32k: one stream 18.3 against 30.1 µs split (FP16), 16.2 against 28.2 (int8), 8 "
              "streams 85.7 against 89.4 (FP16); even at 16 streams of 16k in FP16 (docs/KERNELS.md)"),
    DecodeRow("split", lambda s: True,
              "long bounds, and few sequences without clusters: the context spread over the GPU "
              "(results/bench_gemv_w4a16-w3a16-attention_nvidia_h200.json)"),
)


def decode_pipelined(path: str, quantized: bool) -> bool:
    """Whether paged_decode_kernel on `path` loads each tile one tile ahead (`quantized`: an int8 or e4m3 cache);
    paged_decode_heads_n_kernel always does."""
    return PIPELINED and not (quantized and path != "split")


@cache
def decode_path(shape: DecodeShape) -> str:
    """The first row of DECODE_TABLE that serves `shape`."""
    return next(row.path for row in DECODE_TABLE if row.serves(shape))


def tiles_prefill(bucket_tokens: int) -> bool:
    """Whether a CUDA-graph bucket of this many tokens attends its prefill chunks in tiles."""
    return bucket_tokens >= MIN_TILED_TOKENS


def graph_attention_work_limit(num_kv_heads: int) -> int:
    """The most attention work (sum of the contexts its queries walk) a graphed step of this model may carry."""
    return GRAPH_ATTENTION_WORK // num_kv_heads
