"""Decode steps at padded batch sizes: static input buffers, replayed CUDA graphs.

A pure-decode step (every request computes exactly one token) of `n` requests runs as the batch
of the smallest bucket >= n (1, 2, 4, 8, 16, 24, ... max_num_seqs) and the smallest context bound
>= its longest context (1024, 4096, 16384, ... max_model_len). Its inputs go into static buffers,
one set shared by every bucket; the rows past `n` are padding that points at a dummy KV block
reserved for them (token 0 at position 0, written to the dummy block's first slot, context length
1), so they never touch a real request's cache.

Why context bounds: the native decode kernel sizes its grid (context splits) from a host-side
upper bound of the step's context lengths, which a graph fixes at capture. Capturing every bucket
at max_model_len only would make short contexts pay for the longest one (empty splits still launch
and write); a few bounds at 4x apart keep that waste small at a few graphs per bucket. The block
table a graph reads is `[batch, cdiv(bound, block_size)]`, also fixed per bound.

Two ways to run a padded step, with the same buffers and the same forward:
- "graphs" (CUDA): one CUDA graph per (batch, bound), captured at start-up, largest first, from
  one shared memory pool, and replayed;
- "padded" (any device): the padded step runs eagerly. This is what a replay computes, so tests on
  a CPU prove the padding harmless by comparing its tokens with the unpadded path's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from core.attention.metadata import AttentionMetadata
from core.engine.scheduler_output import ScheduledChunk
from core.kv.kv_manager import cdiv

logger = logging.getLogger(__name__)

MiB = 1024**2
SMALLEST_CONTEXT_BOUND = 1024
CONTEXT_BOUND_FACTOR = 4


def decode_bucket_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 below max_num_seqs, then max_num_seqs itself."""
    sizes = {size for size in (1, 2, 4) if size < max_num_seqs}
    sizes.update(range(8, max_num_seqs, 8))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def context_bounds(max_model_len: int) -> list[int]:
    """1024, 4096, 16384, ... below max_model_len, then max_model_len itself."""
    bounds, bound = [], SMALLEST_CONTEXT_BOUND
    while bound < max_model_len:
        bounds.append(bound)
        bound *= CONTEXT_BOUND_FACTOR
    return bounds + [max_model_len]


def smallest_fit(sizes: list[int], value: int) -> int:
    """The first of the ascending `sizes` that is >= value (the caller guarantees one exists)."""
    return next(size for size in sizes if size >= value)


def is_pure_decode(chunks: list[ScheduledChunk]) -> bool:
    return bool(chunks) and all(chunk.num_tokens == 1 for chunk in chunks)


