"""KVCache: the per-layer K/V tensor pools, allocated once, and the one way tokens are written in.

Layout per layer (documented in README "KV cache"):

    key_caches[l], value_caches[l]: [num_blocks, num_kv_heads, block_size, head_dim]

Per-head rows of one block are contiguous, which is what a paged decode kernel wants to read.
With `kv_cache_dtype="int8"` the pools hold int8 and a per-token, per-head scale sits beside them:

    key_scales[l], value_scales[l]: [num_blocks, num_kv_heads, block_size] float16

    x ≈ int8 * scale,  scale = max(|x| over head_dim) / 127

so one block costs `2 * num_kv_heads * block_size * (head_dim + 2)` bytes per layer instead of
`2 * num_kv_heads * block_size * head_dim * 2` for fp16.
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,  # model compute dtype; what read() returns
        device: torch.device | str,
        quantized: bool = False,  # int8 storage + per-token, per-head scales
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.quantized = quantized
        storage = torch.int8 if quantized else dtype
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        self.key_caches = [torch.zeros(shape, dtype=storage, device=device) for _ in range(num_layers)]
        self.value_caches = [torch.zeros(shape, dtype=storage, device=device) for _ in range(num_layers)]
        self.key_scales: list[torch.Tensor] = []
        self.value_scales: list[torch.Tensor] = []
        if quantized:
            scale_shape = (num_blocks, num_kv_heads, block_size)
            self.key_scales = [torch.zeros(scale_shape, dtype=torch.float16, device=device) for _ in range(num_layers)]
            self.value_scales = [torch.zeros(scale_shape, dtype=torch.float16, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, quantized: bool) -> int:
        """Bytes one block costs across all layers, K and V, scales included."""
        if quantized:
            per_token_head = head_dim * 1 + 2  # int8 values + one fp16 scale
        else:
            per_token_head = head_dim * torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * block_size * per_token_head

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store this step's new K/V. key/value: [T, num_kv_heads, head_dim]; slot_mapping: [T] int64."""
        blocks = slot_mapping // self.block_size  # [T]
        offsets = slot_mapping % self.block_size  # [T]
        if not self.quantized:
            self.key_caches[layer][blocks, :, offsets] = key.to(self.dtype)
            self.value_caches[layer][blocks, :, offsets] = value.to(self.dtype)
            return
        for cache, scales, x in ((self.key_caches, self.key_scales, key), (self.value_caches, self.value_scales, value)):
            q, scale = quantize_int8(x)
            cache[layer][blocks, :, offsets] = q
            scales[layer][blocks, :, offsets] = scale

    def read_blocks(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the given blocks in compute dtype. block_ids: [n] -> two [n, num_kv_heads, block_size, head_dim]."""
        key = self.key_caches[layer][block_ids]
        value = self.value_caches[layer][block_ids]
        if not self.quantized:
            return key, value
        key_scale = self.key_scales[layer][block_ids].to(self.dtype).unsqueeze(-1)
        value_scale = self.value_scales[layer][block_ids].to(self.dtype).unsqueeze(-1)
        return key.to(self.dtype) * key_scale, value.to(self.dtype) * value_scale


    def read_context(self, layer: int, block_ids: torch.Tensor, num_requests: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of `num_requests` equal-length block lists (request-major block_ids [R * nb]) as two contiguous
        [R, num_kv_heads, nb * block_size, head_dim] tensors in compute dtype. index_select on the contiguous
        pool is one memcpy per block where advanced indexing (read_blocks) walks elements: several times
        faster on the CPU for a decode's whole context."""
        out = []
        scales = (self.key_scales, self.value_scales) if self.quantized else (None, None)
        for caches, scale_list in zip((self.key_caches, self.value_caches), scales):
            gathered = caches[layer].index_select(0, block_ids)  # [R * nb, KVH, bs, D]
            if scale_list is not None:
                scale = scale_list[layer].index_select(0, block_ids)  # [R * nb, KVH, bs]
                gathered = gathered.to(self.dtype) * scale.to(self.dtype).unsqueeze(-1)
            blocks, heads, block_size, head_dim = gathered.shape
            gathered = gathered.view(num_requests, blocks // num_requests, heads, block_size, head_dim)
            out.append(gathered.transpose(1, 2).reshape(num_requests, heads, -1, head_dim))  # [R, KVH, S, D]
        return out[0], out[1]


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 over the last dim. x: [..., head_dim] -> (int8 [..., head_dim], fp16 scale [...])."""
    scale = x.float().abs().amax(dim=-1).clamp(min=1e-8) / INT8_MAX  # [...]
    scale = scale.to(torch.float16)
    q = torch.round(x.float() / scale.float().unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale
