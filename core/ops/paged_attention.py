"""Paged attention ops: kernel when one serves the case, torch otherwise.

- paged_decode_attention: one query token per sequence, on the path core/ops/paged_attention_table.py picks;
- paged_prefill_attention: tiles of consecutive tokens of one sequence, each seeing its causal prefix (a
  graphed step's prefill chunks); its reference is the decode reference applied to every tile token.
The engine asks here, before it builds a model's backend, whether the kernels serve the model at all
(`decode_attention_unavailable_reason`, `prefill_tile_tokens`).

The reference gathers each sequence's blocks through the block table, then attends in fp32 with the
same masking as core/attention/torch_backend.py: keys at positions < seq_len, and with a sliding
window W only the last W of them; scores `tanh(s / cap) * cap` with a softcap.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from deepinfer.core.kv.cache import code_scales
from deepinfer.core.ops import dispatch
from deepinfer.core.ops import paged_attention_table as table
from deepinfer.kernels import paged_attention as kernels
from deepinfer.kernels.launch import clusters_available

DECODE_OP, PREFILL_OP = "paged_decode_attention", "paged_prefill_attention"


class AttentionCase(NamedTuple):
    devices: tuple[torch.device, ...]
    operands: kernels.AttentionOperands


def _decode_reason(case: AttentionCase) -> str | None:
    return kernels.unsupported_reason(case.operands)


def _prefill_reason(case: AttentionCase) -> str | None:
    return kernels.prefill_unsupported_reason(case.operands)


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
            x = x * code_scales(scales, blocks).float()
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
    case = AttentionCase((query.device, key_cache.device, value_cache.device, block_tables.device, seq_lens.device),
                         kernels.attention_operands(query, key_cache))
    if dispatch.decide(DECODE_OP, case, _decode_reason, (query,)):
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        path = decode_path(query.shape[0], case.operands, max_seq_len, query.device.index)
        return kernels.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, max_seq_len, scale,
                                              sliding_window, softcap, key_scales, value_scales, out, path=path,
                                              pipelined=table.decode_pipelined(path, key_cache.dtype != query.dtype),
                                              fresh_tokens=fresh_tokens)
    result = paged_decode_attention_reference(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                              sliding_window, softcap, key_scales, value_scales, max_seq_len)
    if out is not None:
        out.copy_(result)
        return out
    return result


def decode_path(num_seqs: int, operands: kernels.AttentionOperands, max_seq_len: int, device_index: int) -> str:
    """The decode path core/ops/paged_attention_table.py picks for this batch on this device."""
    return table.decode_path(table.DecodeShape(num_seqs, operands.num_heads, operands.num_kv_heads, max_seq_len,
                                               clusters_available(device_index),
                                               kernels.multiprocessors(device_index),
                                               kernels.heads_n_serves(operands)))


def decode_kernel_serves(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether paged_decode_attention runs its kernel for a query [T, H, D] and cache like these (decided and
    logged once per case, as the op itself does)."""
    case = AttentionCase((query.device, key_cache.device), kernels.attention_operands(query, key_cache))
    return dispatch.decide(DECODE_OP, case, _decode_reason, (query,))


def decode_attention_unavailable_reason(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                                        head_dim: int, kv_dtype: torch.dtype, block_size: int) -> str | None:
    """Why the decode kernel cannot serve a model of these dimensions on `device` (None when it can)."""
    return dispatch.kernel_blocker((device,)) or kernels.unsupported_reason(
        kernels.AttentionOperands(dtype, num_heads, num_kv_heads, head_dim, kv_dtype, block_size))


def prefill_tile_tokens(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                        kv_dtype: torch.dtype, block_size: int) -> int | None:
    """Query tokens a tile of paged_prefill_attention holds where that kernel serves a model of these dimensions on
    `device` (head_dim 64 or 128, at most 16 query heads a KV head; any KV cache dtype the decode kernel reads);
    else None, and graphed steps
    attend every token on the decode kernel. The reason is logged once."""
    reason = dispatch.kernel_blocker((device,)) or kernels.prefill_unsupported_reason(
        kernels.AttentionOperands(dtype, num_heads, num_kv_heads, head_dim, kv_dtype, block_size))
    if not dispatch.use_kernel(PREFILL_OP, reason, fallback="the decode kernel per token"):
        return None
    return kernels.prefill_tile_tokens(num_heads, num_kv_heads)


def paged_prefill_attention_reference(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                      block_tables: torch.Tensor, seq_lens: torch.Tensor, tiles: torch.Tensor,
                                      scale: float, sliding_window: int | None = None, softcap: float | None = None,
                                      key_scales: torch.Tensor | None = None, value_scales: torch.Tensor | None = None,
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
                                                 seq_lens[rows], scale, sliding_window, softcap, key_scales,
                                                 value_scales).to(out.dtype)
    return out


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, tiles: torch.Tensor, scale: float,
                            sliding_window: int | None = None, softcap: float | None = None,
                            key_scales: torch.Tensor | None = None, value_scales: torch.Tensor | None = None,
                            out: torch.Tensor | None = None, max_seq_len: int | None = None) -> torch.Tensor:
    """Attention of prefill tiles (kernels/paged_attention.py paged_prefill_attention): query [T, H, D]; tiles
    [N, 2] int32 (first token row, count; count 0 unused) of consecutive tokens of one sequence; block_tables
    [T, max_blocks] and seq_lens [T] per token; key/value_scales: an int8 or e4m3 cache's, as paged_decode_attention
    takes them; max_seq_len: a host upper bound of seq_lens (fixed for CUDA graphs; without it one GPU->CPU sync).
    Writes the tiles' tokens' rows of `out` [T, H, D]."""
    case = AttentionCase((query.device, key_cache.device, value_cache.device, block_tables.device, seq_lens.device,
                          tiles.device), kernels.attention_operands(query, key_cache))
    if dispatch.decide(PREFILL_OP, case, _prefill_reason, (query,)):
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        return kernels.paged_prefill_attention(query, key_cache, value_cache, block_tables, seq_lens, tiles,
                                               max_seq_len, scale, sliding_window, softcap, key_scales, value_scales,
                                               out=out)
    return paged_prefill_attention_reference(query, key_cache, value_cache, block_tables, seq_lens, tiles, scale,
                                             sliding_window, softcap, key_scales, value_scales, out)