class StaticDecodeBuffers:
    """The device tensors a padded decode step reads, plus host staging to fill them in two copies.

    For a step of `batch` rows and context bound `bound` (w = cdiv(bound, block_size) table columns):
        int64[0:batch]            input ids       int32[0:batch]                      seq_lens
        int64[batch:2*batch]      positions       int32[batch:batch + batch * w]      block table [batch, w]
        int64[2*batch:3*batch]    slot mapping
    Each (batch, bound) views the first elements, so every view is contiguous and one host->device
    copy per dtype moves a whole step.
    """

    def __init__(self, max_batch: int, max_model_len: int, block_size: int, dummy_block: int,
                 device: torch.device) -> None:
        self.block_size = block_size
        self.dummy_block = dummy_block
        max_blocks = cdiv(max_model_len, block_size)
        pin = device.type == "cuda"
        self.int64 = torch.zeros(3 * max_batch, dtype=torch.int64, device=device)
        self.int32 = torch.zeros(max_batch * (1 + max_blocks), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)  # one token each
        self.host_int64 = torch.zeros(self.int64.shape, dtype=torch.int64, pin_memory=pin)
        self.host_int32 = torch.zeros(self.int32.shape, dtype=torch.int32, pin_memory=pin)
        self._host64, self._host32 = self.host_int64.numpy(), self.host_int32.numpy()
        # Set after each step's copies: the staging is refilled only once they have read it.
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def load(self, chunks: list[ScheduledChunk], batch: int, bound: int) -> None:
        """Stage the decode chunks as rows 0..n-1, padding rows n..batch-1, and copy to the device."""
        if self._copied is not None:
            self._copied.synchronize()
        bs, width = self.block_size, cdiv(bound, self.block_size)
        h64, h32 = self._host64, self._host32
        tables = h32[batch:batch + batch * width].reshape(batch, width)
        tables[:] = 0  # stale ids from other layouts could lie outside the pool
        for i, chunk in enumerate(chunks):
            position = chunk.start_pos
            table = chunk.block_table
            h64[i] = chunk.request.all_token_ids[position]
            h64[batch + i] = position
            h64[2 * batch + i] = table[position // bs] * bs + position % bs
            h32[i] = position + 1
            used = position // bs + 1
            tables[i, :used] = table[:used]
        n = len(chunks)
        h64[n:batch] = 0  # padding: token 0 at position 0 ...
        h64[batch + n:2 * batch] = 0
        h64[2 * batch + n:3 * batch] = self.dummy_block * bs  # ... written to the dummy block's slot 0
        h32[n:batch] = 1
        tables[n:, 0] = self.dummy_block
        self.int64[:3 * batch].copy_(self.host_int64[:3 * batch], non_blocking=True)
        self.int32[:batch + batch * width].copy_(self.host_int32[:batch + batch * width], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def views(self, batch: int, bound: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids [batch], positions [batch], metadata) over the buffers, for a bound's graph.

        The host lists hold the bound, not the step's lengths: the graph is captured once for every
        step whose contexts fit the bound, and backends size work (kernel splits, gathered blocks)
        from them; the true lengths are in the device `seq_lens`.
        """
        width = cdiv(bound, self.block_size)
        metadata = AttentionMetadata(
            slot_mapping=self.int64[2 * batch:3 * batch],
            query_start_loc=self.query_start_loc[:batch + 1],
            seq_lens=self.int32[:batch],
            block_tables=self.int32[batch:batch + batch * width].view(batch, width),
            query_lens=[1] * batch,
            seq_lens_host=[bound] * batch,
            num_decodes=batch,
            max_query_len=1,
            max_seq_len=bound,
        )
        return self.int64[:batch], self.int64[batch:2 * batch], metadata


@dataclass
class CaptureReport:
    num_graphs: int = 0
    seconds: float = 0.0
    memory_bytes: int = 0  # device memory the graphs hold (pool + graph objects), measured


class PaddedDecodeRunner:
    """Runs pure-decode steps padded to buckets: eagerly ("padded") or by graph replay ("graphs")."""

    def __init__(self, model: torch.nn.Module, kv_cache, device: torch.device, *, block_size: int,
                 max_num_seqs: int, max_model_len: int, dummy_block: int, vocab_size: int,
                 use_graphs: bool) -> None:
        """dummy_block: a KV block no request owns; padding rows write and read only it."""
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.use_graphs = use_graphs
        self.bucket_sizes = decode_bucket_sizes(max_num_seqs)
        self.context_bounds = context_bounds(max_model_len)
        self.buffers = StaticDecodeBuffers(self.bucket_sizes[-1], max_model_len, block_size, dummy_block, device)
        self.report = CaptureReport()
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._logits: torch.Tensor | None = None  # [max batch, vocab] float32: what every graph writes
        if use_graphs:
            self._logits = torch.zeros(self.bucket_sizes[-1], vocab_size, dtype=torch.float32, device=device)

    def shape_of(self, chunks: list[ScheduledChunk]) -> tuple[int, int]:
        """(batch, bound) a decode step of these chunks runs at."""
        longest = max(chunk.seq_len for chunk in chunks)
        return smallest_fit(self.bucket_sizes, len(chunks)), smallest_fit(self.context_bounds, longest)

    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """-> logits [len(chunks), vocab] float32, row i for chunks[i]. With graphs the rows are a view
        of the shared output buffer, valid until the next step."""
        batch, bound = self.shape_of(chunks)
        self.buffers.load(chunks, batch, bound)
        logits = self.replay(batch, bound) if self.use_graphs else self.forward(batch, bound)
        return logits[:len(chunks)]

    def replay(self, batch: int, bound: int) -> torch.Tensor:
        """Replay the (batch, bound) graph over the buffers as they are: logits [batch, vocab] float32."""
        self._graphs[(batch, bound)].replay()
        return self._logits[:batch]

    def forward(self, batch: int, bound: int) -> torch.Tensor:
        """The padded step over the buffers as they are: logits [batch, vocab] float32."""
        input_ids, positions, metadata = self.buffers.views(batch, bound)
        hidden = self.model(input_ids, positions, metadata, self.kv_cache)  # [batch, hidden]
        return self.model.compute_logits(hidden)

    def load_padding(self, batch: int, bound: int) -> None:
        """Fill the buffers with a step of padding rows only (warm-ups and captures)."""
        self.buffers.load([], batch, bound)

    @torch.inference_mode()
    def capture(self) -> CaptureReport:
        """Capture one graph per (bucket, bound), largest first, into one memory pool."""
        start = time.perf_counter()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for batch in reversed(self.bucket_sizes):
            for bound in reversed(self.context_bounds):
                self._graphs[(batch, bound)] = self._capture_one(batch, bound, pool, stream)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free_after = torch.cuda.mem_get_info(self.device)[0]
        self.report = CaptureReport(len(self._graphs), time.perf_counter() - start, max(0, free_before - free_after))
        logger.info("CUDA graphs: %d decode graphs (batch sizes %s, context bounds %s) captured in %.1f s, "
                    "holding %.0f MiB", self.report.num_graphs, self.bucket_sizes, self.context_bounds,
                    self.report.seconds, self.report.memory_bytes / MiB)
        return self.report

    def _capture_one(self, batch: int, bound: int, pool, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
        """The shape first runs once eagerly on the capture stream, so kernels are compiled and the
        quantized matmul's counters and cuBLAS's workspace exist before the capture."""
        self.load_padding(batch, bound)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.forward(batch, bound)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            self._logits[:batch].copy_(self.forward(batch, bound))
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return graph

    @torch.inference_mode()
    def measure_capture_memory(self) -> int:
        """Device bytes `capture()` will take beyond the runner's static buffers, found by capturing
        the largest graph alone and letting it go: its pool (what every graph shares), plus what each
        instantiated graph costs on its own (about the same for every bucket: same kernels) times
        the number of graphs, plus the capture stream's cuBLAS workspace."""
        batch, bound = self.bucket_sizes[-1], self.context_bounds[-1]
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free_start = torch.cuda.mem_get_info(self.device)[0]
        stream = torch.cuda.Stream(self.device)
        self.load_padding(batch, bound)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.forward(batch, bound)  # the stream's workspace; kernels compiled
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free_warm, reserved_warm = torch.cuda.mem_get_info(self.device)[0], torch.cuda.memory_reserved(self.device)
        graph = self._capture_one(batch, bound, None, stream)
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
