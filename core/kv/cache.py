"""KVCache: the per-layer K/V tensor pools, allocated once, and the one way tokens are written in.

Layout per layer (documented in README "KV cache"):

    key_caches[l], value_caches[l]: [num_blocks, num_kv_heads, block_size, head_dim]

Per-head rows of one block are contiguous, which is what a paged decode kernel wants to read.
Two quantized storages (`kv_cache_dtype`), each with its scales beside the pools:

- "int8": int8 codes and a per-token, per-head scale,

      key_scales[l], value_scales[l]: [num_blocks, num_kv_heads, block_size] float16
      x ≈ int8 * scale,  scale = max(|x| over head_dim) / 127

  so one block costs `2 * num_kv_heads * block_size * (head_dim + 2)` bytes per layer instead of
  `2 * num_kv_heads * block_size * head_dim * 2` for fp16.
- "fp8": float8 e4m3 (torch.float8_e4m3fn) codes and one scale per layer and KV head, fixed when the cache
  is made (before any CUDA graph is captured, so graphs read them from a device tensor that never moves):

      key_scales[l], value_scales[l]: [num_kv_heads] float32
      x ≈ float(e4m3) * scale,  e4m3 = saturate(x / scale) to ±448

  A new cache holds FP8_DEFAULT_SCALE (1.0); the engine sets each layer's and KV head's scale from the model's
  own K/V before it captures graphs (core/engine/worker/fp8_calibration.py: amax over a calibration prefill,
  with headroom, / 448), so a head's values use e4m3's normal range (3 mantissa bits) rather than its
  subnormals, and values beyond it saturate at ±448 instead of becoming NaN. One block costs
  `2 * num_kv_heads * block_size * head_dim` bytes per layer.
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP8_DEFAULT_SCALE = 1.0  # until calibrated, and for a head whose calibration values are all zero
QUANTIZATIONS = ("int8", "fp8")  # the kv_cache_dtype values stored as codes with scales
STORAGE_DTYPES = {"int8": torch.int8, "fp8": FP8_DTYPE}


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
        quantized: str | None = None,  # None (storage in `dtype`) or one of QUANTIZATIONS
    ) -> None:
        if quantized is not None and quantized not in QUANTIZATIONS:
            raise ValueError(f"unknown KV cache quantization {quantized!r}; use one of {', '.join(QUANTIZATIONS)}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.quantized = quantized
        storage = STORAGE_DTYPES.get(quantized, dtype)
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        self.key_caches = [torch.zeros(shape, dtype=storage, device=device) for _ in range(num_layers)]
        self.value_caches = [torch.zeros(shape, dtype=storage, device=device) for _ in range(num_layers)]
        self.key_scales: list[torch.Tensor] = []
        self.value_scales: list[torch.Tensor] = []
        if quantized == "int8":
            scale_shape = (num_blocks, num_kv_heads, block_size)
            self.key_scales = [torch.zeros(scale_shape, dtype=torch.float16, device=device) for _ in range(num_layers)]
            self.value_scales = [torch.zeros(scale_shape, dtype=torch.float16, device=device) for _ in range(num_layers)]
        elif quantized == "fp8":
            self.key_scales = [torch.full((num_kv_heads,), FP8_DEFAULT_SCALE, dtype=torch.float32, device=device)
                               for _ in range(num_layers)]
            self.value_scales = [torch.full((num_kv_heads,), FP8_DEFAULT_SCALE, dtype=torch.float32, device=device)
                                 for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, quantized: str | None) -> int:
        """Bytes one block costs across all layers, K and V, scales included (fp8's per-head ones are not a block's)."""
        if quantized == "int8":
            per_token_head = head_dim * 1 + 2  # int8 values + one fp16 scale
        elif quantized == "fp8":
            per_token_head = head_dim * 1
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
            if self.quantized == "fp8":  # as bytes: index_put serves uint8 on every device
                cache[layer].view(torch.uint8)[blocks, :, offsets] = quantize_fp8(x, scales[layer]).view(torch.uint8)
                continue
            q, scale = quantize_int8(x)
            cache[layer][blocks, :, offsets] = q
            scales[layer][blocks, :, offsets] = scale

    def read_blocks(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the given blocks in compute dtype. block_ids: [n] -> two [n, num_kv_heads, block_size, head_dim]."""
        key = self.key_caches[layer][block_ids]
        value = self.value_caches[layer][block_ids]
        if not self.quantized:
            return key, value
        return (key.to(self.dtype) * code_scales(self.key_scales[layer], block_ids).to(self.dtype),
                value.to(self.dtype) * code_scales(self.value_scales[layer], block_ids).to(self.dtype))

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
                gathered = gathered.to(self.dtype) * code_scales(scale_list[layer], block_ids).to(self.dtype)
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


def quantize_fp8(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., KVH, head_dim] over per-head scales [KVH] -> e4m3 codes, saturated at ±FP8_MAX (a plain cast would
    make NaN of anything beyond)."""
    return (x.float() / scales.float().unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def code_scales(scales: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """What multiplies the codes `cache[block_ids]` ([*ids, KVH, bs, D]): an int8 cache's per-token scales
    [num_blocks, KVH, bs] gathered to [*ids, KVH, bs, 1], an fp8 cache's per-head scales [KVH] as [KVH, 1, 1]."""
    if scales.dim() == 1:
        return scales.view(-1, 1, 1)
    return scales[block_ids].unsqueeze(-1)
