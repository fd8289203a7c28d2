"""The paged attention kernels against the torch references of core/ops/paged_attention.py: decode on each of its
paths (forced), prefill tiles with untouched rows outside them, over 16-bit, int8 and e4m3 caches."""

from __future__ import annotations

import torch

from deepinfer.core.bench.paged_kv import random_paged_kv
from deepinfer.core.ops.paged_attention import paged_decode_attention_reference
from deepinfer.validate.compare import DTYPE_NAMES, REL_TOL, CheckResult, compare, guarded, poisoned

# (dtype, KV storage (False: the dtype, True: int8, "fp8": e4m3), heads, kv heads, head_dim, block size, context lengths, window, softcap, tokens/split, bound).
# bound: the max_seq_len passed (None: the longest context); a bound past every context is the CUDA-graph case,
# whose block tables are as wide as the bound. Bounds up to COMBINED_MAX_SEQ_LEN (1024) without tokens/split run on
# the combined path (one CTA of 8 warps a sequence) and the clustered path (a cluster of such CTAs), forced whatever
# the batch's CTA count (dispatch gives the combined path 64 CTAs or more, the clustered one fewer), and on the split
# path (one-warp CTAs, then the reduce); the rest on the split path. Every case also runs on the combined_split path
# (CTAs of 8 warps over splits, then the reduce), which dispatch gives few sequences at long bounds. Cases of at most
# 8 query heads a KV head, head_dim 64 or 128 and blocks of 8 tokens or more run both decode kernels on every path:
# the heads-as-n kernel (dispatch's) and, forced, the heads-as-rows one.
ATTENTION_CASES = (
    # split path: bounds past 1024, or an explicit tokens/split
    (torch.float16, False, 32, 8, 128, 16, (1, 17, 300, 5000), None, None, None, None),
    (torch.bfloat16, False, 32, 8, 128, 16, (1, 17, 300, 5000), 256, 50.0, None, None),
    (torch.float16, True, 9, 3, 64, 16, (5, 700, 2049), None, None, None, None),
    (torch.bfloat16, True, 16, 2, 256, 32, (3, 129, 1500), 100, 50.0, None, None),
    (torch.bfloat16, False, 16, 2, 128, 16, (1, 300, 2048), None, None, None, None),
    (torch.float16, False, 32, 8, 128, 16, (1, 17, 300, 2000), None, None, 1 << 20, None),  # one split
    (torch.float16, False, 16, 2, 128, 16, (1, 17, 300), None, None, 32, 1024),  # short contexts, reduce
    # combined path: contexts 1 and 15-17 leave most warps idle, 1024 gives each warp 8 tiles
    (torch.float16, False, 16, 2, 128, 16, (1, 15, 16, 17, 300, 1024), None, None, None, None),  # GQA 8
    (torch.bfloat16, False, 16, 2, 128, 16, (300, 1, 77), None, None, None, 1024),
    (torch.bfloat16, True, 16, 2, 128, 16, (1, 15, 16, 17, 300, 1024), None, None, None, None),
    (torch.float16, False, 8, 8, 64, 8, (1, 15, 16, 17, 300), None, None, None, 1024),  # GQA 1
    (torch.float16, True, 9, 3, 64, 128, (5, 700, 1000), 256, None, None, None),  # window from mid-tile
    (torch.bfloat16, True, 16, 2, 256, 32, (3, 129, 1000), 100, 50.0, None, 1024),
    (torch.float16, False, 8, 2, 256, 16, (1, 17, 300), None, 30.0, None, None),
    (torch.float16, False, 40, 2, 128, 8, (33, 1000), None, None, None, None),  # GQA 20: a partial head tile
    (torch.bfloat16, False, 32, 1, 128, 64, (1, 300, 999), 64, None, None, 1024),  # GQA 32: two head tiles
    (torch.bfloat16, False, 4, 4, 96, 64, (65, 129), None, None, None, None),
    (torch.float16, False, 16, 2, 128, 16, tuple(range(1, 1025, 33)), None, None, None, 1024),  # 32 sequences
    # e4m3 caches: odd lengths, block sizes 8-128, windows, softcaps, GQA 1-16, head_dim 64-256, every path
    (torch.float16, "fp8", 32, 8, 128, 16, (1, 17, 300, 5000), None, None, None, None),
    (torch.bfloat16, "fp8", 16, 2, 128, 32, (3, 129, 2049), 100, 50.0, None, None),
    (torch.float16, "fp8", 9, 3, 64, 128, (5, 700, 1000), 256, None, None, None),
    (torch.bfloat16, "fp8", 16, 2, 256, 64, (3, 129, 1000), 100, 50.0, None, 1024),
    (torch.float16, "fp8", 8, 8, 64, 8, (1, 15, 16, 17, 300), None, None, None, 1024),
    (torch.bfloat16, "fp8", 16, 2, 128, 16, (1, 15, 16, 17, 300, 1024), None, 30.0, None, None),
    (torch.float16, "fp8", 16, 2, 128, 16, (1, 8191, 16384, 32767), None, None, None, None),  # few long streams
    (torch.bfloat16, True, 16, 2, 128, 8, (1, 8191, 16384, 32767), None, None, None, None),
    # code tiles' narrower row slices: head_dim 96 (8-byte K, 4-byte V loads) and 32, windows from mid-tile
    (torch.bfloat16, "fp8", 4, 4, 96, 64, (65, 129, 1500), 70, None, None, None),
    (torch.float16, True, 8, 2, 32, 8, (3, 40, 2100), 33, 20.0, None, None),
    # the heads-as-n kernel: Qwen2.5-7B's G = 7, contexts ending mid-tile, splits that start mid-tile (48 tokens),
    # windows, softcaps, block sizes 8-128; many sequences at a long bound (combined_split's balanced splits)
    (torch.float16, True, 28, 4, 128, 32, (1, 31, 33, 4097), 1000, 50.0, None, None),
    (torch.bfloat16, "fp8", 28, 4, 128, 64, (2, 63, 65, 3000), None, None, 48, None),
    (torch.float16, "fp8", 16, 2, 128, 8, (7, 100, 1500), 77, 30.0, 48, None),
    (torch.bfloat16, True, 16, 2, 64, 128, (129, 257, 1025), 200, None, None, 4096),
    (torch.float16, True, 16, 2, 128, 16, tuple(range(1, 4097, 85)), None, None, None, 4096),  # 49 sequences
    (torch.bfloat16, "fp8", 16, 2, 128, 16, tuple(range(3000, 3048)), None, 50.0, None, None),  # 48 sequences
    # short bounds (the clustered path's): contexts ending mid-tile and shorter than one round of a cluster's 32
    # warps, windows from mid-tile, softcaps, block sizes 8-128, G = 7 and 8, one and 8 streams, every cache dtype
    (torch.float16, True, 28, 4, 128, 128, (1, 31, 33, 511, 1023), 100, 50.0, None, 1024),
    (torch.bfloat16, "fp8", 16, 2, 64, 8, (2, 17, 129, 700), 300, None, None, 1024),
    (torch.float16, False, 16, 2, 128, 32, (5, 63, 65, 1000), 64, 30.0, None, 1024),
    (torch.bfloat16, True, 16, 2, 128, 16, (1, 100, 257, 511, 512, 513, 900, 1024), None, None, None, 1024),
    (torch.bfloat16, "fp8", 16, 2, 128, 64, (1000,), None, None, None, 1024),
    (torch.bfloat16, False, 16, 2, 128, 16, (129,), 50, None, None, 1024),
)


