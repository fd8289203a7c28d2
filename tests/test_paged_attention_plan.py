"""Which path paged decode attention takes (core/ops/paged_attention_table.py) and what each path launches
(kernels/paged_attention.py; CPU: kernels and launches faked). The path tests launch paged_decode_kernel (heads as
mma rows, `heads_as_n=False`); the heads-as-n kernel's own tests follow them.

Combined path (bounds up to COMBINED_MAX_SEQ_LEN, at least COMBINED_MIN_CTAS CTAs): one kernel, one split, CTAs of
COMBINED_WARPS warps, a grid that does not depend on the bound. Clustered path (the same bounds, fewer CTAs, SM90+):
that kernel over clusters of CLUSTER_CTAS CTAs. Split path: one-warp CTAs over split_plan's splits, then the
reduce kernel when there is more than one split.
"""

from __future__ import annotations

import re

import pytest
import torch

from deepinfer.core.ops import paged_attention_table as table
from deepinfer.kernels import paged_attention as kp


class _Kernel(tuple):  # (source, name), with the register count the split plan reads
    num_regs = 255


@pytest.fixture
def launches(monkeypatch):
    """Every launch paged_attention makes: (name, grid, block, args, shared_mem), on a device of 132 SMs without
    thread-block clusters (the clustered path's tests switch them on), and the cluster of each in `.clusters`."""
    recorded = Launches()
    monkeypatch.setattr(kp, "get_kernel", lambda source, name, index: _Kernel((source, name)))

    def launch(kernel, grid, block, args, index, shared_mem=0, cluster=None):
        recorded.append((kernel[1], grid, block, args, shared_mem))
        recorded.clusters.append(cluster)

    monkeypatch.setattr(kp, "launch", launch)
    monkeypatch.setattr(kp, "_device_limits", lambda index: (132, 2048, 65536, 32))
    monkeypatch.setattr(kp, "clusters_available", lambda index: False)
    return recorded


class Launches(list):
    def __init__(self):
        super().__init__()
        self.clusters = []


def _inputs(num_seqs=3, heads=16, kv_heads=2, head_dim=64, dtype=torch.float16, int8=False, block_size=16):
    query = torch.randn(num_seqs, heads, head_dim, dtype=dtype)
    cache = torch.zeros(40, kv_heads, block_size, head_dim, dtype=torch.int8 if int8 else dtype)
    scales = torch.ones(40, kv_heads, block_size, dtype=torch.float16) if int8 else None
    tables = torch.zeros(num_seqs, 64, dtype=torch.int32)
    seq_lens = torch.tensor([1, 300, 17][:num_seqs], dtype=torch.int32)
    return query, cache, scales, tables, seq_lens


def _attend(max_seq_len, path, tokens_per_split=None, pipelined=True, heads_as_n=False, **shape):
    query, cache, scales, tables, seq_lens = _inputs(**shape)
    kp.paged_decode_attention(query, cache, cache, tables, seq_lens, max_seq_len, 0.125, key_scales=scales,
                              value_scales=scales, path=path, pipelined=pipelined, tokens_per_split=tokens_per_split,
                              heads_as_n=heads_as_n)


def _path(num_seqs, num_heads, num_kv_heads, max_seq_len, clusters=False, multiprocessors=132):
    return table.decode_path(table.DecodeShape(num_seqs, num_heads, num_kv_heads, max_seq_len, clusters,
                                               multiprocessors))


def test_the_combined_path_serves_short_bounds_with_enough_ctas():
    assert table.COMBINED_MIN_CTAS == 64 and table.COMBINED_MAX_SEQ_LEN == 1024
    # Qwen2.5-3B's 16 / 2 heads: one CTA per sequence and KV head
    assert _path(1, 16, 2, 1024) == _path(31, 16, 2, 1024) == "split"
    assert _path(32, 16, 2, 1024) == _path(64, 16, 2, 300) == "combined"
    assert _path(2, 64, 2, 1024) == "split"  # 2 x 2 x 2 head tiles = 8 CTAs
    assert _path(64, 16, 2, 1025) == _path(64, 16, 2, 2048) == "split"  # past the bound
    for bound in (1, 15, 16, 17, 300, 1024):
        assert _path(64, 16, 2, bound) == "combined", bound
    # a warp walks at most 8 of the bound's 16-token tiles
    assert table.COMBINED_MAX_SEQ_LEN // kp.TILE_TOKENS // kp.COMBINED_WARPS == 8


