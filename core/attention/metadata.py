"""AttentionMetadata: what every attention layer of one forward step reads.

The model runner builds it once per step from the SchedulerOutput; the layers only read it
(one shared, read-only block table per step, never one per layer: rebuilding it per layer would
repeat the host-to-device copy once for every layer).

The step's tokens are one flat batch of `T` tokens from `B` requests. The runner orders the
requests so that the `num_decodes` decode requests (exactly one new token each) come first,
then the prefill chunks; request `i` owns query rows `query_start_loc[i]:query_start_loc[i+1]`.

KV cache layout (per layer, see core/kv/cache.py): `[num_blocks, num_kv_heads, block_size, head_dim]`.
A token at absolute position `p` of request `i` lives in physical block
`block_tables[i, p // block_size]` at offset `p % block_size`; its flat slot is
`block * block_size + offset`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    # Device tensors, built once per step.
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot each new token's K/V is written to
    query_start_loc: torch.Tensor  # [B + 1] int32: prefix sums of query lengths
    seq_lens: torch.Tensor  # [B] int32: context length of each request after this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, padded with 0

    # Host copies of the same numbers, so shapes are known without a GPU->CPU sync.
    query_lens: list[int]
    seq_lens_host: list[int]
    num_decodes: int  # requests [0, num_decodes) have query length 1
    max_query_len: int
    max_seq_len: int
    # At most this many of a request's newest context positions get their K/V written in this step: 1 when
    # the decode rows are true decodes; a graphed step, where each token of a prefill chunk is a row of its
    # own, sets its token bucket. The decode kernel reads the older positions before the step's cache write.
    fresh_tokens: int = 1
    # A graphed step whose prefill chunks attend in tiles (core/engine/worker/cuda_graphs.py): prefill_tiles [N, 2] int32
    # (first token row, count; count 0 unused) for paged_prefill_attention, and decode_seq_lens [R] int32, the
    # lengths the decode kernel attends its first R rows with (the step's decodes): seq_lens with 0 for the tiles'
    # tokens among them, whose rows the tiles then write.
    prefill_tiles: torch.Tensor | None = None
    decode_seq_lens: torch.Tensor | None = None

    @property
    def num_requests(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens))

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes

    @property
    def is_pure_decode(self) -> bool:
        return self.num_decodes == self.num_requests
