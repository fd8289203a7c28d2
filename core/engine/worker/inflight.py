"""A launched step whose sampled tokens the host has not read yet (async scheduling).

LLMEngine keeps at most one InflightStep. It schedules and launches the next step before applying
this one; a row of the next step whose input is this step's sampled token (a *pending* token, not
on the host yet; its chunk's `last_token_pending`) gets it on the device, from `sampled_row` of this
step's sampled tokens (core/engine/worker/step_inputs.py). Only then does the host wait for this step's
tokens (`result`) and apply them.

The transfers involved never make the host wait for the device (core/engine/worker/transfers.py).
"""

from __future__ import annotations

from functools import cached_property
from operator import attrgetter
from typing import TYPE_CHECKING

import numpy as np

from deepinfer.core.engine.sched.scheduler_output import ModelRunnerOutput, ScheduledChunk, SchedulerOutput

if TYPE_CHECKING:
    from deepinfer.core.engine.worker.prompt_logprobs import PromptLogprobs
    from deepinfer.core.engine.worker.sampler import SamplerOutput


_request_id = attrgetter("request.request_id")


class InflightStep:
    """What a launched step computes: the tokens sampled for `sampling_chunks` (in that order) on
    the device at once, on the host once `result` has waited for them; and the prompt logprobs of
    the chunks that score prompt tokens."""

    def __init__(self, scheduler_output: SchedulerOutput, sampling_chunks: list[ScheduledChunk],
                 sampled: SamplerOutput | None, prompt_logprobs: PromptLogprobs | None = None) -> None:
        self.scheduler_output = scheduler_output
        self.sampling_chunks = sampling_chunks
        self.sampled = sampled  # None when no chunk samples
        self.prompt_logprobs = prompt_logprobs  # None when no chunk scores prompt tokens
        self._request_ids = list(map(_request_id, sampling_chunks))

    @cached_property
    def _rows(self) -> dict[str, int]:
        """request id -> its row; made only when a step's pending tokens are not simply these rows in order."""
        return dict(zip(self._request_ids, range(len(self._request_ids))))

    def sampled_row(self, request_id: str) -> int:
        """Row of the request's token in `sampled.sampled` (the device tensor)."""
        row = self._rows.get(request_id)
        if row is None:
            raise RuntimeError(f"request {request_id!r} has a pending token, but the step in flight "
                               f"did not sample it")
        return row

    def samples_in_order(self, request_ids: list[str]) -> bool:
        """Whether its sampled rows are these requests' tokens, in this order (steady decoding)."""
        return request_ids == self._request_ids

    def sampled_rows(self, request_ids: list[str]) -> list[int] | np.ndarray:
        """`sampled_row` of each request."""
        if request_ids == self._request_ids:  # steady decoding: the same requests in the same order
            return np.arange(len(request_ids))
        rows = self._rows
        try:
            return [rows[request_id] for request_id in request_ids]
        except KeyError:
            missing = next(request_id for request_id in request_ids if request_id not in rows)
            return [self.sampled_row(missing)]  # raises

    def token_of(self, request_id: str) -> int | None:
        """The token this step sampled for the request (waits for the host copy); None if it sampled none."""
        row = self._rows.get(request_id)
        return None if row is None else self.sampled.token_ids[row]

    def result(self) -> ModelRunnerOutput:
        """Waits for the sampled tokens (and logprobs) to reach the host."""
        out = ModelRunnerOutput()
        if self.prompt_logprobs is not None:
            out.prompt_logprobs = self.prompt_logprobs.by_request()
        if self.sampled is None:
            return out
        sampled = self.sampled
        out.sampled_token_ids = dict(zip(self._request_ids, sampled.token_ids))
        if sampled.has_logprobs:
            out.logprobs = {request_id: logprob for request_id, logprob in zip(self._request_ids, sampled.logprobs)
                            if logprob is not None}
        return out

