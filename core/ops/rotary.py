"""RoPE on q/k fused with the paged KV-cache write; and the cache write alone.

Cache layout (core/kv/cache.py): [num_blocks, num_kv_heads, block_size, head_dim] per layer; int8 with fp16
per-token, per-head scales [num_blocks, num_kv_heads, block_size], or float8 e4m3 with fixed per-head scales
[num_kv_heads] float32 (the cache dtype says which).
A token with flat slot s lands in block s // block_size at offset s % block_size.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from deepinfer.core.kv.cache import FP8_DTYPE, quantize_fp8, quantize_int8
from deepinfer.core.ops import dispatch
from deepinfer.kernels import rope_cache as kernels

ROPE_OP, WRITE_OP = "rope_cache_write", "kv_cache_write"


class CacheWriteCase(NamedTuple):
    devices: tuple[torch.device, ...]
    dtype: torch.dtype  # the keys'
    kv_dtype: torch.dtype
    head_dim: int
    block_size: int
    same_dtypes: bool  # query, key and cos/sin share the keys' dtype (True for the write alone)


def _reason(case: CacheWriteCase) -> str | None:
    return (kernels.unsupported_reason(case.dtype, case.kv_dtype, case.head_dim, case.block_size)
            or (None if case.same_dtypes else "q/k/cos dtypes differ"))


def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (HF rotate-half layout), cos/sin [T, D/2] -> rotated x, in x's dtype."""
    cos, sin = cos.reshape(x.shape[0], 1, -1), sin.reshape(x.shape[0], 1, -1)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def write_kv_cache_reference(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                             value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                             key_scales: torch.Tensor | None = None, value_scales: torch.Tensor | None = None) -> None:
    block_size = key_cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size  # [T]
    if key_cache.dtype == FP8_DTYPE:  # as bytes: index_put serves uint8 on every device
        key_cache.view(torch.uint8)[blocks, :, offsets] = quantize_fp8(key, key_scales).view(torch.uint8)
        value_cache.view(torch.uint8)[blocks, :, offsets] = quantize_fp8(value, value_scales).view(torch.uint8)
        return
    if key_cache.dtype != torch.int8:
        key_cache[blocks, :, offsets] = key.to(key_cache.dtype)
        value_cache[blocks, :, offsets] = value.to(value_cache.dtype)
        return
    for cache, scales, x in ((key_cache, key_scales, key), (value_cache, value_scales, value)):
        codes, scale = quantize_int8(x)
        cache[blocks, :, offsets] = codes
        scales[blocks, :, offsets] = scale


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, key_scales: torch.Tensor | None = None,
                   value_scales: torch.Tensor | None = None) -> None:
    """Store key/value [T, KVH, D] at slot_mapping [T] int64 (quantizing for an int8 or fp8 cache)."""
    case = CacheWriteCase((key.device, value.device, key_cache.device), key.dtype, key_cache.dtype, key.shape[-1],
                          key_cache.shape[2], True)
    if dispatch.decide(WRITE_OP, case, _reason, (key, value)):
        kernels.rope_and_cache_write(None, key, value, None, None, key_cache, value_cache, slot_mapping, key_scales,
                                     value_scales)
        return
    write_kv_cache_reference(key, value, key_cache, value_cache, slot_mapping, key_scales, value_scales)


def rotary_and_cache_write(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, key_scales: torch.Tensor | None = None,
                           value_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query [T, H, D] and key [T, KVH, D] with cos/sin [T, D/2] (or [T, 1, D/2]), store the
    rotated key and the value in the paged cache; returns (rotated query, rotated key)."""
    case = CacheWriteCase((query.device, key.device, value.device, cos.device, sin.device, key_cache.device),
                          key.dtype, key_cache.dtype, key.shape[-1], key_cache.shape[2],
                          query.dtype == key.dtype == cos.dtype)
    if dispatch.decide(ROPE_OP, case, _reason, (query, key, value)):
        return kernels.rope_and_cache_write(query, key, value, cos, sin, key_cache, value_cache, slot_mapping,
                                            key_scales, value_scales)
    query, key = apply_rotary_reference(query, cos, sin), apply_rotary_reference(key, cos, sin)
    write_kv_cache_reference(key, value, key_cache, value_cache, slot_mapping, key_scales, value_scales)
    return query, key
