"""The merged q/k/v projection with RoPE and the paged KV-cache write fused into the product's epilogue.

A decode step runs the W4 q/k/v product on the tc kernel and then rope_cache_kernel, which reads the product
back, rotates q and k and stores k and v in the cache: a kernel launch and its round trips per layer. Where the
fused kernel serves (core/ops/quant_matmul_table.py: QKV_ROPE; kernels/quant_matmul.py:
qkv_rope_unsupported_reason), the product's epilogue does that work instead, with the same roundings, so the
results are the unfused ones bit for bit, into 16-bit, int8 and e4m3 caches alike. Everywhere else (other weights,
more tokens, the CPU) the caller runs the two ops.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from deepinfer.core.ops import dispatch
from deepinfer.core.ops.quant_matmul import ProductCase, product_reason, product_shape, stored_order
from deepinfer.core.ops.quant_matmul_table import QKV_ROPE, epilogue_serves
from deepinfer.core.quant.packed import PackedWeight
from deepinfer.kernels import quant_matmul as kernels


class QkvRopeCase(NamedTuple):
    devices: tuple[torch.device, ...]  # the activations', the weight's, cos/sin's and the cache's
    product: ProductCase
    in_features: int
    out_features: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    cos_dtype: torch.dtype
    kv_dtype: torch.dtype
    block_size: int


def _reason(case: QkvRopeCase) -> str | None:
    dtype = case.product.dtype
    return (product_reason(case.product)
            or (None if case.cos_dtype == dtype else f"cos/sin {case.cos_dtype} with activations {dtype}")
            or kernels.qkv_rope_unsupported_reason(case.product.weight.bits, case.product.weight.group_size,
                                                   case.in_features, case.out_features, case.num_heads,
                                                   case.num_kv_heads, case.head_dim, case.kv_dtype, case.block_size,
                                                   dtype))


def qkv_rotary_and_cache_write(x: torch.Tensor, packed: PackedWeight | None, num_heads: int, num_kv_heads: int,
                               head_dim: int, cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                               value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                               key_scales: torch.Tensor | None = None, value_scales: torch.Tensor | None = None,
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """x [T, hidden] through the merged q/k/v weight `packed` ([q | k | v] outputs; None for an unquantized
    projection), q and k rotated with cos/sin [T, D/2] (or [T, 1, D/2]), the rotated k and v stored at
    slot_mapping [T] (quantized with key_scales/value_scales for an int8 or fp8 cache): (query [T, H, D],
    key [T, KVH, D], value [T, KVH, D]) as the product followed by rotary_and_cache_write would give, or None where
    the fused kernel does not serve (the caller then runs those two)."""
    if packed is None or not epilogue_serves(QKV_ROPE, product_shape(x.shape[0], packed)):
        return None
    case = QkvRopeCase((x.device, packed.qweight.device, cos.device, key_cache.device), ProductCase.of(x, packed),
                       packed.in_features, packed.out_features, num_heads, num_kv_heads, head_dim, cos.dtype,
                       key_cache.dtype, key_cache.shape[2])
    if not dispatch.decide(QKV_ROPE.op, case, _reason, (x,), fallback="separate ops"):
        return None
    rows = stored_order(x, packed)
    return kernels.quant_matmul_rope_cache(rows, packed.qweight, packed.scales, packed.zeros, packed.bias,
                                           packed.group_size, packed.zero_mode, packed.integer_zeros, num_heads,
                                           num_kv_heads, head_dim, cos, sin, key_cache, value_cache, slot_mapping,
                                           key_scales, value_scales)
