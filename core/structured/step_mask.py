"""The token mask of one step's constrained rows: filled on a worker thread, applied on the device.

A constrained row's mask depends on the token its request sampled in the previous step, which with
async scheduling is still in flight when this step is launched. So `StepMasks.start`, called by
ModelRunner.launch right after it has enqueued the step's forward, only notes each constrained row
(its grammar and how many of its output tokens are applied) and hands the rest to one worker
thread, then returns at once. The worker waits for the step in flight's
tokens (its host copy: the wait ends once that step's sampler has run), has each matcher consume
the tokens it has not seen (llguidance's thread pool, GIL released: `consume_token_par`), and fills
one bitmask row per constrained row (the same pool, GIL released), in pinned memory. Meanwhile the
engine thread applies the step in flight and schedules the next one: the mask costs the step's
critical path only the join, one copy and one kernel. The step's sampling is enqueued when first
needed (core/engine/worker/deferred_sample.py): then `PendingMask.result` joins the worker and one copy
takes the rows and the bitmask to the device, where the sampler masks the logits in place
(`apply_grammar_mask`, core/ops/token_bitmask.py), before penalties, temperature and the logprobs,
as vLLM does.

Buffers are allocated once (grown when a step has more constrained rows than any before): two pinned
host slots, used by alternate steps, each waited for by an event recorded after its copy, so a slot is
never refilled before the device has read it; one device buffer (the copies and the kernels that
read it are ordered on the stream). At most one mask is pending: the runner joins a step's mask
(enqueues its sampling) before it launches the next step. A step with no constrained row gets None:
no tensor, no copy, no extra device op, no wait.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING

import torch

from deepinfer.core.ops.token_bitmask import apply_token_bitmask_

if TYPE_CHECKING:
    from deepinfer.core.engine.sched.scheduler_output import ScheduledChunk
    from deepinfer.core.structured.matcher import RequestGrammar

_grammar = attrgetter("request.grammar")  # a constrained request's RequestGrammar, else None
_executor = None
_executor_lock = threading.Lock()


@dataclass
class GrammarMask:
    rows: torch.Tensor  # [C] int32 on the logits' device: the constrained rows of the step's logits
    bitmask: torch.Tensor  # [C, ceil(V / 32)] int32 on the device; bit j of word w allows token 32w + j


def mask_executor():
    """llguidance's thread pool for many matchers at once (made on first use, shared by every engine)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            import llguidance

            _executor = llguidance.LLExecutor()
        return _executor


@dataclass
class _Row:
    grammar: RequestGrammar
    output_token_ids: list[int]  # the request's live list (the engine thread may append while the worker reads)
    num_applied: int  # len(output_token_ids) at launch: the worker reads no further
    request_id: str


class _Slot:
    """One pinned host buffer, int32 [rows | bitmask]: the C row indices, then the C x W mask words."""

    def __init__(self, num_rows: int, num_words: int, pin: bool) -> None:
        self.host = torch.empty(num_rows * (num_words + 1), dtype=torch.int32, pin_memory=pin)
        self.copied: torch.cuda.Event | None = None  # recorded after the copy that last read it


