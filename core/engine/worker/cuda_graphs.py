"""Steps at padded sizes: static input buffers, replayed CUDA graphs, for decodes and mixed steps.

A token can run as a query of its own: a prefill chunk's token at position p attends to positions
0..p of its request exactly as a decode token does, so one formulation (the paged decode attention,
which reads each token's context through its request's block table) serves decodes, prefill chunks
and any mix of them, and the whole step has static shapes once padded; large buckets attend prefill
chunks in tiles instead (below), with static shapes too. That is what lets mixed and prefill steps
replay a CUDA graph as decodes do, instead of paying a host-side launch of every op (for a model of
many layers, more host time than the step's GPU work).

A step of T tokens from R requests runs as the smallest token bucket >= T (1, 2, 4, 8, 16, 24, ...
max_num_seqs, then 2x up to MAX_GRAPH_TOKENS) and the smallest context bound >= its longest context
(1024, 4096, 16384, ... max_model_len). Its inputs go into static buffers, one set shared by every
bucket; the rows past T are padding that points at a dummy KV block reserved for them (token 0 at
position 0, written to the dummy block's first slot, context length 1), so they never touch a real
request's cache. The graph computes logits for min(bucket, max_num_seqs) rows: the last token of
each request (padding rows read token 0).

Per-token attention re-reads a prompt's context once per query token. Where the native backend's prefill
kernel serves the model (`prefill_tile_tokens`), buckets above max_num_seqs (which only steps with prefill
chunks reach) that core/ops/paged_attention_table.py tiles attend each chunk, and the padding rows, in tiles
of consecutive tokens instead (paged_prefill_attention: a tile reads the context once for all its tokens); the
decode kernel then serves the step's decodes, placed in the first max_num_seqs rows, with a length of 0 for
the tiles' tokens among them. The attention's cost grows with the context each query (a token, or a tile)
walks; a step whose sum (times the KV heads) passes that table's limit runs eagerly instead, where prefill
chunks go to SDPA. Short prompts, prompts up to the token budget at short contexts, chunked long prompts and
every decode batch stay under it.

Why context bounds: the decode kernel's split path sizes its grid (context splits) from a host-side upper
bound of the step's context lengths, which a graph fixes at capture (its combined path, taken by larger
batches under a 1024-token bound, does not). Capturing every bucket at
max_model_len only would make short contexts pay for the longest one (empty splits still launch
and write); a few bounds at 4x apart keep that waste small at a few graphs per bucket. The block
table a graph reads is `[rows, cdiv(bound, block_size)]`, also fixed per bound.

Two ways to run a padded step, with the same buffers and the same forward:
- "graphs" (CUDA): one CUDA graph per (bucket, bound), captured at start-up, largest first, from
  one shared memory pool, and replayed;
- "padded" (any device): the padded step runs eagerly. This is what a replay computes, so tests on
  a CPU prove the padding and the per-token formulation harmless by comparing its tokens with the
  unpadded path's.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from dataclasses import dataclass
from operator import add, attrgetter

import numpy as np
import torch

from deepinfer.core.attention.metadata import AttentionMetadata
from deepinfer.core.engine.sched.scheduler_output import ScheduledChunk
from deepinfer.core.engine.worker.inflight import InflightStep
from deepinfer.core.engine.worker.memory import MiB
from deepinfer.core.engine.worker.step_inputs import StepStager, int32_offset, typed
from deepinfer.core.engine.worker.transfers import to_device
from deepinfer.core.kv.kv_manager import cdiv
from deepinfer.core.ops import paged_attention_table as attention_table

logger = logging.getLogger(__name__)

SMALLEST_CONTEXT_BOUND = 1024
CONTEXT_BOUND_FACTOR = 4
MAX_GRAPH_TOKENS = 2048
# Per-chunk fields read in C (map): these run over every chunk of every step.
_num_tokens, _start_pos, _sample = attrgetter("num_tokens"), attrgetter("start_pos"), attrgetter("sample")


def decode_bucket_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 below max_num_seqs, then max_num_seqs itself."""
    sizes = {size for size in (1, 2, 4) if size < max_num_seqs}
    sizes.update(range(8, max_num_seqs, 8))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def token_bucket_sizes(max_num_seqs: int, max_tokens: int) -> list[int]:
    """The decode buckets, then doubling from the largest of them up to max_tokens (itself last)."""
    sizes = [size for size in decode_bucket_sizes(max_num_seqs) if size <= max_tokens] or [max_tokens]
    while sizes[-1] < max_tokens:
        sizes.append(min(2 * sizes[-1], max_tokens))
    return sizes


