"""Which path paged decode attention takes and what it launches (CPU: kernels and launches faked).

Combined path (bounds up to COMBINED_MAX_SEQ_LEN, no explicit tokens_per_split): one kernel, one split, CTAs of
COMBINED_WARPS warps, a grid that does not depend on the bound. Clustered path (the same bounds, fewer CTAs, SM90+):
that kernel over clusters of CLUSTER_CTAS CTAs. Split path: one-warp CTAs over split_plan's splits, then the
reduce kernel when there is more than one split.
"""

from __future__ import annotations

import re

import pytest
import torch

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


def _attend(max_seq_len, tokens_per_split=None, pipelined=None, combined=None, **shape):
    query, cache, scales, tables, seq_lens = _inputs(**shape)
    kp.paged_decode_attention(query, cache, cache, tables, seq_lens, max_seq_len, 0.125, key_scales=scales,
                              value_scales=scales, tokens_per_split=tokens_per_split, pipelined=pipelined,
                              combined=combined)


def test_the_default_path_is_combined_only_with_enough_ctas():
    assert kp.COMBINED_MIN_CTAS == 64
    # Qwen2.5-3B's 16 / 2 heads: one CTA per sequence and KV head
    assert not kp.takes_combined_path(1, 16, 2, 1024) and not kp.takes_combined_path(31, 16, 2, 1024)
    assert kp.takes_combined_path(32, 16, 2, 1024) and kp.takes_combined_path(64, 16, 2, 300)
    assert kp.takes_combined_path(2, 64, 2, 1024) is False  # 2 x 2 x 2 head tiles = 8 CTAs
    assert not kp.takes_combined_path(64, 16, 2, 2048)  # past the bound: split
    assert not kp.takes_combined_path(64, 16, 2, 1024, tokens_per_split=64)
    assert kp.takes_combined_path(1, 16, 2, 1024, combined=True)  # forced
    assert not kp.takes_combined_path(64, 16, 2, 300, combined=False)
    with pytest.raises(ValueError, match="combined path serves bounds up to 1024"):
        kp.takes_combined_path(1, 16, 2, 2048, combined=True)


def test_few_sequences_take_the_split_path_by_default_without_clusters(launches):
    _attend(300)  # 3 sequences x 2 KV heads = 6 CTAs
    assert [name for name, *_ in launches] == ["paged_decode_kernel<0,64,0,1>", "paged_reduce_kernel<0>"]
    assert launches.clusters == [None, None]


def test_few_sequences_take_the_clustered_path_on_sm90(launches, monkeypatch):
    monkeypatch.setattr(kp, "clusters_available", lambda index: True)
    for bound in (17, 300, 1024):
        launches.clear()
        launches.clusters.clear()
        _attend(bound)  # 3 sequences x 2 KV heads = 6 CTAs a split: a cluster of 4 each
        [(name, grid, block, args, shared_mem)] = launches  # no reduce
        assert name == "paged_decode_kernel<0,64,0,1,8,4>" and block == (256, 1, 1) and shared_mem == 0
        assert grid == (2, 3, 4) and launches.clusters == [(1, 1, 4)]
        part_out, part_stats, tokens_per_split = int(args[8]), int(args[9]), int(args[14])
        assert part_out == part_stats == 0  # no partials
        assert bound <= tokens_per_split < bound + kp.TILE_TOKENS
    query, cache, *_ = _inputs()
    assert kp.plan_for(query, cache, 300) == (1, 304)


def test_the_clustered_path_serves_few_sequences_whose_clusters_fit_the_sms(monkeypatch):
    monkeypatch.setattr(kp, "_device_limits", lambda index: (132, 2048, 65536, 32))
    monkeypatch.setattr(kp, "clusters_available", lambda index: True)
    assert kp.CLUSTER_CTAS == 4
    # Qwen2.5-3B's 16 / 2 heads: a stream is 2 CTAs a split, 8 clustered
    assert kp.takes_clustered_path(1, 16, 2, 1024, 0) and kp.takes_clustered_path(16, 16, 2, 300, 0)  # 128 CTAs
    assert not kp.takes_clustered_path(17, 16, 2, 1024, 0)  # 136 CTAs would not all be resident on 132 SMs
    assert not kp.takes_clustered_path(32, 16, 2, 1024, 0)  # 64 CTAs: the combined path's
    assert not kp.takes_clustered_path(1, 16, 2, 2048, 0)  # past the bound: split
    assert not kp.takes_clustered_path(1, 16, 2, 1024, 0, tokens_per_split=64)
    assert not kp.takes_clustered_path(1, 16, 2, 1024, 0, combined=True)  # a forced path is that path
    assert not kp.takes_clustered_path(1, 16, 2, 1024, 0, combined=False)
    assert not kp.takes_clustered_path(1, 16, 2, 1024, 0, clustered=False)
    assert kp.takes_clustered_path(64, 16, 2, 300, 0, clustered=True)  # forced
    assert [kp.decode_path(n, 16, 2, bound, 0) for n, bound in ((1, 1024), (32, 1024), (1, 2048))] == [
        "clustered", "combined", "split"]
    with pytest.raises(ValueError, match="clustered path serves bounds up to 1024"):
        kp.takes_clustered_path(1, 16, 2, 2048, 0, clustered=True)
    monkeypatch.setattr(kp, "clusters_available", lambda index: False)
    assert not kp.takes_clustered_path(1, 16, 2, 1024, 0)
    with pytest.raises(ValueError, match="on SM90"):
        kp.takes_clustered_path(1, 16, 2, 1024, 0, clustered=True)