def test_the_clustered_path_serves_few_sequences_whose_clusters_fit_the_sms():
    assert kp.CLUSTER_CTAS == 4
    # Qwen2.5-3B's 16 / 2 heads: a stream is 2 CTAs a split, 8 clustered
    assert _path(1, 16, 2, 1024, clusters=True) == _path(16, 16, 2, 300, clusters=True) == "clustered"  # 128 CTAs
    assert _path(17, 16, 2, 1024, clusters=True) == "split"  # 136 CTAs would not all be resident on 132 SMs
    assert _path(17, 16, 2, 1024, clusters=True, multiprocessors=144) == "clustered"
    assert _path(32, 16, 2, 1024, clusters=True) == "combined"  # 64 CTAs: the combined path's
    assert _path(1, 16, 2, 2048, clusters=True) == "combined_split"  # past the bound
    assert _path(1, 16, 2, 1024, clusters=False) == "split"  # no clusters before SM90


def test_few_sequences_at_long_bounds_take_the_combined_split_path():
    assert table.FEW_STREAMS_SM_SHARE == 8
    # Qwen2.5-3B's 16 / 2 heads: up to 8 streams (16 CTAs a split) on 132 SMs
    assert _path(1, 16, 2, 1025) == _path(8, 16, 2, 32768) == _path(8, 16, 2, 4096, clusters=True) == "combined_split"
    assert _path(9, 16, 2, 8192) == _path(16, 16, 2, 4096) == "split"
    assert _path(8, 16, 2, 1024) == "split"  # short bounds keep their rows
    assert _path(2, 32, 8, 8192) == "combined_split" and _path(3, 32, 8, 8192) == "split"  # 8 KV heads


def test_the_combined_split_path_puts_a_cta_an_sm_over_splits_then_the_reduce(launches):
    # 3 sequences x 2 KV heads = 6 CTAs a split: 132 // 6 = 22 splits would fill the SMs, but 5000 tokens give 20 of
    # at least 256 tokens
    assert kp.combined_split_plan(3, 16, 2, 5000, 132) == (20, 256)
    assert kp.combined_split_plan(3, 16, 2, 8192, 132) == (22, 384)  # 8192 / 22 = 372.4 -> 384 (whole 16-token tiles)
    # one stream: at most REDUCE_HELD_SPLITS splits (the reduce holds every partial), of at least 256 tokens
    assert kp.REDUCE_HELD_SPLITS == 64 and kp.MIN_TOKENS_PER_COMBINED_SPLIT == 256
    assert kp.combined_split_plan(1, 16, 2, 32768, 132) == (64, 512)
    assert kp.combined_split_plan(1, 16, 2, 2048, 132) == (8, 256)
    assert kp.combined_split_plan(1, 16, 2, 2048, 132, tokens_per_split=100) == (19, 112)
    _attend(5000, "combined_split")
    (name, grid, block, args, _), (reduce, reduce_grid, _, reduce_args, shared_mem) = launches
    assert name == "paged_decode_kernel<0,64,0,1,8>" and block == (256, 1, 1) and grid == (2, 3, 20)
    assert int(args[14]) == 256 and int(args[8]) != 0 and int(args[9]) != 0
    assert reduce == "paged_reduce_kernel<0>" and reduce_grid == (16, 3, 1) and int(reduce_args[4]) == 20
    assert shared_mem == 4 * 20
    query, cache, *_ = _inputs()
    assert kp.plan_for(query, cache, 5000, "combined_split", True) == (20, 256)


