"""What rank 0 sends the other ranks before each thing they compute together, over torch.distributed broadcasts.

Every message starts with a header, int64 [HEADER_LEN] on the host (preallocated on every rank), over the
control group (gloo), then the tensors it announces, on the ranks' devices over the default group:
- FORWARD: one step's token rows and attention metadata, in one int64 payload: input ids [T], positions [T],
  slot mapping [T], query_start_loc [B + 1], seq_lens [B], block tables [B, M] (the same on every rank: one
  scheduler allocates the blocks; each rank's cache holds its own KV heads of them).
- LOGITS: the hidden rows [N, hidden] to score (the engine's sampling rows, or a prompt's positions).
- CACHE: a KV pool of `num_blocks` blocks replaces the rank's pool (the engine's start-up makes scratch pools
  for its measurements, then the real one).
- STOP: the engine is closing.
The other ranks wait for a header without a time limit (an engine may idle for hours); everything after a
header has the group's collective timeout.
"""

from __future__ import annotations

import itertools
from datetime import timedelta

import torch
import torch.distributed as dist

from deepinfer.core.attention.metadata import AttentionMetadata

STOP, FORWARD, LOGITS, CACHE = 0, 1, 2, 3
HEADER_LEN = 10
IDLE_WAIT = timedelta(days=365)  # how long a rank waits for rank 0's next message
# header fields: kind, then
_T, _B, _M, _DECODES, _MAX_QUERY, _MAX_SEQ, _FRESH = range(1, 8)  # FORWARD
_ROWS = 1  # LOGITS: N
_BLOCKS = 1  # CACHE: num_blocks


class StepChannel:
    """Rank 0's sending side and the other ranks' receiving side of the messages; tensors on `device`."""

    def __init__(self, device: torch.device, control_group) -> None:
        self.device = device
        self.control_group = control_group if control_group is not None else dist.group.WORLD
        self.header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        # Grown to the largest step sent so far and reused, so a steady stream of steps allocates nothing.
        self._payload = torch.empty(0, dtype=torch.int64, device=device)
        self._hidden: torch.Tensor | None = None

    def _payload_view(self, size: int) -> torch.Tensor:
        if self._payload.numel() < size:
            self._payload = torch.empty(max(size, 2 * self._payload.numel()), dtype=torch.int64, device=self.device)
        return self._payload[:size]

    def _send_header(self, kind: int, *fields: int) -> None:
        self.header.copy_(torch.tensor([kind, *fields] + [0] * (HEADER_LEN - 1 - len(fields)), dtype=torch.int64))
        dist.broadcast(self.header, 0, group=self.control_group)

    def receive_header(self) -> list[int]:
        """The next message's header, however long rank 0 takes to send it."""
        options = dist.BroadcastOptions()
        options.rootRank, options.timeout = 0, IDLE_WAIT
        self.control_group.broadcast([self.header], options).wait()
        return self.header.tolist()

    # rank 0 ----------------------------------------------------------------------------------------------------

    def send_stop(self) -> None:
        self._send_header(STOP)

    def send_cache(self, num_blocks: int) -> None:
        self._send_header(CACHE, num_blocks)

    def send_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        if meta.prefill_tiles is not None or meta.decode_seq_lens is not None:
            raise ValueError("tensor-parallel steps run eagerly: a graphed step's tiles are not sent")
        tokens, requests = input_ids.shape[0], meta.seq_lens.shape[0]
        self._send_header(FORWARD, tokens, requests, meta.block_tables.shape[1], meta.num_decodes,
                          meta.max_query_len, meta.max_seq_len, meta.fresh_tokens)
        parts = [input_ids[:tokens], positions[:tokens], meta.slot_mapping[:tokens], meta.query_start_loc,
                 meta.seq_lens, meta.block_tables.reshape(-1)]
        payload = self._payload_view(sum(part.numel() for part in parts))
        torch.cat([part.to(torch.int64) for part in parts], out=payload)
        dist.broadcast(payload, 0)

    def send_logits(self, hidden: torch.Tensor) -> None:
        self._send_header(LOGITS, hidden.shape[0])
        dist.broadcast(hidden.contiguous(), 0)

    # other ranks -----------------------------------------------------------------------------------------------

    def receive_forward(self, header: list[int]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        tokens, requests, max_blocks = header[_T], header[_B], header[_M]
        sizes = [tokens, tokens, tokens, requests + 1, requests, requests * max_blocks]
        payload = self._payload_view(sum(sizes))
        dist.broadcast(payload, 0)
        input_ids, positions, slots, starts, seq_lens, tables = payload.split(sizes)
        starts_host, seq_lens_host = starts.tolist(), seq_lens.tolist()
        meta = AttentionMetadata(
            slot_mapping=slots, query_start_loc=starts.to(torch.int32), seq_lens=seq_lens.to(torch.int32),
            block_tables=tables.to(torch.int32).view(requests, max_blocks),
            query_lens=[b - a for a, b in itertools.pairwise(starts_host)], seq_lens_host=seq_lens_host,
            num_decodes=header[_DECODES], max_query_len=header[_MAX_QUERY], max_seq_len=header[_MAX_SEQ],
            fresh_tokens=header[_FRESH])
        return input_ids, positions, meta

    def receive_logits(self, header: list[int], hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
        rows = header[_ROWS]
        if self._hidden is None or self._hidden.shape[0] < rows:
            self._hidden = torch.empty(max(rows, 2 * (0 if self._hidden is None else self._hidden.shape[0])),
                                       hidden_size, dtype=dtype, device=self.device)
        hidden = self._hidden[:rows]
        dist.broadcast(hidden, 0)
        return hidden


def cache_blocks(header: list[int]) -> int:
    return header[_BLOCKS]
