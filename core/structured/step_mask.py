"""The token mask of one step's constrained rows: built on the host, applied on the device.

ModelRunner.launch enqueues the step's forward first and only then calls `step_grammar_mask`, so
the host computes the mask while the device runs the forward. A constrained row's mask depends on
the token its request sampled in the previous step; with async scheduling that step may still be
unapplied, so the token is read from its host copy (`InflightStep.token_of`): the wait ends as soon
as the previous step's sampler has run, which is before this step's forward, so the device never
idles for it. Each request's matcher then catches up (matcher.py) and llguidance fills one bitmask
row per constrained row (in parallel over rows, GIL released), in pinned memory; one non-blocking
copy takes it to the device, and the sampler masks the logits there (`apply_grammar_mask`), before
penalties, temperature and the logprobs, as vLLM does.

A step with no constrained row gets None: no tensor, no copy, no extra device op, no wait.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deepinfer.core.engine.worker.transfers import to_device

if TYPE_CHECKING:
    from collections.abc import Callable

    from deepinfer.core.engine.sched.scheduler_output import ScheduledChunk

_executor = None
_executor_lock = threading.Lock()


@dataclass
class GrammarMask:
    rows: torch.Tensor  # [C] int64 on the logits' device: the constrained rows of the step's logits
    bitmask: torch.Tensor  # [C, ceil(V / 32)] int32 on the device; bit j of word w allows token 32w + j


def _mask_executor():
    """llguidance's thread pool for filling many rows at once (made on first use)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            import llguidance

            _executor = llguidance.LLExecutor()
        return _executor


def step_grammar_mask(sampling_chunks: list[ScheduledChunk], pending_token: Callable[[str], int | None] | None,
                      vocab_size: int, device: torch.device) -> GrammarMask | None:
    """The mask of the step's constrained rows (row i is sampling_chunks[i]); None when it has none.
    `pending_token(request_id)`: a request's token from the step still in flight, if it has one (the previous
    InflightStep's token_of), which its grammar must accept before this step's mask."""
    constrained = [(row, chunk.request) for row, chunk in enumerate(sampling_chunks)
                   if chunk.request.grammar is not None]
    if not constrained:
        return None
    for _, request in constrained:
        pending = pending_token(request.request_id) if pending_token is not None else None
        request.grammar.catch_up(request.output_token_ids, pending)
    num_words = (vocab_size + 31) // 32
    # Pinned, from the caching host allocator: the block is not reused before the copy has read it.
    host = torch.empty((len(constrained), num_words), dtype=torch.int32, pin_memory=device.type == "cuda")
    if len(constrained) == 1:
        matcher = constrained[0][1].grammar.matcher
        matcher.unsafe_compute_mask_ptr(host.data_ptr(), num_words * 4)
    else:
        matchers = [(request.grammar.matcher, index) for index, (_, request) in enumerate(constrained)]
        _mask_executor().unsafe_compute_mask_ptr(matchers, host.data_ptr(), num_words * 4, len(constrained))
    rows = to_device([row for row, _ in constrained], torch.int64, device)
    bitmask = host if device.type != "cuda" else host.to(device, non_blocking=True)
    return GrammarMask(rows, bitmask)


def apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask) -> torch.Tensor:
    """logits [N, V] float32 -> new logits with the disallowed tokens of the masked rows at -inf.
    The caller's tensor is not modified (with CUDA graphs it is the graph's output buffer)."""
    num_rows, vocab_size = mask.rows.shape[0], logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (mask.bitmask.unsqueeze(-1) >> shifts) & 1  # [C, W, 32]
    allowed = bits.view(num_rows, -1)[:, :vocab_size].bool()  # [C, V]
    masked = logits.index_select(0, mask.rows).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy(0, mask.rows, masked)