def context_bounds(max_model_len: int) -> list[int]:
    """1024, 4096, 16384, ... below max_model_len, then max_model_len itself."""
    bounds, bound = [], SMALLEST_CONTEXT_BOUND
    while bound < max_model_len:
        bounds.append(bound)
        bound *= CONTEXT_BOUND_FACTOR
    return bounds + [max_model_len]


def smallest_fit(sizes: list[int], value: int) -> int:
    """The first of the ascending `sizes` that is >= value (the caller guarantees one exists)."""
    return sizes[bisect_left(sizes, value)]


def attention_work(chunks: list[ScheduledChunk], tile_tokens: int | None = None) -> int:
    """Sum over the step's queries of the context each walks. Without tiles every token is a query: chunk
    positions s..s+n-1 see s+1..s+n. With `tile_tokens` (T) a chunk of n > 1 tokens is a query per tile, which
    walks its last token's context: m = ceil(n / T) tiles see s + T, s + 2T, ..., s + (m - 1)T and s + n."""
    if sum(map(_num_tokens, chunks)) == len(chunks):  # decodes only: each sees its start + 1 positions
        return sum(map(_start_pos, chunks)) + len(chunks)
    work = 0
    for chunk in chunks:
        start, n = chunk.start_pos, chunk.num_tokens
        if tile_tokens is None or n == 1:
            work += n * start + n * (n + 1) // 2
        else:
            tiles = cdiv(n, tile_tokens)
            work += tiles * start + tile_tokens * tiles * (tiles - 1) // 2 + n
    return work