def test_code_tiles_load_in_step_in_ctas_of_8_warps():
    assert table.PIPELINED
    for quantized in (False, True):
        assert table.decode_pipelined("split", quantized)
    for path in ("combined", "clustered", "combined_split"):
        assert table.decode_pipelined(path, False) and not table.decode_pipelined(path, True), path


def test_quantized_caches_need_blocks_of_8_tokens():
    for kv_dtype in (torch.int8, torch.float8_e4m3fn):
        for block_size, served in ((4, False), (8, True), (128, True)):
            operands = kp.AttentionOperands(torch.float16, 16, 2, 128, kv_dtype, block_size)
            assert (kp.unsupported_reason(operands) is None) == served, (kv_dtype, block_size)
    assert kp.unsupported_reason(kp.AttentionOperands(torch.float16, 16, 2, 128, torch.float16, 4)) is None


def test_the_ops_decode_path_reads_the_devices_clusters_and_sms(monkeypatch):
    from deepinfer.core.ops import paged_attention

    operands = kp.AttentionOperands(torch.float16, 16, 2, 128, torch.float16, 16)
    monkeypatch.setattr(kp, "multiprocessors", lambda index: 132)
    for clusters, path in ((True, "clustered"), (False, "split")):
        monkeypatch.setattr(paged_attention, "clusters_available", lambda index, clusters=clusters: clusters)
        assert paged_attention.decode_path(1, operands, 1024, 0) == path


def test_few_sequences_on_the_split_path_launch_the_decode_then_the_reduce(launches):
    _attend(300, "split")  # 3 sequences x 2 KV heads = 6 CTAs
    assert [name for name, *_ in launches] == ["paged_decode_kernel<0,64,0,1>", "paged_reduce_kernel<0>"]
    assert launches.clusters == [None, None]


def test_the_clustered_path_is_one_kernel_over_clusters_of_4(launches, monkeypatch):
    monkeypatch.setattr(kp, "clusters_available", lambda index: True)
    for bound in (17, 300, 1024):
        launches.clear()
        launches.clusters.clear()
        _attend(bound, "clustered")  # 3 sequences x 2 KV heads = 6 CTAs a split: a cluster of 4 each
        [(name, grid, block, args, shared_mem)] = launches  # no reduce
        assert name == "paged_decode_kernel<0,64,0,1,8,4>" and block == (256, 1, 1) and shared_mem == 0
        assert grid == (2, 3, 4) and launches.clusters == [(1, 1, 4)]
        part_out, part_stats, tokens_per_split = int(args[8]), int(args[9]), int(args[14])
        assert part_out == part_stats == 0  # no partials
        assert bound <= tokens_per_split < bound + kp.TILE_TOKENS
    query, cache, *_ = _inputs()
    assert kp.plan_for(query, cache, 300, "clustered", True) == (1, 304)


def test_the_clustered_path_needs_clusters(launches):
    with pytest.raises(ValueError, match="SM90"):
        _attend(300, "clustered")
    assert not launches


def test_combined_path_is_one_kernel_of_8_warps_whose_grid_ignores_the_bound(launches):
    grids = set()
    for bound in (17, 300, 1024):
        launches.clear()
        _attend(bound, "combined")
        assert len(launches) == 1  # no reduce
        name, grid, block, args, shared_mem = launches[0]
        assert name == "paged_decode_kernel<0,64,0,1,8>"
        assert block == (256, 1, 1) and shared_mem == 0
        grids.add(grid)
        part_out, part_stats, tokens_per_split = int(args[8]), int(args[9]), int(args[14])
        assert part_out == part_stats == 0  # no partials
        assert tokens_per_split % kp.TILE_TOKENS == 0 and bound <= tokens_per_split < bound + kp.TILE_TOKENS
    assert grids == {(2, 3, 1)}  # (KV heads x head tiles, sequences, one split) at every bound


