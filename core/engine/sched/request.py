"""Request: one sequence the scheduler moves from the waiting queue to finished.

There is no prefill phase: a request is `num_computed_tokens` catching up to `num_tokens`
(prompt + generated). A step computes some of the missing tokens; when it reaches the last one,
the logits of that token are sampled and the new token is appended. Preemption drops the computed
K/V (`num_computed_tokens = 0`) and the same loop recomputes prompt and generated tokens.

With async scheduling the next step is scheduled while the previous one still runs, so two counts
cover what is launched but not yet applied: `num_inflight_tokens` (positions a launched step
computes) and `num_pending_tokens` (tokens it samples, whose values the host does not know yet;
the next step reads them on the device). `num_computed_tokens` and the token lists change only
when a step is applied (Scheduler.update), so the prefix cache hashes only known tokens.

With `SamplingParams.n > 1` the engine makes n Requests (`sample_index` 0..n-1) sharing one
`parent_id`; the later siblings wait for the first one's prompt blocks to land in the prefix cache
(`wait_for`), so they share those blocks instead of computing them again.
"""

from __future__ import annotations

import enum
import time
from dataclasses import replace
from typing import Any

from deepinfer.core.engine.frontend.outputs import RequestMetrics, TokenLogprob
from deepinfer.core.engine.sampling_params import SamplingParams
from deepinfer.core.engine.worker.token_counts import TokenCounts


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, K/V dropped
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    # Members are singletons: identity hashing keeps set lookups (several per token) out of Python code.
    __hash__ = object.__hash__

    @property
    def finished(self) -> bool:
        return self in FINISHED_STATUSES


FINISHED_STATUSES = frozenset((RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                               RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR))


class Request:
    # Slots: the engine reads these fields a few times per request and step (attribute access without a dict).
    __slots__ = ("all_token_ids", "block_hashes", "block_table", "cache_salt", "ending_token_ids", "eos_token_ids",
                 "error", "generator", "grammar", "length_limit", "logprobs", "max_computed_prompt_tokens",
                 "metrics", "num_cached_tokens", "num_computed_tokens", "num_inflight_tokens", "num_pending_tokens",
                 "num_preemptions", "output_token_ids", "params", "parent_id", "prompt_logprobs", "prompt_token_ids",
                 "request_id", "sample_index", "sampling_row", "status", "stop_reason", "table_row", "token_counts",
                 "wait_for")

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        eos_token_ids: frozenset[int] = frozenset(),
        cache_salt: str | None = None,
        parent_id: str | None = None,
        sample_index: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.parent_id = parent_id if parent_id is not None else request_id
        self.sample_index = sample_index
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        # The ids whose sampling stops it (EOS unless ignored, and the stop ids): one set test per token.
        self.ending_token_ids = params.stop_token_ids | (frozenset() if params.ignore_eos else eos_token_ids)
        # Its token count at which it finishes on length: max_tokens outputs (the scheduler lowers it to
        # max_model_len when the request is added), so one comparison per step checks both.
        self.length_limit = len(prompt_token_ids) + params.max_tokens
        self.cache_salt = cache_salt
        self.all_token_ids: list[int] = list(prompt_token_ids)  # prompt + output, what the model computes
        self.output_token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        # Prompt token i's logprob at index i, the first None; grows as chunks are applied. The request's
        # samples share one prompt, so only the first sample scores it.
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] if params.prompt_logprobs is not None and sample_index == 0 else None)
        self.num_computed_tokens = 0  # K/V computed by applied steps
        self.num_inflight_tokens = 0  # positions after those that launched, unapplied steps compute
        self.num_pending_tokens = 0  # tokens launched steps sample, not appended yet (0, 1; 2 briefly)
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first schedule
        self.max_computed_prompt_tokens = 0  # high-water mark, so recomputed prompt tokens are counted once
        self.block_hashes: list[int] = []  # chained hashes of the full prompt blocks, set by the KV manager
        # Set by the KV manager while it holds blocks: its block table (the manager's own list) and that
        # table's row in the manager's BlockTableArray; None otherwise.
        self.block_table: list[int] | None = None
        self.table_row: int | None = None
        self.status = RequestStatus.WAITING
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.num_preemptions = 0
        self.wait_for: Request | None = None  # sibling whose prompt blocks this one waits to share
        self.generator: Any = None  # torch.Generator of a seeded request; kept across preemption
        self.grammar: Any = None  # core.structured.matcher.RequestGrammar of a constrained request
        self.sampling_row: Any = None  # its core.engine.worker.sampler.SamplingRow, made once by the model runner
        self.token_counts = TokenCounts()  # on the device, for penalties (filled when first sampled)
        self.metrics = RequestMetrics(arrival_time=time.monotonic() if arrival_time is None else arrival_time)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def next_position(self) -> int:
        """The first position no step has computed or is computing."""
        return self.num_computed_tokens + self.num_inflight_tokens

    @property
    def num_missing_tokens(self) -> int:
        """Positions still to compute, counting the pending tokens (placed after the known ones)."""
        return self.num_tokens + self.num_pending_tokens - self.next_position

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def scores_prompt(self) -> bool:
        """Whether prompt logprobs are asked for and some are still to compute (no prefix-cache hit may skip them)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED_STATUSES

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, computed={self.num_computed_tokens}/"
                f"{self.num_tokens}, prompt={self.num_prompt_tokens})")


def make_samples(request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                 eos_token_ids: frozenset[int], cache_salt: str | None, arrival_time: float) -> list[Request]:
    """The `params.n` Requests of one user request: sample i is `request_id` when n is 1, else
    `request_id#i`, seeded `seed + i` (vLLM: each sample its own seed). The engine core schedules
    these; the front end of an engine in its own process keeps the same ones as its view of the core's."""
    samples = []
    for index in range(params.n):
        sample_params = params
        if params.n > 1 and params.seed is not None:
            sample_params = replace(params, seed=params.seed + index)
        sample_id = request_id if params.n == 1 else f"{request_id}#{index}"
        samples.append(Request(sample_id, prompt_token_ids, sample_params, eos_token_ids=eos_token_ids,
                               cache_salt=cache_salt, parent_id=request_id, sample_index=index,
                               arrival_time=arrival_time))
    return samples
