"""NativePagedAttention: the paged attention backend that runs decodes on the CUDA kernel.

Same interface as TorchPagedAttention. The runner puts the `num_decodes` decode requests (one new
token each) first in the flat batch: their K/V are written by the cache-write kernel and they attend
with the paged decode kernel, which reads the block table directly (no gather, no padding). The
prefill chunks after them go through the torch reference on a metadata view of just those requests,
which also writes their K/V. A graphed step (every token a decode row) may carry prefill tiles: its chunks'
tokens then attend on the prefill kernel, tile by tile, and the decode kernel skips them (length 0).
With `kv_written=True` (the decoder's fused RoPE + cache-write op
already stored the step's K/V) neither path writes. When the kernel cannot serve the step (CPU, fp32, head_dim, forced
reference) the whole step runs on the reference, and core/ops logs why once.
"""

from __future__ import annotations

import torch

from deepinfer.core.attention.metadata import AttentionMetadata
from deepinfer.core.attention.torch_backend import TorchPagedAttention
from deepinfer.core.ops.paged_attention import (
    decode_kernel_serves,
    paged_decode_attention,
    paged_prefill_attention,
)
from deepinfer.core.ops.rotary import write_kv_cache


class NativePagedAttention:
    name = "native"

    def __init__(self) -> None:
        self._reference = TorchPagedAttention()
        self._step_metadata: AttentionMetadata | None = None
        self._prefill_metadata: AttentionMetadata | None = None

    def forward(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_metadata: AttentionMetadata, kv_cache, scale: float, sliding_window: int | None,
                softcap: float | None, kv_written: bool = False) -> torch.Tensor:
        """query [T, H, D], key/value [T, KVH, D] -> attention output [T, H, D].

        kv_written: the step's K/V are already in the cache at slot_mapping (key/value are then unused)."""
        num_decodes = attn_metadata.num_decodes
        key_cache, value_cache = kv_cache.key_caches[layer_idx], kv_cache.value_caches[layer_idx]
        if num_decodes == 0 or not decode_kernel_serves(query, key_cache):
            return self._reference.forward(layer_idx, query, key, value, attn_metadata, kv_cache, scale,
                                           sliding_window, softcap, kv_written)
        key_scales = kv_cache.key_scales[layer_idx] if kv_cache.quantized else None
        value_scales = kv_cache.value_scales[layer_idx] if kv_cache.quantized else None
        out = torch.empty_like(query)
        if not kv_written:
            write_kv_cache(key[:num_decodes], value[:num_decodes], key_cache, value_cache,
                           attn_metadata.slot_mapping[:num_decodes], key_scales, value_scales)
        tiles = attn_metadata.prefill_tiles
        # With tiles the decode kernel takes the first len(decode_seq_lens) rows, which hold the step's decodes.
        rows = num_decodes if tiles is None else attn_metadata.decode_seq_lens.shape[0]
        decode_lens = attn_metadata.seq_lens if tiles is None else attn_metadata.decode_seq_lens
        paged_decode_attention(query[:rows], key_cache, value_cache, attn_metadata.block_tables[:rows],
                               decode_lens[:rows], scale, sliding_window, softcap, key_scales,
                               value_scales, max_seq_len=max(attn_metadata.seq_lens_host[:rows]),
                               out=out[:rows], fresh_tokens=attn_metadata.fresh_tokens)
        if tiles is not None:  # a graphed step: every token is a row; the tiles write their tokens' rows
            paged_prefill_attention(query, key_cache, value_cache, attn_metadata.block_tables, attn_metadata.seq_lens,
                                    tiles, scale, sliding_window, softcap, key_scales, value_scales, out=out,
                                    max_seq_len=attn_metadata.max_seq_len)
        if num_decodes < attn_metadata.num_requests:
            out[num_decodes:] = self._reference.forward(
                layer_idx, query[num_decodes:], key[num_decodes:], value[num_decodes:],
                self._prefills_of(attn_metadata), kv_cache, scale, sliding_window, softcap, kv_written)
        return out

    def _prefills_of(self, meta: AttentionMetadata) -> AttentionMetadata:
        """The step's metadata restricted to its prefill requests; built once per step, shared by all layers."""
        if self._step_metadata is not meta:
            first = meta.num_decodes  # decodes have one token each, so they own the first `first` tokens
            self._prefill_metadata = AttentionMetadata(
                slot_mapping=meta.slot_mapping[first:],
                query_start_loc=meta.query_start_loc[first:] - first,
                seq_lens=meta.seq_lens[first:],
                block_tables=meta.block_tables[first:],
                query_lens=meta.query_lens[first:],
                seq_lens_host=meta.seq_lens_host[first:],
                num_decodes=0,
                max_query_len=max(meta.query_lens[first:]),
                max_seq_len=max(meta.seq_lens_host[first:]),
            )
            self._step_metadata = meta
        return self._prefill_metadata