def test_bounds_up_to_1024_without_explicit_splits_take_the_combined_path():
    assert kp.COMBINED_MAX_SEQ_LEN == 1024 and kp.COMBINED_WARPS == 8
    for bound in (1, 15, 16, 17, 300, 1024):
        assert kp.combined_path(bound), bound
    for bound in (1025, 2048, 4096, 1 << 20):
        assert not kp.combined_path(bound), bound
    for per_split in (16, 32, 1024, 1 << 20):  # an explicit split size always takes the split path
        assert not kp.combined_path(300, per_split)
    # a warp walks at most 8 of the bound's 16-token tiles
    assert kp.COMBINED_MAX_SEQ_LEN // kp.TILE_TOKENS // kp.COMBINED_WARPS == 8


def test_combined_path_is_one_kernel_of_8_warps_whose_grid_ignores_the_bound(launches):
    grids = set()
    for bound in (17, 300, 1024):
        launches.clear()
        _attend(bound, combined=True)
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
    _attend(300, pipelined=False, combined=True, dtype=torch.bfloat16, int8=True, head_dim=256)
    _attend(1024, combined=True, heads=32, kv_heads=1, head_dim=128)  # GQA 32: two 16-head tiles of the one KV head
    _attend(300, combined=True, heads=8, kv_heads=8, head_dim=96)  # GQA 1
    assert [(name, grid) for name, grid, *_ in launches] == [
        ("paged_decode_kernel<1,256,1,0,8>", (2, 3, 1)),
        ("paged_decode_kernel<0,128,0,1,8>", (2, 3, 1)),
        ("paged_decode_kernel<0,96,0,1,8>", (8, 3, 1)),
    ]


def test_long_bounds_and_explicit_splits_keep_the_split_path(launches):
    _attend(5000)
    resident = kp.resident_ctas(255, None)
    splits, per_split = kp.split_plan(3, 16, 2, 5000, resident)
    assert splits > 1
    (name, grid, block, args, _), (reduce, reduce_grid, reduce_block, reduce_args, shared_mem) = launches
    assert name == "paged_decode_kernel<0,64,0,1>" and block == (32, 1, 1) and grid == (2, 3, splits)
    assert int(args[14]) == per_split and int(args[8]) != 0 and int(args[9]) != 0
    assert reduce == "paged_reduce_kernel<0>" and reduce_grid == (16, 3, 1) and reduce_block == (128, 1, 1)
    assert int(reduce_args[4]) == splits and shared_mem == 4 * splits

    launches.clear()
    _attend(300, tokens_per_split=32)  # short bound, explicit splits: 10 of 32 tokens, then the reduce
    assert [(name, grid, block) for name, grid, block, *_ in launches] == [
        ("paged_decode_kernel<0,64,0,1>", (2, 3, 10), (32, 1, 1)), ("paged_reduce_kernel<0>", (16, 3, 1), (128, 1, 1))]

    launches.clear()
    _attend(2048, tokens_per_split=1 << 20)  # one split: the one-warp kernel writes the output itself
    assert [(name, grid, block) for name, grid, block, *_ in launches] == [
        ("paged_decode_kernel<0,64,0,1>", (2, 3, 1), (32, 1, 1))]


def test_plan_for_reports_one_split_on_the_combined_path_without_compiling(monkeypatch, launches):
    query, cache, *_ = _inputs()
    assert kp.plan_for(query, cache, 300, combined=True) == (1, 304)
    assert kp.plan_for(query, cache, 1024, combined=True) == (1, 1024)
    assert kp.plan_for(query, cache, 5000) == kp.split_plan(3, 16, 2, 5000, kp.resident_ctas(255, None))
    assert kp.plan_for(query, cache, 300, tokens_per_split=64) == (5, 64)

    def no_compile(source, name, index):
        raise AssertionError(f"compiled {name}")

    monkeypatch.setattr(kp, "get_kernel", no_compile)
    assert kp.plan_for(query, cache, 17, combined=True) == (1, 32)


def test_the_read_probe_keeps_the_split_paths_grid_at_short_bounds(launches):
    query, cache, _, tables, seq_lens = _inputs()
    kp.kv_read_probe(query, cache, cache, tables, seq_lens, 300)
    splits, per_split = kp.split_plan(3, 16, 2, 300, kp.resident_ctas(255, None))
    [(name, grid, block, args, _)] = launches
    assert name == "paged_read_probe_kernel<0,64>" and grid == (2, 3, splits) and block == (32, 1, 1)
    assert int(args[-1]) == per_split


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
