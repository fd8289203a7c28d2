"""The plain-data contract between the scheduler and the model runner, both ways.

SchedulerOutput says which requests compute which tokens this step; the runner turns it into
tensors. ModelRunnerOutput carries back the sampled token of each request that sampled.
Neither holds a tensor; SchedulerOutput holds the KV manager's block-table array (numpy), so the
stager gathers a step's tables in one operation instead of converting one list per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from deepinfer.core.engine.frontend.outputs import TokenLogprob
from deepinfer.core.engine.sched.request import Request


@dataclass(slots=True)
class ScheduledChunk:
    request: Request
    start_pos: int  # first position computed this step (the request's num_computed_tokens before it)
    num_tokens: int  # how many tokens it computes this step (1 for a decode)
    block_table: list[int]  # the request's whole block table, covering start_pos + num_tokens positions
    sample: bool  # the chunk reaches the request's last token, so that token's logits are sampled
    # Its last input token is the one the step in flight samples (async scheduling): on the device, not
    # on the host yet, so it is not in `token_ids`; the runner fills it on the device.
    last_token_pending: bool = False
    # Its block table's row in the step's `SchedulerOutput.block_tables` (the KV manager's array); None for
    # chunks built by hand, whose stager reads `block_table`.
    table_row: int | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def token_ids(self) -> list[int]:
        """The input tokens the host knows: all of them, or all but the pending last one."""
        end = self.start_pos + self.num_tokens - self.last_token_pending
        return self.request.all_token_ids[self.start_pos:end]

    @property
    def seq_len(self) -> int:
        """Context length after this step's tokens."""
        return self.start_pos + self.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # in running order; the runner reorders
    num_batched_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)  # requests that can never fit, failed here
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache this step
    prefix_cache_hits: int = 0
    # The KV manager's block tables as of this schedule, [rows, width] int32 (row `chunk.table_row` holds a
    # chunk's table, zero past it); read by the step's stager before the next schedule. None for hand-built steps.
    block_tables: np.ndarray | None = None

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)  # request_id -> token (sampling chunks)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)  # for requests that asked for logprobs
    # request_id -> (index of the first prompt token scored, entries), for chunks that score prompt tokens
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