def test_combined_kernel_follows_dtype_head_dim_int8_and_pipelining(launches):
    _attend(300, "combined", pipelined=False, dtype=torch.bfloat16, int8=True, head_dim=256)
    _attend(1024, "combined", heads=32, kv_heads=1, head_dim=128)  # GQA 32: two 16-head tiles of the one KV head
    _attend(300, "combined", heads=8, kv_heads=8, head_dim=96)  # GQA 1
    assert [(name, grid) for name, grid, *_ in launches] == [
        ("paged_decode_kernel<1,256,1,0,8>", (2, 3, 1)),
        ("paged_decode_kernel<0,128,0,1,8>", (2, 3, 1)),
        ("paged_decode_kernel<0,96,0,1,8>", (8, 3, 1)),
    ]


def test_the_split_path_cuts_long_bounds_and_takes_explicit_splits(launches):
    _attend(5000, "split")
    resident = kp.resident_ctas(255, None)
    splits, per_split = kp.split_plan(3, 16, 2, 5000, resident)
    assert splits > 1
    (name, grid, block, args, _), (reduce, reduce_grid, reduce_block, reduce_args, shared_mem) = launches
    assert name == "paged_decode_kernel<0,64,0,1>" and block == (32, 1, 1) and grid == (2, 3, splits)
    assert int(args[14]) == per_split and int(args[8]) != 0 and int(args[9]) != 0
    assert reduce == "paged_reduce_kernel<0>" and reduce_grid == (16, 3, 1) and reduce_block == (128, 1, 1)
    assert int(reduce_args[4]) == splits and shared_mem == 4 * splits

    launches.clear()
    _attend(300, "split", tokens_per_split=32)  # short bound, explicit splits: 10 of 32 tokens, then the reduce
    assert [(name, grid, block) for name, grid, block, *_ in launches] == [
        ("paged_decode_kernel<0,64,0,1>", (2, 3, 10), (32, 1, 1)), ("paged_reduce_kernel<0>", (16, 3, 1), (128, 1, 1))]

    launches.clear()
    _attend(2048, "split", tokens_per_split=1 << 20)  # one split: the one-warp kernel writes the output itself
    assert [(name, grid, block) for name, grid, block, *_ in launches] == [
        ("paged_decode_kernel<0,64,0,1>", (2, 3, 1), (32, 1, 1))]


def test_plan_for_reports_one_split_on_the_combined_path_without_compiling(monkeypatch, launches):
    query, cache, *_ = _inputs()
    assert kp.plan_for(query, cache, 300, "combined", True) == (1, 304)
    assert kp.plan_for(query, cache, 1024, "combined", True) == (1, 1024)
    assert kp.plan_for(query, cache, 5000, "split", True) == kp.split_plan(3, 16, 2, 5000, kp.resident_ctas(255, None))
    assert kp.plan_for(query, cache, 300, "split", True, tokens_per_split=64) == (5, 64)
    with pytest.raises(ValueError, match="tokens_per_split"):
        kp.plan_for(query, cache, 300, "combined", True, tokens_per_split=64)

    def no_compile(source, name, index):
        raise AssertionError(f"compiled {name}")

    monkeypatch.setattr(kp, "get_kernel", no_compile)
    assert kp.plan_for(query, cache, 17, "combined", True) == (1, 32)


def test_every_paths_kernels_keep_the_names_the_registry_compiles_ahead():
    from deepinfer.kernels import registry
    from deepinfer.kernels.compiler import source_text

    compiled_ahead = set(registry.get("paged_decode_attention").instantiations)
    for dtype in (torch.float16, torch.bfloat16):
        for head_dim in (64, 128, 256):
            for int8 in (False, True):
                for pipelined in (False, True):
                    query, cache, *_ = _inputs(dtype=dtype, head_dim=head_dim, int8=int8)
                    for warps, cluster in ((1, 1), (kp.COMBINED_WARPS, 1), (kp.COMBINED_WARPS, kp.CLUSTER_CTAS)):
                        assert kp._kernel_name(query, cache, pipelined, warps, cluster) in compiled_ahead
    # the split path's names leave WARPS out and the combined path's CLUSTER: the template must default them to one
    assert re.search(r"int WARPS = 1, int CLUSTER = 1>\s*__global__ void __launch_bounds__\([^)]*\) "
                     r"paged_decode_kernel\(", source_text(kp.SOURCE))


