"""The merged q/k/v projection with RoPE and the paged KV-cache write fused into the product's epilogue.

A decode step runs the W4 q/k/v product on the tc kernel and then rope_cache_kernel, which reads the product
back, rotates q and k and stores k and v in the cache: a kernel launch and its round trips per layer. Where the
fused kernel serves (kernels/quant_matmul.py: qkv_rope_unsupported_reason, qkv_rope_takes), the product's
epilogue does that work instead, with the same roundings, so the results are the unfused ones bit for bit.
Everywhere else (other weights, more tokens, int8 caches, the CPU) the caller runs the two ops.
"""

from __future__ import annotations

import torch

from deepinfer.core.ops import dispatch


def qkv_rotary_and_cache_write(x: torch.Tensor, qkv_proj: torch.nn.Module, num_heads: int, num_kv_heads: int,
                               head_dim: int, cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                               value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """x [T, hidden] through the merged projection `qkv_proj` ([q | k | v] outputs), q and k rotated with cos/sin
    [T, D/2] (or [T, 1, D/2]), the rotated k and v stored at slot_mapping [T]: (query [T, H, D], key [T, KVH, D],
    value [T, KVH, D]) as `qkv_proj(x)` + rotary_and_cache_write would give, or None where the fused kernel does
    not serve (the caller then runs those two)."""
    from deepinfer.kernels import registry
    from deepinfer.kernels.quant_matmul import qkv_rope_takes

    op = registry.get("quant_matmul_rope_cache")
    served = dispatch.fused_product_inputs(
        op.name, x, qkv_proj, qkv_rope_takes,
        (num_heads, num_kv_heads, head_dim, cos.dtype, key_cache.device, key_cache.dtype, key_cache.shape[2]),
        (cos, key_cache),
        lambda packed: (None if cos.dtype == x.dtype else f"cos/sin {cos.dtype} with activations {x.dtype}")
        or op.unsupported_reason(packed.qweight, packed.bits, packed.group_size, packed.in_features, num_heads,
                                 num_kv_heads, head_dim, key_cache, x.dtype))
    if served is None:
        return None
    x, packed = served
    return op.launch(x, packed.qweight, packed.scales, packed.zeros, packed.bias, packed.group_size,
                     packed.zero_mode, packed.integer_zeros, num_heads, num_kv_heads, head_dim, cos, sin, key_cache,
                     value_cache, slot_mapping)
