"""TorchPagedAttention: the reference attention backend (gather blocks + SDPA), any device, any dtype.

For one flat batch it first writes the step's new K/V into the paged cache (unless the caller
already did, `kv_written=True`: the decoder's fused RoPE + cache-write op), then attends each
request's queries over its cached context. Requests are processed in two padded groups (the
decodes, query length 1, then the prefill chunks), each vectorized across its requests, so a
big decode batch is one SDPA call and a long prefill chunk does not pad every decode to its length.

Masking is by absolute position: a query at position p sees keys k with k <= p, and with a
sliding window W also k > p - W (HF's `sliding_window_overlay`, the same for Mistral, Qwen2
and Gemma 2). Keys beyond a request's length sit in padded or not-yet-written slots and are
always excluded by the causal test, because p < seq_len. On the CPU, a group whose prompts all start at
position 0 (and no window or softcap applies) takes SDPA's own causal mask instead. With a softcap (Gemma 2) scores are
`tanh(s / cap) * cap` before the mask, computed explicitly as HF's eager path does.

Index tensors that depend only on the step (which rows, which blocks, which positions) are built
once per step from the metadata's device tensors, with shapes from its host lists, and reused by
every layer: no GPU->CPU sync and no host->device copy happens here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from deepinfer.core.attention.metadata import AttentionMetadata

# cuDNN's SDPA builds an execution plan, on the host, for every new shape, and prefill chunks change
# shape every step, so every layer of every such step would pay for a plan. The other backends serve
# masked attention without that cost.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class _RequestGroup:
    """Requests [first, last) of the step, padded to `max_query_len` queries and `num_blocks` blocks."""

    token_start: int
    token_end: int
    max_query_len: int
    num_blocks: int
    query_index: torch.Tensor  # [R, Qmax] int64: row of each padded query in the group's token slice
    query_positions: torch.Tensor  # [R, Qmax] int64: absolute position of each query
    query_valid: torch.Tensor  # [R, Qmax] bool: False for padding rows
    unpad_index: torch.Tensor  # [Tg] int64: for each token of the slice, its row in the flat R * Qmax
    block_ids: torch.Tensor  # [R * num_blocks] int: the requests' blocks, request-major
    # every request's queries start at position 0 (a prompt's first chunk): query i of each sees keys 0..i,
    # which is SDPA's own causal mask (top-left aligned)
    starts_at_zero: bool = False
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # window -> [R, 1, Qmax, S] bool


class TorchPagedAttention:
    name = "torch"

    def __init__(self) -> None:
        self._step_metadata: AttentionMetadata | None = None
        self._groups: list[_RequestGroup] = []

    def forward(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_metadata: AttentionMetadata, kv_cache, scale: float, sliding_window: int | None,
                softcap: float | None, kv_written: bool = False) -> torch.Tensor:
        """query [T, H, D], key/value [T, KVH, D] -> attention output [T, H, D].

        kv_written: the step's K/V are already in the cache at slot_mapping (key/value are then unused)."""
        if not kv_written:
            kv_cache.write(layer_idx, key, value, attn_metadata.slot_mapping)
        if self._step_metadata is not attn_metadata:
            self._groups = _build_groups(attn_metadata, kv_cache.block_size, query.device)
            self._step_metadata = attn_metadata
        outputs = [self._attend_group(group, layer_idx, query[group.token_start:group.token_end], kv_cache, scale,
                                      sliding_window, softcap) for group in self._groups]
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)  # groups are consecutive token slices

    @staticmethod
    def _attend_group(group: _RequestGroup, layer_idx: int, query: torch.Tensor, kv_cache, scale: float,
                      sliding_window: int | None, softcap: float | None) -> torch.Tensor:
        num_requests, max_query_len = group.query_index.shape
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads, block_size = kv_cache.num_kv_heads, kv_cache.block_size
        group_size = num_heads // num_kv_heads
        num_keys = group.num_blocks * block_size

        # Queries of one KV head's group share its keys: [R, KVH, G * Qmax, D], no K/V repeat.
        padded = query[group.query_index]  # [R, Qmax, H, D]
        padded = padded.view(num_requests, max_query_len, num_kv_heads, group_size, head_dim)
        padded = padded.permute(0, 2, 3, 1, 4).reshape(num_requests, num_kv_heads, group_size * max_query_len, head_dim)

        if query.device.type == "cpu":  # index_select gathers whole blocks (read_context)
            keys, values = kv_cache.read_context(layer_idx, group.block_ids, num_requests)  # [R, KVH, S, D]
        else:
            keys, values = kv_cache.read_blocks(layer_idx, group.block_ids)  # [R * nb, KVH, bs, D]
            keys = keys.view(num_requests, group.num_blocks, num_kv_heads, block_size, head_dim)
            keys = keys.transpose(1, 2).reshape(num_requests, num_kv_heads, num_keys, head_dim)
            values = values.view(num_requests, group.num_blocks, num_kv_heads, block_size, head_dim)
            values = values.transpose(1, 2).reshape(num_requests, num_kv_heads, num_keys, head_dim)
        keys, values = keys.to(query.dtype), values.to(query.dtype)

        if (group.starts_at_zero and query.device.type == "cpu" and softcap is None
                and (sliding_window is None or sliding_window >= num_keys)):
            return _attend_causal(group, query, keys, values, scale)
        mask = group.masks.get(sliding_window)
        if mask is None:
            mask = _build_mask(group, num_keys, sliding_window)
            group.masks[sliding_window] = mask
        mask = mask.expand(num_requests, group_size, max_query_len, num_keys)
        mask = mask.reshape(num_requests, 1, group_size * max_query_len, num_keys)

        if softcap is None:
            with sdpa_kernel(_SDPA_BACKENDS):
                out = F.scaled_dot_product_attention(padded, keys, values, attn_mask=mask, scale=scale)
        else:
            scores = torch.matmul(padded, keys.transpose(-1, -2)) * scale  # [R, KVH, G*Qmax, S]
            scores = torch.tanh(scores / softcap) * softcap
            scores = scores.masked_fill(~mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
            out = torch.matmul(probs, values)  # [R, KVH, G*Qmax, D]

        out = out.view(num_requests, num_kv_heads, group_size, max_query_len, head_dim)
        out = out.permute(0, 3, 1, 2, 4).reshape(num_requests * max_query_len, num_heads, head_dim)
        return out[group.unpad_index]  # [Tg, H, D]


def _attend_causal(group: _RequestGroup, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """A group of first chunks on the CPU: SDPA's causal mask (its flash kernel skips the masked key blocks
    instead of reading a [Qmax, S] mask per head) and its GQA (no K/V repeat). keys/values [R, KVH, S, D]."""
    num_requests, max_query_len = group.query_index.shape
    num_heads, head_dim = query.shape[1], query.shape[2]
    padded = query[group.query_index].transpose(1, 2)  # [R, H, Qmax, D]
    with sdpa_kernel(_SDPA_BACKENDS):
        out = F.scaled_dot_product_attention(padded, keys, values, is_causal=True, scale=scale,
                                             enable_gqa=num_heads != keys.shape[1])
    out = out.transpose(1, 2).reshape(num_requests * max_query_len, num_heads, head_dim)
    return out[group.unpad_index]  # [Tg, H, D]


def _build_mask(group: _RequestGroup, num_keys: int, sliding_window: int | None) -> torch.Tensor:
    """[R, 1, Qmax, S] bool, True = attend. Padding query rows see every key (finite, then dropped)."""
    key_positions = torch.arange(num_keys, device=group.query_positions.device)  # [S]
    query_positions = group.query_positions[:, :, None]  # [R, Qmax, 1]
    mask = key_positions <= query_positions
    if sliding_window is not None:
        mask &= key_positions > query_positions - sliding_window
    mask |= ~group.query_valid[:, :, None]
    return mask.unsqueeze(1)


def _build_groups(meta: AttentionMetadata, block_size: int, device: torch.device) -> list[_RequestGroup]:
    groups = []
    token_start = sum(meta.query_lens[:meta.num_decodes])
    for first, last, start in ((0, meta.num_decodes, 0), (meta.num_decodes, meta.num_requests, token_start)):
        if first < last:
            groups.append(_build_group(meta, first, last, start, block_size, device))
    return groups


def _build_group(meta: AttentionMetadata, first: int, last: int, token_start: int, block_size: int,
                 device: torch.device) -> _RequestGroup:
    # Shapes come from the host lists; values from the metadata's device tensors (no copy, no sync).
    num_requests = last - first
    num_tokens = sum(meta.query_lens[first:last])
    max_query_len = max(meta.query_lens[first:last])
    num_blocks = (max(meta.seq_lens_host[first:last]) + block_size - 1) // block_size

    starts = meta.query_start_loc[first:last + 1].to(torch.int64)  # [R + 1]
    query_lens = starts[1:] - starts[:-1]  # [R]
    offsets = starts[:-1] - starts[0]  # [R]: first token of each request within the group's slice
    seq_lens = meta.seq_lens[first:last].to(torch.int64)  # [R]
    steps = torch.arange(max_query_len, device=device)  # [Qmax]
    request_of_token = torch.repeat_interleave(
        torch.arange(num_requests, device=device), query_lens, output_size=num_tokens)  # [Tg]

    return _RequestGroup(
        token_start=token_start,
        token_end=token_start + num_tokens,
        max_query_len=max_query_len,
        num_blocks=num_blocks,
        query_index=(offsets[:, None] + steps[None, :]).clamp(max=num_tokens - 1),
        query_positions=(seq_lens - query_lens)[:, None] + steps[None, :],
        query_valid=steps[None, :] < query_lens[:, None],
        unpad_index=request_of_token * max_query_len + torch.arange(num_tokens, device=device)
        - offsets[request_of_token],
        block_ids=meta.block_tables[first:last, :num_blocks].reshape(-1).to(torch.int64),
        starts_at_zero=meta.seq_lens_host[first:last] == meta.query_lens[first:last],
    )