def test_the_prefill_kernel_serves_16_bit_int8_and_e4m3_caches():
    for query_dtype, kv_dtype in ((torch.float16, torch.float16), (torch.bfloat16, torch.int8),
                                  (torch.float16, torch.float8_e4m3fn)):
        for block_size in (8, 16, 128):
            operands = kp.AttentionOperands(query_dtype, 16, 2, 128, kv_dtype, block_size)
            assert kp.prefill_unsupported_reason(operands) is None, (kv_dtype, block_size)
    for kv_dtype in (torch.int8, torch.float8_e4m3fn):
        assert "block_size 4" in kp.prefill_unsupported_reason(kp.AttentionOperands(torch.float16, 16, 2, 128,
                                                                                     kv_dtype, 4))
        assert "head_dim 96" in kp.prefill_unsupported_reason(kp.AttentionOperands(torch.float16, 4, 4, 96,
                                                                                    kv_dtype, 16))
    assert "KV cache dtype" in kp.prefill_unsupported_reason(kp.AttentionOperands(torch.bfloat16, 16, 2, 128,
                                                                                   torch.float16, 16))


def test_prefill_over_codes_launches_the_codes_kernel_with_the_caches_scales(launches):
    """int8 and e4m3 caches run paged_prefill_kernel<dt, D, KVQ> with their scales; a 16-bit cache the kernel the
    registry names without KVQ, with no scales whatever is passed."""
    query = torch.randn(20, 16, 64, dtype=torch.bfloat16)
    tables, seq_lens = torch.zeros(20, 20, dtype=torch.int32), torch.arange(1, 21, dtype=torch.int32)
    tiles = torch.tensor([[0, 8], [8, 8], [16, 4]], dtype=torch.int32)  # G = 8: 8 tokens a tile
    int8_scales, fp8_scales = torch.ones(40, 2, 16, dtype=torch.float16), torch.ones(2)
    for kv_dtype, scales, name in ((torch.bfloat16, int8_scales, "paged_prefill_kernel<1,64>"),
                                   (torch.int8, int8_scales, "paged_prefill_kernel<1,64,1>"),
                                   (torch.float8_e4m3fn, fp8_scales, "paged_prefill_kernel<1,64,2>")):
        launches.clear()
        cache = torch.zeros(40, 2, 16, 64, dtype=kv_dtype)
        kp.paged_prefill_attention(query, cache, cache, tables, seq_lens, tiles, 20, 0.125, key_scales=scales,
                                   value_scales=scales)
        [(launched, grid, block, args, _)] = launches
        assert launched == name and grid == (2, 3, 1) and block == (128, 1, 1)
        expected = 0 if kv_dtype == torch.bfloat16 else scales.data_ptr()
        assert int(args[3]) == int(args[4]) == expected


def test_the_heads_as_n_kernel_serves_at_most_8_heads_a_kv_head_at_head_dims_64_and_128_in_blocks_of_8():
    for kv_dtype in (torch.bfloat16, torch.int8, torch.float8_e4m3fn):
        for heads, kv_heads, head_dim, served in ((16, 2, 128, True), (28, 4, 128, True), (9, 3, 64, True),
                                                  (8, 8, 64, True), (32, 2, 128, False), (16, 2, 256, False),
                                                  (4, 4, 96, False), (8, 2, 32, False)):
            operands = kp.AttentionOperands(torch.bfloat16, heads, kv_heads, head_dim, kv_dtype, 16)
            assert kp.heads_n_serves(operands) == served, (kv_dtype, heads, kv_heads, head_dim)
    for block_size, served in ((4, False), (8, True), (128, True)):
        operands = kp.AttentionOperands(torch.float16, 16, 2, 128, torch.float16, block_size)
        assert kp.heads_n_serves(operands) == served, block_size