def check_paged_attention(device, cases=ATTENTION_CASES) -> list[CheckResult]:
    """Each case on its paths, forced: the split and combined_split paths, and (bounds up to 1024 without
    tokens/split) the combined path and, on SM90+, the clustered path."""
    from deepinfer.core.ops.paged_attention_table import COMBINED_MAX_SEQ_LEN
    from deepinfer.kernels.launch import clusters_available
    from deepinfer.kernels.paged_attention import AttentionOperands, heads_n_serves, paged_decode_attention

    short_bound_paths = ("split", "combined_split", "combined") + (("clustered",) if clusters_available(device.index)
                                                                    else ())
    results = []
    for dtype, int8, heads, kv_heads, head_dim, block_size, lengths, window, softcap, per_split, bound in cases:
        bound = bound or max(lengths)
        paths = short_bound_paths if bound <= COMBINED_MAX_SEQ_LEN and per_split is None else ("split", "combined_split")
        kv_dtype = torch.float8_e4m3fn if int8 == "fp8" else torch.int8 if int8 else dtype
        heads_n = heads_n_serves(AttentionOperands(dtype, heads, kv_heads, head_dim, kv_dtype, block_size))
        # (path, pipelined, heads_as_n): the heads-as-n kernel has one load variant
        variants = [(p, pipe, False if heads_n else None) for p in paths
                    for pipe in ((True, False) if head_dim <= 128 else (True,))]
        variants += [(p, True, None) for p in paths if heads_n]
        for path, pipelined, heads_as_n in variants:
            kernel = " heads-as-n" if heads_as_n is None and heads_n else " heads-as-rows" if heads_as_n is False else ""
            loads = "" if pipelined or kernel == " heads-as-n" else " in-step loads"
            context = (f"ctx={list(lengths)}" if len(lengths) <= 8
                       else f"{len(lengths)} ctx {min(lengths)}..{max(lengths)}")
            case = (f"{path} {DTYPE_NAMES[dtype]} {'fp8' if int8 == 'fp8' else 'int8' if int8 else 'same-dtype'} KV H={heads}/{kv_heads} "
                    f"D={head_dim} bs={block_size} {context} bound={bound}" + (f" window={window}" if window else "")
                    + (f" softcap={softcap}" if softcap else "") + (f" tokens/split={per_split}" if per_split else "")
                    + loads + kernel)

            def run(dtype=dtype, int8=int8, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                    block_size=block_size, lengths=lengths, window=window, softcap=softcap, per_split=per_split,
                    bound=bound, pipelined=pipelined, case=case, path=path, heads_as_n=heads_as_n):
                k_cache, v_cache, k_scales, v_scales, tables = random_paged_kv(
                    lengths, kv_heads, head_dim, block_size, dtype, int8 is True, device,
                    table_blocks=-(-bound // block_size), fp8=int8 == "fp8")
                seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
                query = torch.randn(len(lengths), heads, head_dim, dtype=dtype, device=device)
                scale = head_dim**-0.5
                out = poisoned(query.shape, dtype, device)
                paged_decode_attention(query, k_cache, v_cache, tables, seq_lens, bound, scale, window,
                                       softcap, k_scales, v_scales, out=out, path=path, pipelined=pipelined,
                                       tokens_per_split=per_split, heads_as_n=heads_as_n)
                ref = paged_decode_attention_reference(query.float(), k_cache, v_cache, tables, seq_lens, scale,
                                                       window, softcap, k_scales, v_scales, max(lengths))
                return compare("paged_decode_attention", case, out, ref, REL_TOL[dtype])

            results += guarded("paged_decode_attention", case, run)
    return results


# Prefill tiles: (dtype, KV storage (as ATTENTION_CASES'), heads, kv heads, head_dim, block_size, chunks (start,
# tokens) one per sequence, window, softcap). Each chunk's tokens go into tiles of prefill_tile_tokens; a decode-like
# row before them and unused (count 0) tiles after them must stay untouched.
PREFILL_CASES = (
    (torch.bfloat16, False, 16, 2, 128, 16, ((0, 256), (0, 37), (100, 300)), None, None),  # Qwen2.5-3B: G = 8
    (torch.float16, False, 28, 4, 128, 16, ((0, 100), (1000, 64)), None, None),  # Qwen2.5-7B: G = 7, 14 rows a warp
    (torch.float16, False, 9, 3, 64, 16, ((0, 90), (5, 3)), None, None),  # SmolLM2: G = 3, D = 64
    (torch.bfloat16, False, 32, 32, 128, 32, ((0, 200), (7, 1)), None, None),  # MHA: 128 tokens a tile; one-token tile
    (torch.bfloat16, False, 32, 8, 128, 16, ((0, 130), (17, 40)), 64, None),  # a window inside the tile's contexts
    (torch.float16, False, 8, 4, 64, 8, ((0, 50), (3, 20)), 32, 50.0),  # Gemma 2: window, softcap, 8-token blocks
    (torch.bfloat16, False, 16, 1, 64, 64, ((0, 77),), None, None),  # G = 16: one token a warp
    (torch.float16, False, 16, 2, 128, 16, ((2000, 2048),), None, None),  # a 2048-token chunk after 2000 cached
    # few tiles over long contexts: key splits and their reduce
    (torch.bfloat16, False, 16, 2, 128, 16, ((3000, 16), (40, 3)), None, None),
    (torch.float16, False, 32, 8, 128, 16, ((1500, 40),), 700, None),  # splits before the window are empty
    (torch.float16, False, 8, 4, 64, 8, ((1000, 20),), 32, 50.0),
    (torch.bfloat16, False, 9, 3, 64, 32, ((5000, 30),), None, None),
    # int8 and e4m3 caches: odd lengths, block sizes 8-128, windows, softcaps, GQA 1-16, head_dim 64 (8-byte
    # staging copies) and 128, key splits
    (torch.bfloat16, True, 16, 2, 128, 16, ((0, 256), (0, 37), (100, 301)), None, None),
    (torch.float16, "fp8", 16, 2, 128, 16, ((0, 256), (0, 37), (100, 301)), None, None),
    (torch.float16, True, 9, 3, 64, 8, ((0, 91), (5, 3)), 33, 50.0),
    (torch.bfloat16, "fp8", 9, 3, 64, 128, ((0, 91), (129, 77)), None, 30.0),
    (torch.float16, True, 32, 32, 128, 32, ((0, 201), (7, 1)), None, None),
    (torch.bfloat16, "fp8", 8, 8, 64, 64, ((0, 130), (17, 41)), 64, None),
    (torch.bfloat16, True, 16, 1, 64, 128, ((0, 77), (250, 9)), 100, None),
    (torch.float16, "fp8", 28, 4, 128, 8, ((0, 100), (1000, 65)), None, None),
    (torch.float16, True, 16, 2, 128, 16, ((2000, 2047),), None, None),
    (torch.bfloat16, "fp8", 16, 2, 128, 32, ((3000, 17), (40, 3)), None, None),
    (torch.bfloat16, True, 32, 8, 128, 64, ((1500, 41),), 700, 50.0),
    (torch.float16, "fp8", 8, 4, 64, 8, ((1000, 21),), 32, 50.0),
)


def check_paged_prefill_attention(device, cases=PREFILL_CASES) -> list[CheckResult]:
    from deepinfer.core.ops.paged_attention import paged_prefill_attention_reference
    from deepinfer.kernels.paged_attention import paged_prefill_attention, prefill_tile_tokens

    results = []
    for dtype, kv, heads, kv_heads, head_dim, block_size, chunks, window, softcap in cases:
        case = (f"{DTYPE_NAMES[dtype]} {'fp8' if kv == 'fp8' else 'int8' if kv else 'same-dtype'} KV "
                f"H={heads}/{kv_heads} D={head_dim} bs={block_size} chunks(start, n)={list(chunks)}"
                + (f" window={window}" if window else "") + (f" softcap={softcap}" if softcap else ""))

        def run(dtype=dtype, kv=kv, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                chunks=chunks, window=window, softcap=softcap, case=case):
            lengths = [start + n for start, n in chunks]
            k_cache, v_cache, k_scales, v_scales, tables = random_paged_kv(
                lengths, kv_heads, head_dim, block_size, dtype, kv is True, device, fp8=kv == "fp8")
            tile_tokens = prefill_tile_tokens(heads, kv_heads)
            # row 0: a decode of sequence 0 that no tile covers; then each chunk's tokens
            rows_seq, rows_len, tiles = [0], [lengths[0]], []
            for seq, (start, n) in enumerate(chunks):
                first = len(rows_seq)
                rows_seq += [seq] * n
                rows_len += list(range(start + 1, start + n + 1))
                tiles += [(first + k, min(tile_tokens, n - k)) for k in range(0, n, tile_tokens)]
            tiles += [(0, 0)] * 3
            token_tables = tables[torch.tensor(rows_seq, device=device)]
            seq_lens = torch.tensor(rows_len, dtype=torch.int32, device=device)
            tile_table = torch.tensor(tiles, dtype=torch.int32, device=device)
            query = torch.randn(len(rows_seq), heads, head_dim, dtype=dtype, device=device)
            out = poisoned(query.shape, dtype, device)
            scale = head_dim**-0.5
            bound = next(b for b in (1024, 4096, 16384) if b >= max(lengths))  # as a CUDA graph's context bound
            paged_prefill_attention(query, k_cache, v_cache, token_tables, seq_lens, tile_table, bound, scale,
                                    window, softcap, k_scales, v_scales, out=out)
            ref = paged_prefill_attention_reference(query.float(), k_cache, v_cache, token_tables, seq_lens,
                                                    tile_table, scale, window, softcap, k_scales, v_scales)
            if not torch.isnan(out[0]).all():
                return CheckResult("paged_prefill_attention", case, False, detail="wrote a row outside the tiles")
            return compare("paged_prefill_attention", case, out[1:], ref[1:], REL_TOL[dtype])

        results += guarded("paged_prefill_attention", case, run)
    return results


