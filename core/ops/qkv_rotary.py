"""The merged q/k/v projection with RoPE and the paged KV-cache write fused into the product's epilogue.

A decode step runs the W4 q/k/v product on the tc kernel and then rope_cache_kernel, which reads the product
back, rotates q and k and stores k and v in the cache: a kernel launch and its round trips per layer. Where the
fused kernel serves (kernels/quant_matmul.py: qkv_rope_unsupported_reason, qkv_rope_takes), the product's
epilogue does that work instead, with the same roundings, so the results are the unfused ones bit for bit.
Everywhere else (other weights, more tokens, int8 caches, the CPU) the caller runs the two ops.
"""

from __future__ import annotations

import torch

from core.ops import dispatch


def qkv_rotary_and_cache_write(x: torch.Tensor, qkv_proj: torch.nn.Module, num_heads: int, num_kv_heads: int,
                               head_dim: int, cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                               value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """x [T, hidden] through the merged projection `qkv_proj` ([q | k | v] outputs), q and k rotated with cos/sin
    [T, D/2] (or [T, 1, D/2]), the rotated k and v stored at slot_mapping [T]: (query [T, H, D], key [T, KVH, D],
    value [T, KVH, D]) as `qkv_proj(x)` + rotary_and_cache_write would give, or None where the fused kernel does
    not serve (the caller then runs those two)."""
    from core.quant.quant_linear import QuantLinear
    from kernels import registry
    from kernels.quant_matmul import qkv_rope_takes

    if not isinstance(qkv_proj, QuantLinear):
        return None
    packed = qkv_proj.packed
    num_tokens = x.shape[0]
    op = registry.get("quant_matmul_rope_cache")
    if not qkv_rope_takes(num_tokens, packed.in_features, packed.out_features):
        return None
    signature = (x.device, x.dtype, packed.qweight.device, packed.bits, packed.group_size, packed.in_features,
                 packed.out_features, num_heads, num_kv_heads, head_dim, cos.dtype, key_cache.device, key_cache.dtype,
                 key_cache.shape[2], packed.scales.dtype, packed.qweight.data_ptr() % 16)
    if not dispatch.decide(op.name, signature, lambda: (
            dispatch.kernel_blocker(x, packed.qweight, cos, key_cache)
            or registry.get("quant_matmul").unsupported_reason(x, packed.qweight, packed.scales, packed.zeros,
                                                                packed.bits, packed.group_size)
            or (None if cos.dtype == x.dtype else f"cos/sin {cos.dtype} with activations {x.dtype}")
            or op.unsupported_reason(packed.qweight, packed.bits, packed.group_size, packed.in_features, num_heads,
                                     num_kv_heads, head_dim, key_cache, x.dtype)), fallback="separate ops"):
        return None
    if packed.input_perm is not None:
        x = x.index_select(1, packed.input_perm)  # stored column j multiplies x[input_perm[j]]
    return op.launch(x, packed.qweight, packed.scales, packed.zeros, packed.bias, packed.group_size,
                     packed.zero_mode, packed.integer_zeros, num_heads, num_kv_heads, head_dim, cos, sin, key_cache,
                     value_cache, slot_mapping)