def test_8_heads_a_kv_head_launch_the_heads_as_n_kernel_on_every_path(launches, monkeypatch):
    """One CTA per (KV head, sequence, split or cluster rank): grid (KV heads, sequences, splits); one warp on the
    split path, 8 on the combined paths; the split paths' partials go to the same reduce; the clustered path is one
    kernel over clusters of 4 (no partials). The default (heads_as_n=None) takes it."""
    _attend(5000, "split", int8=True, heads_as_n=None)
    splits, _ = kp.split_plan(3, 16, 2, 5000, kp.resident_ctas(255, None))
    _attend(300, "combined", int8=True, heads_as_n=None)
    _attend(5000, "combined_split", dtype=torch.bfloat16, heads_as_n=None)
    assert [(name, grid, block) for name, grid, block, *_ in launches] == [
        ("paged_decode_heads_n_kernel<0,64,1,1>", (2, 3, splits), (32, 1, 1)),
        ("paged_reduce_kernel<0>", (16, 3, 1), (128, 1, 1)),
        ("paged_decode_heads_n_kernel<0,64,1,8>", (2, 3, 1), (256, 1, 1)),
        ("paged_decode_heads_n_kernel<1,64,0,8>", (2, 3, 20), (256, 1, 1)),
        ("paged_reduce_kernel<1>", (16, 3, 1), (128, 1, 1)),
    ]
    assert launches.clusters == [None] * 5
    monkeypatch.setattr(kp, "clusters_available", lambda index: True)
    for int8, dtype, name in ((True, torch.float16, "paged_decode_heads_n_kernel<0,64,1,8,4>"),
                              (False, torch.bfloat16, "paged_decode_heads_n_kernel<1,64,0,8,4>")):
        for bound in (17, 300, 1024):
            launches.clear()
            launches.clusters.clear()
            _attend(bound, "clustered", int8=int8, dtype=dtype, heads_as_n=None)
            [(launched, grid, block, args, shared_mem)] = launches  # no reduce
            assert launched == name and grid == (2, 3, 4) and block == (256, 1, 1) and shared_mem == 0
            assert launches.clusters == [(1, 1, 4)]
            assert int(args[8]) == int(args[9]) == 0  # no partials
            assert bound <= int(args[14]) < bound + kp.TILE_TOKENS  # one split of the whole bound
    launches.clear()
    _attend(300, "clustered", int8=True)  # heads_as_n=False: the heads-as-rows kernel
    _attend(300, "combined", int8=True, pipelined=False)
    assert [name for name, *_ in launches] == ["paged_decode_kernel<0,64,1,1,8,4>", "paged_decode_kernel<0,64,1,0,8>"]
    query, cache, scales, tables, seq_lens = _inputs(int8=True, heads=32)  # 16 query heads a KV head
    for path in ("combined", "clustered"):
        with pytest.raises(ValueError, match="heads_n"):
            kp.paged_decode_attention(query, cache, cache, tables, seq_lens, 300, 0.125, key_scales=scales,
                                      value_scales=scales, path=path, pipelined=True, heads_as_n=True)


def test_the_heads_as_n_kernels_are_compiled_ahead():
    from deepinfer.kernels import registry
    from deepinfer.kernels.compiler import source_text

    compiled_ahead = set(registry.get("paged_decode_attention").instantiations)
    for dtype in (torch.float16, torch.bfloat16):
        for head_dim in kp.HEADS_N_HEAD_DIMS:
            for kv_dtype in (dtype, torch.int8, torch.float8_e4m3fn):
                query = torch.zeros(1, 16, head_dim, dtype=dtype)
                cache = torch.zeros(1, 2, 16, head_dim, dtype=kv_dtype)
                for warps, cluster in ((1, 1), (kp.COMBINED_WARPS, 1), (kp.COMBINED_WARPS, kp.CLUSTER_CTAS)):
                    assert kp._kernel_name(query, cache, True, warps, cluster, heads_as_n=True) in compiled_ahead
    # the names off the clustered path leave CLUSTER out: the template must default it to one
    assert re.search(r"int WARPS, int CLUSTER = 1>\s*__global__ void __launch_bounds__\([^)]*\) "
                     r"paged_decode_heads_n_kernel\(", source_text(kp.SOURCE))


