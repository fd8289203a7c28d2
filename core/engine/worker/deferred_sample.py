"""DeferredSample: the sampled tokens of a step with constrained rows, whose sampling is enqueued late.

Its mask is still being filled by the worker thread (core/structured/step_mask.py) when
ModelRunner.launch returns, so the step's sampling is enqueued only when something first needs it:
the next launch (whose inputs read these tokens on the device; it calls `enqueue_sampling` before
anything else, so the sampling also reads the step's logits before the next step's forward or graph
replay overwrites them), or `InflightStep.result` (a synchronous step, the last step). Until then
the engine thread applies the step in flight and schedules, while the worker fills the mask: the
mask is off the step's critical path. Everything is enqueued on the engine thread; the worker only
reads `token_ids` of a DeferredSample already enqueued (the previous step's, as its pending tokens).

It has SamplerOutput's interface (`sampled`, `token_ids`, `logprobs`, `failures`, ...): attributes
are read from the sampler's output, enqueued first. A mask that could not be made (the worker
raised) or a sampling that raised fails every row of the step, as a failed launch would; the engine
then fails those requests alone (their token is 0), not those of the launch that enqueued it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from deepinfer.core.engine.worker.sampler import Sampler, SamplerOutput

if TYPE_CHECKING:
    from deepinfer.core.engine.worker.sampler import RowwiseSamplerOutput, SamplingRow
    from deepinfer.core.structured.step_mask import PendingMask

logger = logging.getLogger(__name__)


class DeferredSample:
    def __init__(self, sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow], mask: PendingMask) -> None:
        self._sampler, self._logits, self._rows, self._mask = sampler, logits, rows, mask
        self._output: SamplerOutput | RowwiseSamplerOutput | None = None

    def enqueue(self) -> SamplerOutput | RowwiseSamplerOutput:
        """Join the mask and enqueue the sampling (once); -> the sampler's output."""
        if self._output is None:
            self._output = self._sample()
        return self._output

    @torch.inference_mode()  # as the launch that made the logits: the mask writes them in place
    def _sample(self) -> SamplerOutput | RowwiseSamplerOutput:
        logits, rows = self._logits, self._rows
        try:
            grammar_mask = self._mask.result()
        except Exception as err:  # the step's requests fail, the engine goes on
            logger.exception("the grammar masks of a step of %d rows could not be made", len(rows))
            return _failed(len(rows), logits.device, f"grammar mask failed: {type(err).__name__}: {err}")
        try:
            return self._sampler.sample(logits, rows, grammar_mask)
        except Exception as err:  # raised where the next launch would: its own requests must not fail for it
            logger.exception("sampling a step of %d constrained rows failed", len(rows))
            return _failed(len(rows), logits.device, f"sampling failed: {type(err).__name__}: {err}")

    def __getattr__(self, name: str):
        """SamplerOutput's interface (`sampled`, `token_ids`, `logprobs`, `failures`, ...), from the output."""
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.enqueue(), name)


def _failed(num_rows: int, device: torch.device, message: str) -> SamplerOutput:
    """Every row failed with `message`; their token is 0."""
    failed = SamplerOutput(torch.zeros(num_rows, dtype=torch.int64, device=device), None, [None] * num_rows)
    failed.failures = dict.fromkeys(range(num_rows), message)
    return failed


def enqueue_sampling(sampled) -> None:
    """Enqueue a step's deferred sampling now (nothing for a step sampled at launch, or one without samples)."""
    if isinstance(sampled, DeferredSample):
        sampled.enqueue()
