"""The split GEMV's launch plan on the CPU: K-parts chosen from the shape, grid, block and the exact
argument list it launches with (kernel and launch mocked), and the points `bench gemv` times it at."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from deepinfer.core.bench.gemv_bench import quant_points
from deepinfer.kernels import quant_matmul as kq
from deepinfer.kernels.compiler import source_text


@pytest.mark.parametrize("num_rows,in_features,num_sms,expected", [
    # H200 (132 SMs) wants 4 * 132 * 8 = 4224 warps; a CTA is 8 warps over 8 / ksplit row pairs
    (4096, 4096, 132, 4),   # 2048 pairs: 1 -> 2048 warps, 2 -> 4096, 4 -> 8192
    (11008, 2048, 132, 1),  # 5504 pairs -> 688 CTAs = 5504 warps with one part
    (2048, 11008, 132, 8),  # 1024 pairs: 4 -> 4096 warps, 8 -> 8192 (344 chunks >= 8 * 32)
    (2048, 2048, 132, 2),   # 4 would fill the GPU, but 64 chunks allow at most 2 parts of 32 lanes
    (1000, 11008, 132, 8),  # 500 pairs never reach 4224 warps: the most parts K allows
    (1536, 576, 132, 1),    # 18 chunks: fewer than one lane's worth per part, one part
    (8, 8192, 1, 8),        # 1 SM wants 32 warps: 4 pairs / (8 / 8) = 4 CTAs exactly
    (8, 8160, 1, 4),        # 255 chunks < 8 * 32: the 8-part plan is not allowed
    (9, 8192, 1, 8),        # 5 pairs (odd row count rounds up): 8 parts -> 5 CTAs
    (9, 8192, 2, 8),        # 64 warps wanted, 40 at most: the most parts K allows
    (2, 8192, 1, 8),
])
def test_split_ksplit_takes_the_fewest_parts_that_fill_the_gpu(num_rows, in_features, num_sms, expected):
    assert kq.split_ksplit(num_rows, in_features, num_sms) == expected


def _warps(num_rows: int, parts: int) -> int:
    """Warps of the split grid: CTAs of 8 / parts row pairs, 8 warps each."""
    return math.ceil(math.ceil(num_rows / 2) / (8 // parts)) * 8


def test_split_ksplit_fills_the_gpu_or_uses_every_part_k_allows():
    wanted_warps = 4 * 132 * 8
    for num_rows in (1, 2, 7, 64, 1000, 2048, 2560, 4096, 11008, 22016):
        for in_features in (32, 576, 2048, 4096, 8192, 11008, 14336):
            parts = kq.split_ksplit(num_rows, in_features, 132)
            allowed = [p for p in (1, 2, 4, 8) if p == 1 or 32 * p <= in_features // 32]
            assert parts in allowed
            assert _warps(num_rows, parts) >= wanted_warps or parts == allowed[-1]
            assert all(_warps(num_rows, fewer) < wanted_warps for fewer in allowed if fewer < parts)


def _kernel_parameters(name: str) -> list[str]:
    """C types of the split kernel's parameters, read from quant_matmul.cu: 'ptr' or 'int'."""
    text = source_text(kq.SOURCE)
    match = re.search(rf"__global__ void __launch_bounds__\(256\) {name}\((.*?)\)\s*{{", text, re.DOTALL)
    params = [param.strip() for param in re.sub(r"//[^\n]*", "", match.group(1)).split(",")]
    return ["ptr" if "*" in param else param.split()[0] for param in params]


@pytest.fixture
def launches(monkeypatch):
    recorded = []
    monkeypatch.setattr(kq, "get_kernel", lambda source, name, index: (source, name))
    monkeypatch.setattr(kq, "launch", lambda kernel, grid, block, args, index: recorded.append(
        (kernel[1], grid, block, args)))
    monkeypatch.setattr(kq, "_num_sms", lambda index: 132)
    monkeypatch.setattr(kq, "_plans", {})
    return recorded


