"""The W8 kernel's launch plan and group index on the CPU: K splits cover K exactly once in whole steps of the
warps along K, at most a cluster's 8 and only where the device has clusters; the multiply-high group index equals
integer division wherever the launcher lets the kernel run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.kernels import w4_gemm
from deepinfer.kernels import w8_gemm as w8


@pytest.fixture
def sm90(monkeypatch):
    monkeypatch.setattr(w8, "_num_sms", lambda index: 132)
    monkeypatch.setattr(w8, "clusters_available", lambda index: True)


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


def test_few_row_tiles_split_k_and_many_do_not(sm90):
    # 2048-3584 rows are fewer than 2 CTAs an SM at one token: split in 2; 22016 rows fill the GPU on their own
    for in_features, out_features in ((2048, 2048), (11008, 2048), (18944, 3584)):
        assert w8.plan(1, in_features, out_features, 0)[1:3] == (1, 2)
        assert w8.plan(16, in_features, out_features, 0)[1:3] == (4, 8)
    assert w8.plan(1, 2048, 22016, 0).splits == w8.plan(16, 2048, 22016, 0).splits == 1


def test_overrides_and_devices_without_clusters(sm90, monkeypatch):
    assert w8.plan(64, 2048, 2048, 0, row_warps=2, splits=3)[1:3] == (2, 3)
    # K of 3 segments: one K step of 8 warps along K, three of one warp
    assert w8.plan(1, 160, 40, 0, splits=8).splits == 1
    assert w8.plan(1, 160, 40, 0, row_warps=8, splits=8).splits == 3
    with pytest.raises(ValueError, match="row_warps"):
        w8.plan(1, 2048, 2048, 0, row_warps=3)
    monkeypatch.setattr(w8, "clusters_available", lambda index: False)
    assert w8.plan(1, 11008, 2048, 0).splits == w8.plan(1, 11008, 2048, 0, splits=8).splits == 1


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


@pytest.mark.parametrize("tokens", [16, 17, 32, 33, 48, 49, 64, 100])
@pytest.mark.parametrize("in_features,out_features", [(2048, 2560), (11008, 2048), (2048, 22016), (18944, 3584),
                                                      (3584, 37888), (576, 1536), (160, 40)])
def test_wgmma_splits_cover_k_once_and_blocks_cover_tokens(sm90, tokens, in_features, out_features):
    plan = w8.wgmma_plan(tokens, in_features, out_features, 0)
    stages = -(-in_features // w8.SEGMENT)
    assert 1 <= plan.splits <= w8.MAX_SPLITS
    assert (plan.splits - 1) * plan.stages_per_split < stages <= plan.splits * plan.stages_per_split
    assert plan.tokens in w8.WGMMA_TOKEN_BLOCKS
    assert plan.tokens >= min(tokens, w8.WGMMA_TOKEN_BLOCKS[-1])
    assert plan.tokens - tokens < 16  # the fewest padded tokens a block
    if plan.splits > 1:
        assert plan.stages_per_split >= w8.WGMMA_MIN_STAGES


def test_wgmma_splits_eight_ways_up_to_64_row_blocks_four_beyond(sm90):
    # 2048-3584 rows (16-28 blocks of 128) split in 8; 22016 and 37888 rows (172, 296 blocks) in 4
    assert w8.wgmma_plan(64, 11008, 2048, 0).splits == w8.wgmma_plan(32, 18944, 3584, 0).splits == 8
    assert w8.wgmma_plan(32, 2048, 22016, 0).splits == w8.wgmma_plan(64, 3584, 37888, 0).splits == 4
    assert w8.wgmma_plan(64, 256, 8192, 0).splits == 2  # 4 stages: at least WGMMA_MIN_STAGES a split
    assert w8.wgmma_plan(64, 2048, 2048, 0, tokens=32, splits=3) == w8.WgmmaPlan(32, 3, 11)
    with pytest.raises(ValueError, match="tokens"):
        w8.wgmma_plan(64, 2048, 2048, 0, tokens=24)


def test_wgmma_path_beyond_32_tokens_or_on_long_k_above_2048_rows_on_sm90_only(monkeypatch):
    monkeypatch.setattr(w4_gemm, "wgmma_available", lambda index: True)
    assert not w8.uses_wgmma(32, 2048, 22016, 0) and w8.uses_wgmma(33, 2048, 22016, 0)
    assert not w8.uses_wgmma(16, 18944, 3584, 0) and w8.uses_wgmma(17, 18944, 3584, 0)  # K >= 4 N
    assert not w8.uses_wgmma(64, 11008, 2048, 0)  # 2048 rows: the mma.sync kernel at any token count
    assert w8.uses_wgmma(1, 2048, 2048, 0, wgmma=True) and not w8.uses_wgmma(64, 2048, 22016, 0, wgmma=False)
    monkeypatch.setattr(w4_gemm, "wgmma_available", lambda index: False)
    assert not w8.uses_wgmma(64, 2048, 22016, 0)
    with pytest.raises(ValueError, match="SM90"):
        w8.uses_wgmma(64, 2048, 22016, 0, wgmma=True)