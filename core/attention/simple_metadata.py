"""Build AttentionMetadata from plain per-request chunks, for tests and one-off scripts.

The engine's model runner builds metadata from its SchedulerOutput; this helper does the same
from a list of `SequenceChunk`s, so model and backend tests need no scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.core.attention.metadata import AttentionMetadata


@dataclass
class SequenceChunk:
    block_table: list[int]  # physical blocks of the request, in logical order
    start: int  # tokens of this request already in the cache = position of the first new token
    num_tokens: int  # new tokens this step


def build_attention_metadata(chunks: list[SequenceChunk], block_size: int,
                             device: torch.device | str) -> tuple[AttentionMetadata, torch.Tensor]:
    """-> (metadata, positions [T] int64). Decode chunks (one token) must come first, as the runner orders them."""
    query_lens = [chunk.num_tokens for chunk in chunks]
    seq_lens = [chunk.start + chunk.num_tokens for chunk in chunks]
    num_decodes = 0
    while num_decodes < len(chunks) and query_lens[num_decodes] == 1 and chunks[num_decodes].start > 0:
        num_decodes += 1
    if any(q == 1 and c.start > 0 for q, c in zip(query_lens[num_decodes:], chunks[num_decodes:])):
        raise ValueError("decode chunks (one new token after a cached context) must come first")
    for chunk, seq_len in zip(chunks, seq_lens):
        if len(chunk.block_table) * block_size < seq_len:
            raise ValueError(f"block table of {len(chunk.block_table)} blocks cannot hold {seq_len} tokens")

    positions, slots = [], []
    for chunk in chunks:
        for pos in range(chunk.start, chunk.start + chunk.num_tokens):
            positions.append(pos)
            slots.append(chunk.block_table[pos // block_size] * block_size + pos % block_size)
    max_blocks = max(len(chunk.block_table) for chunk in chunks)
    block_tables = [chunk.block_table + [0] * (max_blocks - len(chunk.block_table)) for chunk in chunks]
    query_start_loc = [0]
    for q in query_lens:
        query_start_loc.append(query_start_loc[-1] + q)

    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(block_tables, dtype=torch.int32, device=device),
        query_lens=query_lens,
        seq_lens_host=seq_lens,
        num_decodes=num_decodes,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return metadata, torch.tensor(positions, dtype=torch.int64, device=device)