@pytest.mark.parametrize("num_tokens,out_features,in_features,splits,parts,tile,grid", [
    (1, 4096, 4096, None, 4, 1, (1024, 1, 1)),      # planned 4 parts: 2 row pairs = 4 rows per CTA
    (2, 2048, 11008, None, 8, 2, (1024, 1, 1)),     # 8 parts: one row pair per CTA
    (3, 11008, 2048, None, 1, 4, (688, 1, 1)),      # one part: 8 row pairs = 16 rows per CTA, 3 tokens in one
    (4, 1001, 576, 2, 2, 4, (126, 1, 1)),           # forced 2 parts: 8 rows per CTA, the last one partly
    (5, 1000, 4096, 8, 8, 4, (500, 2, 1)),          # 5 tokens: two 4-token CTAs (tile 4) per row pair
])
def test_split_launch_plan_and_arguments(launches, num_tokens, out_features, in_features, splits, parts, tile, grid):
    qweight = torch.zeros(out_features, in_features // 8, dtype=torch.int32)
    scales = torch.ones(out_features, in_features // 32, dtype=torch.float32)
    x = torch.zeros(num_tokens, in_features, dtype=torch.bfloat16)
    out = kq.quant_matmul(x, qweight, scales, scales, 4, 32, "min", kernel="split", splits=splits)
    assert out.shape == (num_tokens, out_features) and out.dtype == torch.bfloat16
    (name, launch_grid, block, args), = launches
    assert name == f"quant_gemv_split_kernel<1,4,{tile},1>"
    assert name in kq.instantiations()
    assert launch_grid == grid and block == (256, 1, 1)
    assert [{np.uint64: "ptr", np.int32: "int"}[type(arg)] for arg in args] == _kernel_parameters(
        "quant_gemv_split_kernel")
    assert [int(arg) for arg in args[6:]] == [num_tokens, out_features, in_features, 32, 1, parts]
    assert int(args[1]) == qweight.data_ptr() and int(args[4]) == 0  # no bias


def test_split_rejects_a_part_count_it_cannot_take(launches):
    x = torch.zeros(1, 256, dtype=torch.float16)
    qweight = torch.zeros(64, 32, dtype=torch.int32)
    scales = torch.ones(64, 2, dtype=torch.float16)
    with pytest.raises(ValueError, match="K-parts"):
        kq.quant_matmul(x, qweight, scales, scales, 4, 128, "zero", kernel="split", splits=3)
    assert not launches


def test_every_split_instantiation_is_listed_for_precompilation():
    names = [name for name in kq.instantiations() if name.startswith("quant_gemv_split_kernel<")]
    assert sorted(names) == sorted(f"quant_gemv_split_kernel<{dt},{bits},{tile},{f32}>" for dt in (0, 1)
                                   for bits in (4, 3) for tile in (1, 2, 4) for f32 in (0, 1))
    assert [kq.default_tile("split", m) for m in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, 4]


def test_bench_times_split_at_one_two_and_four_tokens():
    # 1 token: every part count K allows (4096 -> 128 chunks: 1, 2, 4); 2 and 4 tokens: the planned one
    assert [p for p in quant_points(1, 4096, 4) if p[0] == "split"] == [("split", 1), ("split", 2), ("split", 4)]
    assert [p for p in quant_points(1, 14336, 8) if p[0] == "split"] == [("split", k) for k in (1, 2, 4, 8)]
    assert ("split", 2) in quant_points(2, 2048, 2) and ("split", 8) in quant_points(4, 11008, 8)
    assert [p[0] for p in quant_points(2, 4096, 4)] == ["tc", "tcs", "gemv", "stream", "split", "ksplit", "staged",
                                                          "mma"]
    assert [p[0] for p in quant_points(32, 2048, 2)] == ["tc", "tcs", "ksplit", "staged", "mma", "dense"]
    assert [p[0] for p in quant_points(8, 2048, 2, tc_takes=False)] == ["ksplit", "staged", "mma"]  # dense from 16
    assert [p[0] for p in quant_points(33, 2048, 2)] == ["staged", "mma", "dense"]  # tc: up to 32 tokens
    assert [p for p in quant_points(1, 4096, 4, sweep_split=False) if p[0] == "split"] == [("split", 4)]
    assert all(p[0] != "split" for p in quant_points(8, 4096, 4))


def test_bench_gemv_attention_rows_name_their_path():
    """The attention table says which path a row timed: the combined or clustered kernel (one split, no reduce) or
    the split path with its split count; rows recorded before the path was stored show their split count."""
    from rich.console import Console

    from deepinfer.core.bench.gemv_bench import gemv_tables

    row = {"batch": 64, "context": 1024, "heads": 16, "kv_heads": 2, "head_dim": 128, "dtype": "bfloat16",
           "kv": "same", "pipelined": True, "splits": 1, "us_mean": 10.0, "us_std": 0.1, "gbps": 3000.0,
           "fraction_of_copy": 0.7, "torch_us_mean": None, "speedup_vs_torch": None}
    targets = {"w4_batch1_bandwidth": [], "w4_batch16_cost": [], "decode_attention_bandwidth": []}
    payload = {"copy_bandwidth": {"gbps_mean": 4252.0, "gbps_std": 8.0}, "quant_matmul": [], "targets": targets,
               "paged_attention": [row | {"path": "combined"}, row | {"batch": 1, "path": "split", "splits": 32},
                                   row | {"batch": 2, "splits": 16}, row | {"batch": 4, "path": "clustered"}]}
    console = Console(record=True, width=200)
    for table in gemv_tables(payload):
        console.print(table)
    lines = [line for line in console.export_text().splitlines() if "16/2x128" in line]
    assert len(lines) == 4
    assert "combined" in lines[0] and "split 32" in lines[1] and "split 16" in lines[2] and "clustered" in lines[3]