class StepMasks:
    """The grammar masks of one runner's steps: buffers kept across steps, one worker thread."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        self._slots: list[_Slot] = []
        self._next_slot = 0
        self._device_buffer: torch.Tensor | None = None  # int32 [capacity * (W + 1)]
        self._shape = (0, 0)  # (rows, words) the buffers hold

    def start(self, sampling_chunks: list[ScheduledChunk], pending_token: Callable[[str], int | None] | None,
              vocab_size: int) -> PendingMask | None:
        """Begin the mask of a step whose row i is sampling_chunks[i]; None when no row is constrained.
        `pending_token(request_id)`: the request's token from the step in flight, if it has one (the previous
        InflightStep's token_of; it waits for that step's host copy), which the grammar must accept first."""
        if list(map(_grammar, sampling_chunks)).count(None) == len(sampling_chunks):  # in C: most steps have none
            return None
        rows, constrained = [], []
        for index, chunk in enumerate(sampling_chunks):
            request = chunk.request
            if request.grammar is not None:
                rows.append(index)
                constrained.append(_Row(request.grammar, request.output_token_ids, len(request.output_token_ids),
                                        request.request_id))
        if not constrained:
            return None
        num_words = (vocab_size + 31) // 32
        slot = self._slot(len(rows), num_words)
        job = self._worker.submit(_fill, slot, rows, constrained, pending_token, num_words)
        return PendingMask(self, slot, job, len(rows), num_words)

    def _slot(self, num_rows: int, num_words: int) -> _Slot:
        """The next host slot, the buffers grown first when they are too small for the step."""
        rows, words = self._shape
        if num_rows > rows or num_words != words:
            capacity = max(num_rows, 2 * rows) if num_words == words else num_rows
            pin = self.device.type == "cuda"
            # Dropped slots whose copies are queued stay alive: the caching host allocator holds pinned blocks
            # until the copies that read them have run.
            self._slots = [_Slot(capacity, num_words, pin), _Slot(capacity, num_words, pin)]
            self._device_buffer = (torch.empty(capacity * (num_words + 1), dtype=torch.int32, device=self.device)
                                   if pin else None)
            self._shape = (capacity, num_words)
        slot = self._slots[self._next_slot]
        self._next_slot = 1 - self._next_slot
        return slot


@torch.inference_mode()  # the slots were made under the launch's inference mode
def _fill(slot: _Slot, rows: list[int], constrained: list[_Row], pending_token, num_words: int) -> None:
    """The worker's part. What needs no token of the step in flight comes first (the engine thread is then mostly
    waiting for that step, GIL released); after the wait, GIL-free llguidance calls and a few list operations."""
    if slot.copied is not None:
        slot.copied.synchronize()  # the copy of two steps ago has read this slot (long done in practice)
    num_rows = len(rows)
    host = slot.host
    host[:num_rows] = torch.tensor(rows, dtype=torch.int32)
    for item in constrained:  # applied tokens the matcher has not seen (after preemption, in synchronous steps)
        unseen = item.output_token_ids[item.grammar.num_consumed:item.num_applied]
        if unseen:
            item.grammar.consume(unseen)
    # A row takes the step in flight's token if its matcher has seen every applied token (always, but for a
    # discarded step's token); a stopped matcher only counts it.
    ready = [item.grammar.num_consumed == item.num_applied for item in constrained]
    running = [ok and not item.grammar.is_stopped for ok, item in zip(ready, constrained)]
    matchers = [(item.grammar.matcher, index) for index, item in enumerate(constrained)]
    address, row_bytes = host.data_ptr() + num_rows * 4, num_words * 4

    # The first lookup waits for the step in flight's host copy.
    pending = [pending_token(item.request_id) if ok else None for ok, item in zip(ready, constrained)] \
        if pending_token is not None else [None] * num_rows
    batch = [(item.grammar.matcher, token) for item, token, run in zip(constrained, pending, running)
             if run and token is not None]
    accepted = iter(mask_executor().consume_token_par(batch) if batch else ())
    if num_rows == 1:
        constrained[0].grammar.matcher.unsafe_compute_mask_ptr(address, row_bytes)
    else:
        mask_executor().unsafe_compute_mask_ptr(matchers, address, row_bytes, num_rows)
    for item, token, run in zip(constrained, pending, running):
        if token is not None:
            item.grammar.consumed_in_batch(token, next(accepted) if run else True)


class PendingMask:
    """A step's mask being filled by the worker; `result` joins it and puts it on the device."""

    def __init__(self, masks: StepMasks, slot: _Slot, job: concurrent.futures.Future, num_rows: int,
                 num_words: int) -> None:
        self._masks, self._slot, self._job = masks, slot, job
        self._num_rows, self._num_words = num_rows, num_words

    def result(self) -> GrammarMask:
        """Waits for the worker (re-raising what it raised), then one non-blocking copy to the device."""
        self._job.result()
        size = self._num_rows * (self._num_words + 1)
        flat = self._slot.host[:size]
        device_buffer = self._masks._device_buffer
        if device_buffer is not None:
            flat = device_buffer[:size]
            flat.copy_(self._slot.host[:size], non_blocking=True)
            self._slot.copied = torch.cuda.Event()
            self._slot.copied.record()
        return GrammarMask(flat[:self._num_rows], flat[self._num_rows:].view(self._num_rows, self._num_words))


def apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask) -> None:
    """logits [N, V] float32, in place: the disallowed tokens of the masked rows become -inf."""
    apply_token_bitmask_(logits, mask.rows, mask.bitmask)