def max_prefill_tiles(tokens: int, max_rows: int, tile_tokens: int) -> int:
    """Most tiles a step of `tokens` tokens can need: chunks of n > 1 tokens (at most min(max_rows, tokens // 2)
    of them) and the padding rows take ceil(n / tile_tokens) tiles each, at most tokens / tile_tokens plus one
    partial each."""
    return cdiv(tokens, tile_tokens) + min(max_rows, tokens // 2) + 1


class StaticStepBuffers:
    """The device buffer a padded step reads, filled through the step stager (core/engine/worker/step_inputs.py,
    the one the eager runner uses too) in one copy.

    For a step of bucket `tokens` (t), `rows` = min(t, max_num_seqs) logit rows (s), s + 1 request
    rows (the last one for padding) and context bound `bound` (w = cdiv(bound, block_size) columns), in a
    tiled bucket (`num_tiles`) m = max_prefill_tiles prefill tiles, else m = 0, the int64 values come
    first, then from byte int32_offset(3t + s) the int32 values:
        int64[0:t]          input ids      int32[0:t]                  context length of each token
        int64[t:2t]         positions      int32[t:2t]                 request row of each token
        int64[2t:3t]        slot mapping   int32[2t:2t + (s + 1) * w]  block table [s + 1, w]
        int64[3t:3t + s]    logit rows     int32[.. + s]               (tiled) the decode kernel's lengths
                                           int32[.. + 2m]              (tiled) tiles: first token row, count
    then the fill of k pending input tokens (the stager's). Each (bucket, bound) views the first bytes,
    so one host->device copy moves a whole step. Pending tokens (async scheduling: sampled by the step
    still in flight) are scattered into the input ids after that copy, on the same stream and outside
    any graph, so the graphs replay unchanged; the sampler of a padded step writes its tokens into the
    input ids (`sampled_ids`), where a steady decode step after it finds them in place.
    """

    def __init__(self, max_tokens: int, max_rows: int, max_model_len: int, block_size: int, dummy_block: int,
                 device: torch.device, tile_tokens: int | None = None) -> None:
        self.block_size = block_size
        self.dummy_block = dummy_block
        self.max_rows = max_rows
        self.tile_tokens = tile_tokens
        max_blocks = cdiv(max_model_len, block_size)
        tiled_extra = max_rows + 2 * self.num_tiles(max_tokens)
        self.stager = StepStager(max_tokens, max_rows, 2 * max_tokens + (max_rows + 1) * max_blocks + tiled_extra,
                                 block_size, device)
        self.staging = torch.zeros(self.stager.nbytes, dtype=torch.uint8, device=device)  # what the graphs read
        self._sampled_ids: dict[int, torch.Tensor] = {}  # num_rows -> the view `sampled_ids` gives
        self.query_start_loc = torch.arange(max_tokens + 1, dtype=torch.int32, device=device)  # one token each

    def rows_of(self, tokens: int) -> int:
        """Logit rows of a bucket: one per request it can hold."""
        return min(tokens, self.max_rows)

    def num_tiles(self, tokens: int) -> int:
        """Prefill tiles a bucket's steps attend in: 0 unless it is tiled (tile_tokens set, tokens > max_rows and
        a bucket size core/ops/paged_attention_table.py tiles)."""
        if self.tile_tokens is None or tokens <= self.max_rows or not attention_table.tiles_prefill(tokens):
            return 0
        return max_prefill_tiles(tokens, self.max_rows, self.tile_tokens)

    def load(self, chunks: list[ScheduledChunk], tokens: int, bound: int,
             previous: InflightStep | None = None, block_tables: np.ndarray | None = None) -> None:
        """Stage the chunks' tokens as rows 0..T-1 (chunk i is request row i), padding rows T..tokens-1,
        and copy to the device. Pending input tokens come from `previous`'s sampled tokens; `block_tables`:
        the step's SchedulerOutput.block_tables (StepStager.stage_chunks). In a tiled bucket the decodes'
        tokens come first, so the decode kernel's first max_num_seqs rows hold them all."""
        stager = self.stager
        stager.begin()
        bs, width, rows = self.block_size, cdiv(bound, self.block_size), self.rows_of(tokens)
        h32 = stager.int32_staging(3 * tokens + rows)
        ids, positions, slots = stager.token_rows(tokens)
        logit_rows = stager.h64[3 * tokens:3 * tokens + rows]
        seq_lens, token_rows = h32[:tokens], h32[tokens:2 * tokens]
        tables = h32[2 * tokens:2 * tokens + (rows + 1) * width].reshape(rows + 1, width)
        tables[:] = 0  # stale ids from other layouts could lie outside the pool
        num_tiles = self.num_tiles(tokens)
        placed, placed_rows = chunks, None  # in chunk order, chunk i in request row i
        if num_tiles:  # decodes first, in chunk order (a stable sort)
            placed_rows = sorted(range(len(chunks)), key=lambda i: chunks[i].num_tokens > 1)
            placed = [chunks[i] for i in placed_rows]
        staged = stager.stage_chunks(placed, tokens, tables, block_tables, placed_rows)
        lengths = staged.lengths
        request_rows = np.array(placed_rows, dtype=np.int64) if num_tiles else np.arange(len(chunks))
        token = int(staged.ends[-1]) if len(chunks) else 0
        seq_lens[:token] = positions[:token] + 1  # each token attends to its context up to itself
        token_rows[:token] = request_rows if token == len(chunks) else np.repeat(request_rows, lengths)
        logit_rows[request_rows] = staged.ends - 1  # chunk i's last token, wherever it was placed
        ids[token:] = 0  # padding: token 0 at position 0 ...
        positions[token:] = 0
        slots[token:] = self.dummy_block * bs  # ... written to the dummy block's slot 0
        seq_lens[token:] = 1
        token_rows[token:] = rows  # the padding row, whose table holds only the dummy block
        tables[rows, 0] = self.dummy_block
        logit_rows[len(chunks):] = 0
        n32 = 2 * tokens + (rows + 1) * width
        if num_tiles:
            n32 += self._stage_tiles(h32[n32:], seq_lens, lengths.tolist(), tokens, rows, num_tiles)
        stager.send(tokens, rows, n32, staged, previous, out=self.staging)

    def _stage_tiles(self, h32: np.ndarray, seq_lens: np.ndarray, placed_lengths: list[int], tokens: int, rows: int,
                     num_tiles: int) -> int:
        """Fill a tiled step's decode lengths (h32[:rows]) and tiles (h32[rows:rows + 2 * num_tiles]) after its
        token rows and their context lengths (`seq_lens` [tokens]) are staged (placed_lengths: the chunks' token
        counts in row order); -> elements filled. Chunks of several tokens and the padding rows (seq_len 1 each,
        all in the padding row's table) attend in tiles; the decode kernel gives their rows among the first
        `rows` length 0."""
        decode_lens = h32[:rows]
        tiles = h32[rows:rows + 2 * num_tiles].reshape(num_tiles, 2)
        decode_lens[:] = seq_lens[:rows]
        tiles[:] = 0
        spans, token = [], 0
        for n in placed_lengths:
            if n > 1:
                spans.append((token, n))
            token += n
        if token < tokens:
            spans.append((token, tokens - token))
        tile = 0
        for begin, n in spans:
            decode_lens[begin:min(begin + n, rows)] = 0
            firsts = np.arange(begin, begin + n, self.tile_tokens)
            tiles[tile:tile + len(firsts), 0] = firsts
            tiles[tile:tile + len(firsts), 1] = np.minimum(self.tile_tokens, begin + n - firsts)
            tile += len(firsts)
        return rows + 2 * num_tiles

    def views(self, tokens: int, bound: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids [t], positions [t], logit rows [s], metadata) over the buffers, for a bound's graph.

        Every token is a query of its own in the metadata (num_decodes = t), with its request's block
        table row gathered on the device (part of what a graph replays). The host lists hold the
        bound, not the step's lengths: the graph is captured once for every step whose contexts fit
        the bound, and backends size work (kernel splits, gathered blocks) from them; the true
        lengths are in the device `seq_lens`.
        """
        width, rows = cdiv(bound, self.block_size), self.rows_of(tokens)
        end, num_tiles = 2 * tokens + (rows + 1) * width, self.num_tiles(tokens)
        int64 = typed(self.staging, 0, 3 * tokens + rows, torch.int64)
        int32 = typed(self.staging, int32_offset(3 * tokens + rows), end + rows + 2 * num_tiles, torch.int32)
        tables = int32[2 * tokens:end].view(rows + 1, width)
        token_rows = int32[tokens:2 * tokens]
        metadata = AttentionMetadata(
            slot_mapping=int64[2 * tokens:3 * tokens],
            query_start_loc=self.query_start_loc[:tokens + 1],
            seq_lens=int32[:tokens],
            block_tables=tables.index_select(0, token_rows),  # [t, w]
            query_lens=[1] * tokens,
            seq_lens_host=[bound] * tokens,
            num_decodes=tokens,
            max_query_len=1,
            max_seq_len=bound,
            fresh_tokens=tokens,  # one sequence's chunk may fill the bucket
            decode_seq_lens=int32[end:end + rows] if num_tiles else None,
            prefill_tiles=int32[end + rows:end + rows + 2 * num_tiles].view(num_tiles, 2) if num_tiles
            else None,
        )
        return int64[:tokens], int64[tokens:2 * tokens], int64[3 * tokens:3 * tokens + rows], metadata

    def sampled_ids(self, num_rows: int) -> torch.Tensor:
        """[num_rows] int64 on the device: the first input ids, where the sampler of a padded step writes its
        tokens, after the step's forward has read its own (stream order): a steady decode step after it
        (its token rows in the same requests' order) finds its inputs there and copies none."""
        ids = self._sampled_ids.get(num_rows)
        if ids is None:  # made once per size: a view costs torch calls every step
            ids = self._sampled_ids[num_rows] = typed(self.staging, 0, num_rows, torch.int64)
        return ids


@dataclass
class CaptureReport:
    num_graphs: int = 0
    seconds: float = 0.0
    memory_bytes: int = 0  # device memory the graphs hold (pool + graph objects), measured


class PaddedStepRunner:
    """Runs steps padded to token buckets: eagerly ("padded") or by graph replay ("graphs")."""

    def __init__(self, model: torch.nn.Module, kv_cache, device: torch.device, *, block_size: int,
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, dummy_block: int,
                 vocab_size: int, num_kv_heads: int, use_graphs: bool, prefill_tile_tokens: int | None = None) -> None:
        """dummy_block: a KV block no request owns; padding rows write and read only it. prefill_tile_tokens: the
        tile size of paged_prefill_attention where it serves (core/engine/worker/backends.py), else None."""
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.use_graphs = use_graphs
        self.bucket_sizes = token_bucket_sizes(max_num_seqs, min(max_num_batched_tokens, MAX_GRAPH_TOKENS))
        self.context_bounds = context_bounds(max_model_len)
        self.attention_work_limit = attention_table.graph_attention_work_limit(num_kv_heads)
        self.buffers = StaticStepBuffers(self.bucket_sizes[-1], max_num_seqs, max_model_len, block_size,
                                         dummy_block, device, prefill_tile_tokens)
        self.report = CaptureReport()
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._logits: torch.Tensor | None = None  # [max rows, vocab] float32: what every graph writes
        if use_graphs:
            self._logits = torch.zeros(self.buffers.rows_of(self.bucket_sizes[-1]), vocab_size,
                                       dtype=torch.float32, device=device)

    def serves(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether the step fits a bucket and its attention (per token, or per tile in a tiled bucket) stays
        cheap enough."""
        num_tokens = sum(map(_num_tokens, chunks))
        if not (0 < num_tokens <= self.bucket_sizes[-1] and len(chunks) <= self.buffers.max_rows):
            return False
        if num_tokens == len(chunks):  # decodes only: each sees its start + 1 positions
            return sum(map(_start_pos, chunks)) + num_tokens <= self.attention_work_limit
        tiled = self.buffers.num_tiles(smallest_fit(self.bucket_sizes, num_tokens)) > 0
        return attention_work(chunks, self.buffers.tile_tokens if tiled else None) <= self.attention_work_limit

    def shape_of(self, chunks: list[ScheduledChunk]) -> tuple[int, int]:
        """(token bucket, bound) a step of these chunks runs at."""
        num_tokens = sum(map(_num_tokens, chunks))
        if num_tokens == len(chunks):  # decodes only: the longest seq_len is the latest start + 1
            longest = max(map(_start_pos, chunks)) + 1
        else:
            longest = max(map(add, map(_start_pos, chunks), map(_num_tokens, chunks)))  # the longest seq_len
        return smallest_fit(self.bucket_sizes, num_tokens), smallest_fit(self.context_bounds, longest)

    def run(self, chunks: list[ScheduledChunk], previous: InflightStep | None = None,
            block_tables: np.ndarray | None = None) -> torch.Tensor:
        """-> logits [n, vocab] float32 of the n chunks that sample, row i for the last token of the
        i-th of them. With graphs the rows are a view of the shared output buffer, valid until the
        next step. `previous`: the step in flight, which samples the chunks' pending input tokens;
        `block_tables`: the step's SchedulerOutput.block_tables."""
        tokens, bound = self.shape_of(chunks)
        self.buffers.load(chunks, tokens, bound, previous, block_tables)
        logits = self.replay(tokens, bound) if self.use_graphs else self.forward(tokens, bound)
        if all(map(_sample, chunks)):
            return logits[:len(chunks)]
        sampling = [i for i, chunk in enumerate(chunks) if chunk.sample]
        # A list index would copy to the device and wait for the stream; this copy does not.
        return logits.index_select(0, to_device(sampling, torch.int64, self.device))

    def replay(self, tokens: int, bound: int) -> torch.Tensor:
        """Replay the (bucket, bound) graph over the buffers as they are: logits [rows, vocab] float32."""
        self._graphs[(tokens, bound)].replay()
        return self._logits[:self.buffers.rows_of(tokens)]

    def forward(self, tokens: int, bound: int) -> torch.Tensor:
        """The padded step over the buffers as they are: logits [rows, vocab] float32."""
        input_ids, positions, logit_rows, metadata = self.buffers.views(tokens, bound)
        hidden = self.model(input_ids, positions, metadata, self.kv_cache)  # [tokens, hidden]
        return self.model.compute_logits(hidden[logit_rows])

    def load_padding(self, tokens: int, bound: int) -> None:
        """Fill the buffers with a step of padding rows only (warm-ups and captures)."""
        self.buffers.load([], tokens, bound)

    @torch.inference_mode()
    def capture(self) -> CaptureReport:
        """Capture one graph per (bucket, bound), largest first, into one memory pool."""
        start = time.perf_counter()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        shapes = [(tokens, bound) for tokens in reversed(self.bucket_sizes) for bound in reversed(self.context_bounds)]
        # Every shape runs eagerly before the first capture, so the eager runs' activations are
        # given back before the graph pool exists and never sit beside it (the KV budget counts the
        # activations and the graphs once each).
        for tokens, bound in shapes:
            self._run_eagerly(tokens, bound, stream)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        for tokens, bound in shapes:
            self._graphs[(tokens, bound)] = self._capture_one(tokens, bound, pool, stream)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free_after = torch.cuda.mem_get_info(self.device)[0]
        self.report = CaptureReport(len(self._graphs), time.perf_counter() - start, max(0, free_before - free_after))
        logger.info("CUDA graphs: %d step graphs (token buckets %s, context bounds %s) captured in %.1f s, "
                    "holding %.0f MiB", self.report.num_graphs, self.bucket_sizes, self.context_bounds,
                    self.report.seconds, self.report.memory_bytes / MiB)
        return self.report

    def _run_eagerly(self, tokens: int, bound: int, stream: torch.cuda.Stream) -> None:
        """One eager run of a shape on the capture stream before it is captured, so its kernels are
        compiled and the quantized matmul's counters and cuBLAS's workspace exist."""
        self.load_padding(tokens, bound)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.forward(tokens, bound)
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def _capture_one(self, tokens: int, bound: int, pool, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
        """The shape's graph; it has run eagerly on `stream` before (`_run_eagerly`)."""
        self.load_padding(tokens, bound)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        graph = torch.cuda.CUDAGraph()
        rows = self.buffers.rows_of(tokens)
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            self._logits[:rows].copy_(self.forward(tokens, bound))
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return graph

    @torch.inference_mode()
    def measure_capture_memory(self) -> int:
        """Device bytes `capture()` will take beyond the runner's static buffers, found by capturing
        the largest graph alone and letting it go: its pool (what every graph shares), plus what each
        instantiated graph costs on its own (about the same for every bucket: same kernels) times
        the number of graphs, plus the capture stream's cuBLAS workspace."""
        tokens, bound = self.bucket_sizes[-1], self.context_bounds[-1]
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free_start = torch.cuda.mem_get_info(self.device)[0]
        stream = torch.cuda.Stream(self.device)
        self._run_eagerly(tokens, bound, stream)  # the stream's workspace; kernels compiled
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free_warm, reserved_warm = torch.cuda.mem_get_info(self.device)[0], torch.cuda.memory_reserved(self.device)
        graph = self._capture_one(tokens, bound, None, stream)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        pool_bytes = torch.cuda.memory_reserved(self.device) - reserved_warm
        per_graph = max(0, free_warm - torch.cuda.mem_get_info(self.device)[0] - pool_bytes)
        del graph
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        num_graphs = len(self.bucket_sizes) * len(self.context_bounds)
        return max(0, free_start - free_warm) + pool_bytes + num_graphs * per_graph

    def describe(self) -> dict:
        return {
            "enabled": bool(self._graphs),
            "mode": "graphs" if self.use_graphs else "padded",
            "buckets": list(self.bucket_sizes),
            "context_bounds": list(self.context_bounds),
            "num_graphs": self.report.num_graphs,
            "capture_s": round(self.report.seconds, 3),
            "memory_bytes": self.report.memory_bytes,
        }