def test_8_heads_a_kv_head_take_the_combined_split_path_at_long_bounds_at_any_batch():
    def path(num_seqs, max_seq_len, heads_as_n):
        return table.decode_path(table.DecodeShape(num_seqs, 16, 2, max_seq_len, False, 132, heads_as_n))

    for num_seqs in (1, 8, 16, 64, 256):
        for bound in (4096, 32768):
            assert path(num_seqs, bound, True) == "combined_split", (num_seqs, bound)
    assert path(16, 16384, False) == path(64, 4096, False) == "split"  # the heads-as-rows kernel's choice
    assert path(64, 1024, True) == "combined" and path(1, 1024, True) == "split"  # short bounds as before


def test_the_combined_split_plan_fills_whole_waves_past_half_the_sms():
    # 48 sequences x 2 KV heads = 96 CTAs a split: one split leaves 36 of 132 SMs idle; 4 splits are 3 full waves
    assert kp.combined_split_plan(48, 16, 2, 8192, 132) == (4, 2048)
    assert kp.combined_split_plan(80, 16, 2, 4096, 132) == (4, 1024)  # 160 CTAs: 640 in 5 waves of 132
    assert kp.combined_split_plan(64, 16, 2, 4096, 132) == (1, 4096)  # 128 CTAs: one wave
    assert kp.combined_split_plan(16, 16, 2, 16384, 132) == (4, 4096)  # 132 // 32
    assert kp.combined_split_plan(48, 16, 2, 1024, 132) == (4, 256)
    assert kp.combined_split_plan(48, 16, 2, 512, 132) == (1, 512)  # 2 splits of 256 tokens fill no better


def test_one_stream_under_a_short_bound_takes_the_clustered_heads_as_n_kernel_in_every_cache_dtype(monkeypatch):
    from deepinfer.core.ops import paged_attention

    monkeypatch.setattr(kp, "multiprocessors", lambda index: 132)
    monkeypatch.setattr(paged_attention, "clusters_available", lambda index: True)
    monkeypatch.setattr(kp, "clusters_available", lambda index: True)
    for kv_dtype in (torch.float16, torch.int8, torch.float8_e4m3fn):
        operands = kp.AttentionOperands(torch.float16, 16, 2, 128, kv_dtype, 16)
        for num_seqs in (1, 8):
            assert paged_attention.decode_path(num_seqs, operands, 1024, 0) == "clustered", (kv_dtype, num_seqs)
            assert kp._takes_heads_as_n(torch.zeros(num_seqs, 16, 128, dtype=torch.float16),
                                        torch.zeros(1, 2, 16, 128, dtype=kv_dtype), "clustered", None)


def test_the_ops_decode_path_takes_the_heads_as_n_row_where_the_kernel_serves(monkeypatch):
    from deepinfer.core.ops import paged_attention

    monkeypatch.setattr(kp, "multiprocessors", lambda index: 132)
    monkeypatch.setattr(paged_attention, "clusters_available", lambda index: False)
    for heads, kv_dtype, path in ((16, torch.int8, "combined_split"), (16, torch.float8_e4m3fn, "combined_split"),
                                  (16, torch.float16, "combined_split"), (32, torch.float16, "split")):
        operands = kp.AttentionOperands(torch.float16, heads, 2, 128, kv_dtype, 16)
        assert paged_attention.decode_path(64, operands, 16384, 0) == path, (heads, kv_dtype)
