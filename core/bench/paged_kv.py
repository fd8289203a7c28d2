"""Random paged KV caches with block tables that scatter each sequence over shuffled blocks: the inputs of the
decode-attention benchmark (`deepinfer bench gemv`) and of `deepinfer validate-kernels`."""

from __future__ import annotations

import torch


def random_paged_kv(seq_lens, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                    int8: bool, device, spare_blocks: int = 7, table_blocks: int = 0, fp8: bool = False):
    """-> (key_cache, value_cache, key_scales, value_scales, block_tables): caches [num_blocks, KVH, block_size, D]
    with random contents (int8 with fp16 scales [num_blocks, KVH, block_size] when `int8`, else `dtype` and no
    scales; with `fp8` e4m3 codes of N(0, 4) values and fp32 per-head scales [KVH]), block_tables [len(seq_lens), max_blocks] int32. table_blocks: the least width of the tables (a CUDA
    graph's are as wide as its bound)."""
    needed = [-(-length // block_size) for length in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    order = torch.randperm(num_blocks).tolist()
    max_blocks = max(max(needed) + 2, table_blocks)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    start = 0
    for row, count in enumerate(needed):
        tables[row, :count] = torch.tensor(order[start:start + count], dtype=torch.int32)
        start += count
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    if int8:
        caches = [torch.randint(-127, 128, shape, dtype=torch.int8, device=device) for _ in range(2)]
        scales = [(torch.rand(shape[:3], device=device) * 0.015 + 0.005).half() for _ in range(2)]
    elif fp8:
        caches = [(torch.randn(shape, device=device) * 4).to(torch.float8_e4m3fn) for _ in range(2)]
        scales = [torch.rand(num_kv_heads, device=device) * 0.5 + 0.05 for _ in range(2)]
    else:
        caches = [torch.randn(shape, dtype=dtype, device=device) for _ in range(2)]
        scales = [None, None]
    return caches[0], caches[1], scales[0], scales[1], tables.to(device)
