"""Step inputs: the one stager of every step the model runner launches, eager or padded.

A step's chunks become token rows (input id, position, KV slot of each token) and request rows (a
block table each, the row whose hidden state is sampled). `StepStager` writes them in one pass into
one pinned host buffer (numpy views for fast filling, allocated once at the largest step) and moves
what a step staged to the device in one non-blocking copy, then fills the pending input tokens on
the device. The buffer holds a step's int64 values, then its int32 values (from a 64-byte boundary,
`int32_offset`), then the fill of its pending tokens:

    int64 [0:t]  input ids   [t:2t]  positions   [2t:3t]  slot mapping   [3t:3t+s]  logit rows
    int32 the attention metadata, in one of two layouts (below)
    int64 [2k]  (*) the fill of k pending tokens

The int32 layouts:
- per request (`stage_requests`: eager steps, and `build_attention_metadata` for tests): decodes
  first, as AttentionMetadata expects; query_start_loc [B + 1], seq_lens [B], block_tables [B, W]
  (W: the step's longest table), logit rows for the sampling chunks only; fresh device tensors.
- per token (padded steps, the static buffers of core/engine/worker/cuda_graphs.py, which stage through
  `begin` / `stage_chunks` / `send`): every token its own query, padded to a bucket.

Pending tokens (async scheduling): a chunk whose `last_token_pending` is set takes as its last input
the token the step in flight (`previous`, core/engine/worker/inflight.py) samples, which is on the device
only. Its row is staged as 0, the (input row, sampled row) pairs go into the staging after the
step's other values, so the same copy moves them, and `fill_pending_tokens` scatters the sampled
tokens into the input ids on the same stream, before the forward or graph replay reads them (outside
any graph, so graphs replay unchanged). In a steady decode step (every chunk a decode of a pending token,
the requests the step in flight sampled, in its order) token row i takes its sampled row i: no pairs
are staged, and when the step in flight's sampler wrote its tokens straight into the static input ids
(a padded step, `ModelRunner.launch`) they are already in place and the copy starts after them.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import compress
from operator import attrgetter
from typing import NamedTuple

import numpy as np
import torch

from deepinfer.core.attention.metadata import AttentionMetadata
from deepinfer.core.engine.sampling_params import SamplingParams
from deepinfer.core.engine.sched.request import Request
from deepinfer.core.engine.sched.scheduler_output import ScheduledChunk
from deepinfer.core.engine.worker.inflight import InflightStep
from deepinfer.core.kv.kv_manager import cdiv

# Per-chunk fields read in C (map) rather than in a Python loop: these run once per chunk every step.
_num_tokens, _start_pos, _table_row = attrgetter("num_tokens"), attrgetter("start_pos"), attrgetter("table_row")
_last_token_pending, _request_id = attrgetter("last_token_pending"), attrgetter("request.request_id")
_request = attrgetter("request")


class StagedChunks(NamedTuple):
    """What `StepStager.stage_chunks` staged, in placed order."""

    pending_rows: np.ndarray  # [k] int64 the token row of each pending input token
    pending_ids: list[str]  # the request of each
    lengths: np.ndarray  # [R] int64 token rows of each chunk
    ends: np.ndarray  # [R] int64 cumulative sum of lengths: chunk i's rows end before ends[i]
    pending_in_order: bool = False  # the k pending tokens are token rows 0..k-1 (a steady decode step)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [N] int64: hidden rows whose logits are sampled
    sampling_chunks: list[ScheduledChunk]  # [N], the requests of those rows, same order


# The int32 values of a step start on this boundary (bytes), so kernels that read them (block tables, lengths)
# see the alignment a tensor of their own would have, whatever the int64 values before them.
INT32_ALIGNMENT = 64


def int32_offset(num_int64: int) -> int:
    """Byte offset of a step's int32 staging, after its `num_int64` int64 values."""
    return -(-8 * num_int64 // INT32_ALIGNMENT) * INT32_ALIGNMENT


def typed(buffer: torch.Tensor, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """`count` values of `dtype` at byte `offset` of the uint8 `buffer` (a view)."""
    return buffer[offset:offset + count * dtype.itemsize].view(dtype)


class StepStager:
    """Host staging for steps of up to `max_tokens` tokens and `max_rows` requests, `int32_size`
    int32 values of metadata, copied to `device`."""

    def __init__(self, max_tokens: int, max_rows: int, int32_size: int, block_size: int,
                 device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        pin = device.type == "cuda"
        # int64: 3 per token, a logit row per request, then after the int32 values the fill (2 per request).
        self.nbytes = -(-(int32_offset(3 * max_tokens + max_rows) + 4 * int32_size) // 8) * 8 + 16 * max_rows
        self.host = torch.zeros(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        raw = self.host.numpy()
        self.h64, self.h32 = raw.view(np.int64), raw.view(np.int32)  # [nbytes / 8], [nbytes / 4]
        # Set after each step's copy: the staging is refilled only once it has been read (a step that
        # samples nothing has no sync that would order it before the next fill).
        self._copied = torch.cuda.Event() if pin else None
        # A decode-only step's lengths (all 1) and ends (1..R) are views of these, read-only: no array a step.
        rows = max(max_tokens, max_rows)
        self.ones, self.counting = np.ones(rows, dtype=np.int64), np.arange(1, rows + 1, dtype=np.int64)
        self.ones.flags.writeable = self.counting.flags.writeable = False
        # The last staged chunks' requests and their ids: a step of the same requests in the same order (steady
        # decoding) reuses the list of ids instead of reading one per chunk (a request's id never changes).
        self._requests: list[Request] = []
        self._request_ids: list[str] = []

    # The phases of a step: begin, stage_chunks (and the layout's own metadata), send. ----------------

    def begin(self) -> None:
        """Wait until the last step's copies have read the staging."""
        if self._copied is not None:
            self._copied.synchronize()

    def token_rows(self, tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(input ids, positions, slot mapping) staging of a step of `tokens` token rows."""
        h64 = self.h64
        return h64[:tokens], h64[tokens:2 * tokens], h64[2 * tokens:3 * tokens]

    def int32_staging(self, num_int64: int) -> np.ndarray:
        """The int32 staging of a step of `num_int64` int64 values (3 per token, a logit row per request)."""
        return self.h32[int32_offset(num_int64) // 4:]

    def stage_chunks(self, chunks: list[ScheduledChunk], tokens: int, tables: np.ndarray,
                     block_tables: np.ndarray | None = None, request_rows: list[int] | None = None) -> StagedChunks:
        """Write the chunks' tokens as consecutive token rows in the order given and the first
        cdiv(seq_len, block_size) entries of each chunk's block table into `tables[request row]` (a view of
        the int32 staging, zeroed by the caller); chunk i's request row is `request_rows[i]`, i when None.
        `block_tables`: the step's SchedulerOutput.block_tables, where each chunk's `table_row` is (a
        scheduled chunk's table ends at its context, and the array is zero past it); None, or a chunk
        without a row: the chunks' `block_table` lists. Vectorized over the step: per chunk only a few
        fields are read, by `map` (in C), and a steady decode step (every chunk one pending token) reads
        no token at all."""
        bs = self.block_size
        ids, positions, slots = self.token_rows(tokens)
        if not chunks:
            empty = np.zeros(0, dtype=np.int64)
            return StagedChunks(empty, [], empty, empty)
        length_list = list(map(_num_tokens, chunks))
        count = sum(length_list)
        decode_only = count == len(chunks)
        starts = np.fromiter(map(_start_pos, chunks), np.int64, len(chunks))
        source_rows = None if block_tables is None else _table_rows(chunks)
        if source_rows is None:  # chunks built by hand: their tables may run on
            source, source_rows = _table_array([chunk.block_table for chunk in chunks]), np.arange(len(chunks))
            used = (starts + np.array(length_list) + bs - 1) // bs  # [R] blocks each chunk's context spans
            source[np.arange(source.shape[1]) >= used[:, None]] = 0
        else:
            source = block_tables
        width = min(tables.shape[1], source.shape[1])
        if request_rows is None:  # in order: a slice, no index array
            tables[:len(chunks), :width] = source[source_rows, :width]
        else:
            tables[request_rows, :width] = source[source_rows, :width]
        if decode_only:  # one token each, at its start position
            lengths, ends = self.ones[:count], self.counting[:count]
            span, token_rows = starts, source_rows
        else:
            lengths = np.array(length_list, dtype=np.int64)
            ends = np.cumsum(lengths)
            # Token t of chunk i sits at position start_i + (t - first_i), first_i = ends_i - lengths_i.
            span = np.arange(count, dtype=np.int64) + np.repeat(starts - (ends - lengths), lengths)
            token_rows = np.repeat(source_rows, lengths)
        positions[:count] = span
        np.multiply(source[token_rows, span // bs], bs, out=slots[:count], dtype=np.int64)  # block * size + offset
        slots[:count] += span % bs
        pending_flags = list(map(_last_token_pending, chunks))
        if decode_only and all(pending_flags):  # steady decoding (async scheduling): every input is pending
            ids[:count] = 0
            return StagedChunks(ends - 1, self._ids_of(chunks), lengths, ends, pending_in_order=True)
        ends_list = ends.tolist()
        # A decode's one input is a known token or a pending one (staged as 0).
        decodes = chunks if decode_only else [chunk for chunk in chunks if chunk.num_tokens == 1]
        decode_ids = [0 if chunk.last_token_pending else chunk.request.all_token_ids[chunk.start_pos]
                      for chunk in decodes]
        if decode_only:
            ids[:count] = decode_ids
        else:
            ids[[end - 1 for chunk, end in zip(chunks, ends_list) if chunk.num_tokens == 1]] = decode_ids
            for chunk, end in zip(chunks, ends_list):
                if chunk.num_tokens > 1:
                    known = chunk.token_ids
                    first = end - chunk.num_tokens
                    ids[first:first + len(known)] = known
                    ids[first + len(known):end] = 0
        pending = list(compress(range(len(chunks)), pending_flags))
        return StagedChunks(ends[pending] - 1, [chunks[i].request.request_id for i in pending], lengths, ends)

    def _ids_of(self, chunks: list[ScheduledChunk]) -> list[str]:
        """The chunks' request ids: the last call's list while the requests are the same, in the same order."""
        requests = list(map(_request, chunks))
        if requests != self._requests:  # identity first: equal lists of the same objects
            self._requests, self._request_ids = requests, list(map(_request_id, chunks))
        return self._request_ids

    def send(self, tokens: int, rows: int, num_int32: int, staged: StagedChunks,
             previous: InflightStep | None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Stage the pending tokens' fill, copy the staging of `tokens` token rows, `rows` logit rows and
        `num_int32` int32 values to the device in one copy (into `out`, the padded runner's static uint8
        buffer, or a fresh one), then fill the pending tokens there. -> the device uint8 buffer, holding
        the staged values at their staging offsets."""
        num_int64 = 3 * tokens + rows
        fill_at = -(-(int32_offset(num_int64) + 4 * num_int32) // 8)  # int64 index of the fill
        # Steady decoding: token row i takes row i of the step in flight's tokens.
        in_order = (staged.pending_in_order and previous is not None
                    and previous.samples_in_order(staged.pending_ids))
        num_fill = 0 if in_order else _stage_fill(self.h64[fill_at:], staged, previous)
        nbytes = 8 * (fill_at + num_fill)
        sampled = previous.sampled.sampled if previous is not None and staged.pending_ids else None
        # Where the step in flight sampled into `out`'s input ids, the copy would overwrite its tokens.
        aliased = sampled is not None and out is not None and sampled.data_ptr() == out.data_ptr()
        if in_order and aliased:  # they are this step's input ids already: copy what follows them
            k = 8 * len(staged.pending_ids)
            out[k:nbytes].copy_(self.host[k:nbytes], non_blocking=True)
        else:
            if aliased:  # read before the copy overwrites them
                sampled = sampled.clone()
            out = self._copy(self.host[:nbytes], out)
            if in_order:
                k = len(staged.pending_ids)
                typed(out, 0, k, torch.int64).copy_(sampled[:k])
            elif num_fill:
                fill_pending_tokens(typed(out, 0, tokens, torch.int64), typed(out, 8 * fill_at, num_fill, torch.int64),
                                    sampled)
        if self._copied is not None:
            self._copied.record()
        return out

    def _copy(self, host: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        if out is not None:
            out[:host.shape[0]].copy_(host, non_blocking=True)
            return out
        if self.device.type == "cpu":
            return host.clone()  # the staging is refilled next step
        return host.to(self.device, non_blocking=True)

    # The per-request layout. ----------------------------------------------------------------------------

    def stage_requests(self, chunks: list[ScheduledChunk], previous: InflightStep | None = None,
                       block_tables: np.ndarray | None = None) -> StepInputs:
        """A step's inputs in the per-request layout, chunks in the order given (decodes, those of one
        token, must come first). int32 staging: query_start_loc [B + 1], seq_lens [B], block tables [B, W].
        `block_tables`: the step's SchedulerOutput.block_tables (see `stage_chunks`)."""
        bs = self.block_size
        self.begin()
        num_requests = len(chunks)
        query_lens = [chunk.num_tokens for chunk in chunks]
        seq_lens = [chunk.start_pos + chunk.num_tokens for chunk in chunks]
        tokens = sum(query_lens)
        width = cdiv(max(seq_lens), bs)
        samples = [chunk.sample for chunk in chunks]
        sampling_chunks = [chunk for chunk in chunks if chunk.sample]
        rows = len(sampling_chunks)
        num_int64 = 3 * tokens + rows
        h32 = self.int32_staging(num_int64)
        tables_at = 2 * num_requests + 1
        num_int32 = tables_at + num_requests * width
        tables = h32[tables_at:num_int32].reshape(num_requests, width)
        tables[:] = 0
        staged = self.stage_chunks(chunks, tokens, tables, block_tables)
        h32[0] = 0
        h32[1:num_requests + 1] = staged.ends
        h32[num_requests + 1:tables_at] = seq_lens
        self.h64[3 * tokens:num_int64] = staged.ends[np.array(samples, dtype=bool)] - 1
        staging = self.send(tokens, rows, num_int32, staged, previous)
        int64 = typed(staging, 0, num_int64, torch.int64)
        int32 = typed(staging, int32_offset(num_int64), num_int32, torch.int32)
        num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), num_requests)
        metadata = AttentionMetadata(
            slot_mapping=int64[2 * tokens:3 * tokens],
            query_start_loc=int32[:num_requests + 1],
            seq_lens=int32[num_requests + 1:tables_at],
            block_tables=int32[tables_at:num_int32].view(num_requests, width),
            query_lens=query_lens,
            seq_lens_host=seq_lens,
            num_decodes=num_decodes,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        return StepInputs(input_ids=int64[:tokens], positions=int64[tokens:2 * tokens], attn_metadata=metadata,
                          logits_indices=int64[3 * tokens:3 * tokens + rows], sampling_chunks=sampling_chunks)


def request_stager(max_tokens: int, max_requests: int, max_blocks: int, block_size: int,
                   device: torch.device) -> StepStager:
    """A stager whose int32 staging fits the per-request layout of steps up to those sizes."""
    return StepStager(max_tokens, max_requests, 2 * max_requests + 1 + max_requests * max_blocks, block_size, device)


def _stage_fill(staging: np.ndarray, staged: StagedChunks, previous: InflightStep | None) -> int:
    """Write the fill of the pending tokens into `staging`: k input rows, then the k rows of
    `previous`'s sampled tokens they take. -> the number of values written, 2k."""
    if not staged.pending_ids:
        return 0
    if previous is None:
        raise RuntimeError(f"request {staged.pending_ids[0]!r} has a pending token but no step is in flight")
    k = len(staged.pending_rows)
    staging[:k] = staged.pending_rows
    staging[k:2 * k] = previous.sampled_rows(staged.pending_ids)
    return 2 * k


def _table_rows(chunks: list[ScheduledChunk]) -> np.ndarray | None:
    """[R] int64 each chunk's row in its step's block tables; None when a chunk has none (built by hand)."""
    try:
        return np.fromiter(map(_table_row, chunks), np.int64, len(chunks))
    except TypeError:  # a None row
        return None


def _table_array(block_tables: list[list[int]]) -> np.ndarray:
    """[R, longest] int32: the tables as rows, zero past each one's end."""
    array = np.zeros((len(block_tables), max(1, max(len(table) for table in block_tables))), dtype=np.int32)
    for row, table in enumerate(block_tables):
        array[row, :len(table)] = table
    return array


def fill_pending_tokens(input_ids: torch.Tensor, index: torch.Tensor, sampled: torch.Tensor) -> None:
    """input_ids [T] int64 on the device; index [2k]: the staged fill, on the device; sampled [N] int64:
    the step in flight's tokens. Enqueued on the current stream, so the forward that follows reads the
    filled ids."""
    k = index.shape[0] // 2
    tokens = sampled.index_select(0, index[k:])  # [k]
    input_ids.index_copy_(0, index[:k], tokens)


# Tests and one-off scripts: attention metadata without a scheduler. ------------------------------------


@dataclass
class SequenceChunk:
    block_table: list[int]  # physical blocks of the request, in logical order
    start: int  # tokens of this request already in the cache = position of the first new token
    num_tokens: int  # new tokens this step


def build_attention_metadata(chunks: list[SequenceChunk], block_size: int,
                             device: torch.device | str) -> tuple[AttentionMetadata, torch.Tensor]:
    """-> (metadata, positions [T] int64) of one step of `chunks`, staged as the eager runner stages
    its steps. Decode chunks (one new token after a cached context) must come first, as the runner
    orders them; the caller passes the input ids to the model itself."""
    single = [chunk.num_tokens == 1 for chunk in chunks]
    leading = next((i for i, one in enumerate(single) if not one), len(chunks))
    if any(one and chunk.start > 0 for one, chunk in zip(single[leading:], chunks[leading:])):
        raise ValueError("decode chunks (one new token after a cached context) must come first")
    scheduled = []
    for i, chunk in enumerate(chunks):
        seq_len = chunk.start + chunk.num_tokens
        if len(chunk.block_table) * block_size < seq_len:
            raise ValueError(f"block table of {len(chunk.block_table)} blocks cannot hold {seq_len} tokens")
        request = Request(f"chunk-{i}", [0] * seq_len, SamplingParams())
        scheduled.append(ScheduledChunk(request, chunk.start, chunk.num_tokens, chunk.block_table, sample=True))
    tokens = sum(chunk.num_tokens for chunk in chunks)
    max_blocks = max(cdiv(chunk.start + chunk.num_tokens, block_size) for chunk in chunks)
    stager = request_stager(tokens, len(chunks), max_blocks, block_size, torch.device(device))
    inputs = stager.stage_requests(scheduled)
    return inputs.attn_metadata, inputs.positions
