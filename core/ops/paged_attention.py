"""Paged attention ops: kernel when one serves the case, torch otherwise.

- paged_decode_attention: one query token per sequence;
- paged_prefill_attention: tiles of consecutive tokens of one sequence, each seeing its causal prefix (a
  graphed step's prefill chunks); its reference is the decode reference applied to every tile token.

The reference gathers each sequence's blocks through the block table, then attends in fp32 with the
same masking as core/attention/torch_backend.py: keys at positions < seq_len, and with a sliding
window W only the last W of them; scores `tanh(s / cap) * cap` with a softcap.
"""

from __future__ import annotations

import torch

from deepinfer.core.ops import dispatch


def paged_decode_attention_reference(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                                     sliding_window: int | None = None, softcap: float | None = None,
                                     key_scales: torch.Tensor | None = None,
                                     value_scales: torch.Tensor | None = None,
                                     max_seq_len: int | None = None) -> torch.Tensor:
    num_seqs, num_heads, head_dim = query.shape
    _, num_kv_heads, block_size, _ = key_cache.shape
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    num_blocks = -(-max_seq_len // block_size)
    blocks = block_tables[:, :num_blocks].long()  # [B, nb]

    def gather(cache: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        x = cache[blocks].float()  # [B, nb, KVH, bs, D]
        if scales is not None:
            x = x * scales[blocks].float().unsqueeze(-1)
        return x.transpose(1, 2).reshape(num_seqs, num_kv_heads, num_blocks * block_size, head_dim)

    keys, values = gather(key_cache, key_scales), gather(value_cache, value_scales)  # [B, KVH, S, D]
    group = num_heads // num_kv_heads
    q = query.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [B, KVH, G, S]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    positions = torch.arange(num_blocks * block_size, device=query.device)  # [S]
    lengths = seq_lens.to(torch.int64)[:, None]  # [B, 1]
    visible = positions[None, :] < lengths
    if sliding_window:
        visible &= positions[None, :] >= lengths - sliding_window
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, values)  # [B, KVH, G, D]
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           sliding_window: int | None = None, softcap: float | None = None,
                           key_scales: torch.Tensor | None = None, value_scales: torch.Tensor | None = None,
                           max_seq_len: int | None = None, out: torch.Tensor | None = None,
                           fresh_tokens: int = 1) -> torch.Tensor:
    """query [B, H, D] -> [B, H, D]. key/value_cache [num_blocks, KVH, block_size, D];
    block_tables [B, max_blocks] int32; seq_lens [B] (context incl. the new token, already cached);
    max_seq_len: a host upper bound of seq_lens (saves a GPU->CPU sync; fixed for CUDA graphs);
    fresh_tokens: at most this many of each sequence's newest positions were cached by the op just before
    (AttentionMetadata.fresh_tokens)."""
    from deepinfer.kernels import registry

    op = registry.get("paged_decode_attention")
    num_kv_heads = key_cache.shape[1]
    key = (query.device, query.dtype, query.shape[1:], key_cache.device, key_cache.dtype, key_cache.shape[1:],
           value_cache.device, block_tables.device, seq_lens.device)
    if dispatch.decide(op.name, key, lambda: dispatch.kernel_blocker(query, key_cache, value_cache, block_tables,
                                                                     seq_lens)
                       or op.unsupported_reason(query, key_cache, num_kv_heads)):
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        return op.launch(query, key_cache, value_cache, block_tables, seq_lens, max_seq_len, scale,
                         sliding_window, softcap, key_scales, value_scales, out=out, fresh_tokens=fresh_tokens)
    result = paged_decode_attention_reference(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                              sliding_window, softcap, key_scales, value_scales, max_seq_len)
    if out is not None:
        out.copy_(result)
        return out
    return result


def paged_prefill_attention_reference(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                      block_tables: torch.Tensor, seq_lens: torch.Tensor, tiles: torch.Tensor,
                                      scale: float, sliding_window: int | None = None, softcap: float | None = None,
                                      out: torch.Tensor | None = None) -> torch.Tensor:
    """paged_prefill_attention's definition: each tile token is a decode query of its own (its seq_lens entry and
    block table row); rows of tokens outside the tiles keep what `out` held."""
    if out is None:
        out = torch.empty_like(query)
    spans = [(int(first), int(count)) for first, count in tiles.tolist() if count > 0]
    if not spans:
        return out
    rows = torch.cat([torch.arange(first, first + count) for first, count in spans]).to(query.device)
    out[rows] = paged_decode_attention_reference(query[rows], key_cache, value_cache, block_tables[rows],
                                                 seq_lens[rows], scale, sliding_window, softcap)
    return out


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, tiles: torch.Tensor, scale: float,
                            sliding_window: int | None = None, softcap: float | None = None,
                            out: torch.Tensor | None = None, max_seq_len: int | None = None) -> torch.Tensor:
    """Attention of prefill tiles (kernels/paged_attention.py paged_prefill_attention): query [T, H, D]; tiles
    [N, 2] int32 (first token row, count; count 0 unused) of consecutive tokens of one sequence; block_tables
    [T, max_blocks] and seq_lens [T] per token; max_seq_len: a host upper bound of seq_lens (fixed for CUDA
    graphs; without it one GPU->CPU sync). Writes the tiles' tokens' rows of `out` [T, H, D]."""
    from deepinfer.kernels import registry

    op = registry.get("paged_prefill_attention")
    num_kv_heads = key_cache.shape[1]
    key = (query.device, query.dtype, query.shape[1:], key_cache.device, key_cache.dtype, key_cache.shape[1:],
           value_cache.device, block_tables.device, seq_lens.device, tiles.device)
    if dispatch.decide(op.name, key, lambda: dispatch.kernel_blocker(query, key_cache, value_cache, block_tables,
                                                                     seq_lens, tiles)
                       or op.unsupported_reason(query, key_cache, num_kv_heads)):
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        return op.launch(query, key_cache, value_cache, block_tables, seq_lens, tiles, max_seq_len, scale,
                         sliding_window, softcap, out=out)
    return paged_prefill_attention_reference(query, key_cache, value_cache, block_tables, seq_lens, tiles, scale,
                                             sliding_window, softcap, out)
