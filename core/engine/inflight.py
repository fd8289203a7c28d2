"""A launched step whose sampled tokens the host has not read yet (async scheduling), and the
transfers that let the host run ahead of the device.

LLMEngine keeps at most one InflightStep. It schedules and launches the next step before applying
this one; a decode row of the next step whose input is this step's sampled token (a *pending*
token, not on the host yet) gets it on the device: `stage_pending_tokens` writes the rows' indices
into the host staging right after the input ids, so the one host->device copy of the ids moves
them too, and `fill_pending_tokens` scatters the sampled tokens into the ids, on the same stream,
before the forward or graph replay reads them. Only then does the host wait for this step's tokens
(`result`) and apply them.

No transfer here makes the host wait for the device: a blocking copy waits for everything queued
on the stream, the next step's forward included, which would serialize host and device again.
Host->device copies go through pinned memory with non_blocking (`to_device`); device->host copies
land in pinned memory behind a CUDA event (`HostCopy`), waited for only when the values are read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from deepinfer.core.engine.scheduler_output import ModelRunnerOutput, ScheduledChunk, SchedulerOutput

if TYPE_CHECKING:
    from deepinfer.core.engine.sampler import SamplerOutput


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor, without waiting for the device's queue."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)
    # The caching host allocator keeps the pinned block until the copy has read it.
    return tensor.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """Device tensors copied to host memory in the background; `get` waits for the copy."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._event = None
        if all(tensor.device.type == "cpu" for tensor in tensors):
            self._host = tensors  # nothing to copy: their values are final once computed
            return
        self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for host, tensor in zip(self._host, tensors):
            host.copy_(tensor, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def get(self) -> list[torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host


class InflightStep:
    """What a launched step computes: the tokens sampled for `sampling_chunks` (in that order) on
    the device at once, on the host once `result` has waited for them."""

    def __init__(self, scheduler_output: SchedulerOutput, sampling_chunks: list[ScheduledChunk],
                 sampled: SamplerOutput | None) -> None:
        self.scheduler_output = scheduler_output
        self.sampling_chunks = sampling_chunks
        self.sampled = sampled  # None when no chunk samples
        self._rows = {chunk.request_id: row for row, chunk in enumerate(sampling_chunks)}

    def sampled_row(self, request_id: str) -> int:
        """Row of the request's token in `sampled.sampled` (the device tensor)."""
        row = self._rows.get(request_id)
        if row is None:
            raise RuntimeError(f"request {request_id!r} has a pending token, but the step in flight "
                               f"did not sample it")
        return row

    def token_of(self, request_id: str) -> int | None:
        """The token this step sampled for the request (waits for the host copy); None if it sampled none."""
        row = self._rows.get(request_id)
        return None if row is None else self.sampled.token_ids[row]

    def result(self) -> ModelRunnerOutput:
        """Waits for the sampled tokens (and logprobs) to reach the host."""
        out = ModelRunnerOutput()
        if self.sampled is None:
            return out
        sampled = self.sampled
        for chunk, token_id, logprob in zip(self.sampling_chunks, sampled.token_ids, sampled.logprobs):
            out.sampled_token_ids[chunk.request_id] = token_id
            if logprob is not None:
                out.logprobs[chunk.request_id] = logprob
        return out


def stage_pending_tokens(staging: np.ndarray, pending: list[tuple[int, str]],
                         previous: InflightStep | None) -> int:
    """Write the fill of pending input tokens into `staging` (the int64 host buffer right after the
    step's input ids): k input rows, then the k rows of `previous`'s sampled tokens they take.
    pending: [(input row, request id)] -> the number of values written, 2k."""
    if not pending:
        return 0
    if previous is None:
        raise RuntimeError(f"request {pending[0][1]!r} has a pending token but no step is in flight")
    k = len(pending)
    for i, (input_row, request_id) in enumerate(pending):
        staging[i] = input_row
        staging[k + i] = previous.sampled_row(request_id)
    return 2 * k


def fill_pending_tokens(input_ids: torch.Tensor, index: torch.Tensor, previous: InflightStep) -> None:
    """input_ids [T] int64 on the device; index [2k]: what `stage_pending_tokens` wrote, on the device.
    Enqueued on the current stream, so the forward that follows reads the filled ids."""
    k = index.shape[0] // 2
    tokens = previous.sampled.sampled.index_select(0, index[k:])  # [k]
    input_ids.index_copy_(0, index[:k], tokens)
