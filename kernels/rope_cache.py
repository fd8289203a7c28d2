"""Launcher of rope_cache.cu: rotary embedding on q/k fused with the paged KV-cache write."""

from __future__ import annotations

import torch

from deepinfer.kernels.compiler import get_kernel
from deepinfer.kernels.launch import i32, i64, launch, ptr

SOURCE = "rope_cache.cu"
_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}
# The kernels' KV template argument of a quantized cache storage (0: the activations' dtype): kernels/rope_cache.cuh
KV_CODES = {torch.int8: 1, torch.float8_e4m3fn: 2}
MAX_HEAD_DIM = 256


def unsupported_reason(dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, block_size: int) -> str | None:
    """Why the kernel cannot rotate and cache `dtype` keys of `head_dim` into a `kv_dtype` cache of `block_size`
    blocks (None when it can)."""
    if dtype not in _DTYPE_CODES:
        return f"dtype {dtype} (kernel takes float16/bfloat16)"
    if kv_dtype not in (dtype, *KV_CODES):
        return f"KV cache dtype {kv_dtype} with activations {dtype}"
    if head_dim % 2 or head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} (kernel needs an even head_dim of at most {MAX_HEAD_DIM})"
    if block_size & (block_size - 1):
        return f"block_size {block_size} is not a power of two"
    return None


def _token_major(x: torch.Tensor) -> torch.Tensor:
    """[T, heads, D] with heads and D packed (any token stride)."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def rope_and_cache_write(query: torch.Tensor | None, key: torch.Tensor, value: torch.Tensor,
                         cos: torch.Tensor | None, sin: torch.Tensor | None, key_cache: torch.Tensor,
                         value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         key_scales: torch.Tensor | None = None, value_scales: torch.Tensor | None = None,
                         query_out: torch.Tensor | None = None, key_out: torch.Tensor | None = None,
                         ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Rotate q/k with cos/sin [T, D/2] and store rotated k and v at slot_mapping [T] int64.

    Returns (rotated query [T, H, D], rotated key [T, KVH, D]); with cos None nothing rotates,
    only the cache write happens, and (None, None) is returned. query_out/key_out: contiguous buffers to fill.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    key, value = _token_major(key), _token_major(value)
    has_rope = cos is not None
    if has_rope:
        query = _token_major(query)
        cos = cos.reshape(num_tokens, head_dim // 2).contiguous()
        sin = sin.reshape(num_tokens, head_dim // 2).contiguous()
        if query_out is None:
            query_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if key_out is None:
            key_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    else:
        query_out = key_out = None
    if num_tokens == 0:
        return query_out, key_out
    num_heads = query.shape[1] if has_rope else 0
    kvq = KV_CODES.get(key_cache.dtype, 0)
    block_size = key_cache.shape[2]
    index = key.device.index
    name = f"rope_cache_kernel<{_DTYPE_CODES[key.dtype]},{kvq},{int(has_rope)}>"
    heads_walked = num_heads + 2 * num_kv_heads  # q heads are skipped without rope (num_heads 0)
    launch(get_kernel(SOURCE, name, index), (num_tokens, -(-heads_walked // 4), 1), (128, 1, 1), (
        ptr(query if has_rope else None), ptr(key), ptr(value), ptr(cos), ptr(sin), ptr(query_out), ptr(key_out),
        ptr(key_cache), ptr(value_cache), ptr(key_scales if kvq else None), ptr(value_scales if kvq else None),
        ptr(slot_mapping.to(torch.int64).contiguous()), i32(num_heads), i32(num_kv_heads), i32(head_dim),
        i32(block_size.bit_length() - 1), i64(query.stride(0) if has_rope else 0), i64(key.stride(0)),
        i64(value.stride(0))), index)
    return query_out, key_out
