"""The W8 kernel's launch plan and group index on the CPU: K splits cover K exactly once in whole steps of the
warps along K, at most a cluster's 8 and only where the device has clusters; a warp's row tiles times token tiles
stay within its accumulators, the shared memory within the device's; the multiply-high group index equals integer
division wherever the launcher lets the kernel run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.kernels import w8_gemm as w8


@pytest.fixture
def sm90(monkeypatch):
    monkeypatch.setattr(w8, "_num_sms", lambda index: 132)
    monkeypatch.setattr(w8, "clusters_available", lambda index: True)
    monkeypatch.setattr(w8, "_max_shared_bytes", lambda index: 227 * 1024)


@pytest.mark.parametrize("tokens", [1, 8, 9, 16, 33, 64])
@pytest.mark.parametrize("in_features,out_features", [(2048, 2560), (11008, 2048), (2048, 22016), (18944, 3584),
                                                      (576, 1536), (160, 40)])
def test_splits_cover_k_once_in_whole_steps(sm90, tokens, in_features, out_features):
    plan = w8.plan(tokens, in_features, out_features, 0)
    segments = -(-in_features // w8.SEGMENT)
    k_warps = w8.WARPS // plan.row_warps
    assert 1 <= plan.splits <= w8.MAX_SPLITS
    assert plan.segs_per_split % k_warps == 0
    assert (plan.splits - 1) * plan.segs_per_split < segments <= plan.splits * plan.segs_per_split
    assert 8 * plan.tiles >= min(tokens, w8.MAX_TOKENS)
    assert plan.row_tiles * plan.tiles <= w8.MAX_ACCUMULATOR_TILES
    assert plan.shared_bytes <= 227 * 1024


def test_few_row_tiles_split_k_and_many_do_not(sm90):
    # 2048-3584 rows are fewer than 2 CTAs an SM: split as LAUNCHES says; 22016 rows fill the GPU on their own
    for tokens in (1, 16, 32, 64):
        launch = w8.LAUNCHES[w8.token_tiles(tokens)]
        for in_features, out_features in ((2048, 2048), (11008, 2048), (18944, 3584)):
            plan = w8.plan(tokens, in_features, out_features, 0)
            assert (plan.row_warps, plan.row_tiles, plan.splits, plan.depth) == launch
    assert w8.plan(1, 2048, 22016, 0).splits == w8.plan(16, 2048, 22016, 0).splits == 1


def test_overrides_and_devices_without_clusters(sm90, monkeypatch):
    plan = w8.plan(64, 2048, 2048, 0, row_warps=2, splits=3)
    assert (plan.row_warps, plan.row_tiles, plan.depth, plan.splits) == (2, 1, w8.LAUNCHES[8].depth, 3)
    plan = w8.plan(16, 2048, 2048, 0, row_tiles=4, depth=4)
    assert (plan.row_tiles, plan.depth) == (4, 4)
    # K of 3 segments: one K step of 8 warps along K, three of one warp
    assert w8.plan(1, 160, 40, 0, splits=8).splits == 1
    assert w8.plan(1, 160, 40, 0, row_warps=8, splits=8).splits == 3
    with pytest.raises(ValueError, match="row_warps"):
        w8.plan(1, 2048, 2048, 0, row_warps=3)
    with pytest.raises(ValueError, match="row_tiles"):
        w8.plan(64, 2048, 2048, 0, row_tiles=2)  # 2 row tiles x 8 token tiles: more sums than registers hold
    with pytest.raises(ValueError, match="depth"):
        w8.plan(1, 2048, 2048, 0, depth=5)
    monkeypatch.setattr(w8, "clusters_available", lambda index: False)
    assert w8.plan(1, 11008, 2048, 0).splits == w8.plan(1, 11008, 2048, 0, splits=8).splits == 1


def test_shared_memory_is_the_stages_or_the_partial_sums(sm90, monkeypatch):
    # 4 stages of 8 warps along K x 64 tokens x 64 codes x 2 bytes = 256 KiB: cut to 3 stages (192 KiB) on 227 KiB
    plan = w8.plan(64, 4096, 4096, 0, row_warps=1, depth=4)
    assert (plan.depth, plan.shared_bytes) == (3, 3 * 8 * 64 * 64 * 2)
    # one warp along K, 2 stages of 8 tokens: 2 KiB of activations; the partial sums of 8 warps x 4 row tiles take more
    plan = w8.plan(8, 4096, 4096, 0, row_warps=8, row_tiles=4, depth=2)
    assert plan.shared_bytes == 8 * 4 * 1 * 4 * 32 * 4
    monkeypatch.setattr(w8, "_max_shared_bytes", lambda index: 99 * 1024)
    assert w8.plan(64, 4096, 4096, 0, row_warps=1, depth=4).depth == 2


def test_group_index_by_multiply_high_is_integer_division():
    k = np.arange(0, w8.MAX_IN_FEATURES, 16, dtype=np.uint64)  # a thread's first code of a 16-code span
    for group_size in range(32, w8.MAX_IN_FEATURES + 1, 32):
        by_magic = (k * np.uint64(w8.group_magic(group_size))) >> np.uint64(32)
        assert np.array_equal(by_magic, k // np.uint64(group_size)), group_size


def test_k_beyond_the_group_index_is_refused():
    x = torch.zeros(1, w8.MAX_IN_FEATURES + 32, dtype=torch.float16)
    with pytest.raises(ValueError, match="in_features"):
        w8.w8_gemm(x, torch.zeros(4, x.shape[1] // 4, dtype=torch.int32), torch.ones(4, 1), torch.zeros(4, 1),
                   x.shape[1], "zero", True)
