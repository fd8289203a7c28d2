"""Prompt logprobs: the log-probability of each prompt token given the tokens before it.

A request whose params set `prompt_logprobs` (vLLM's field, what lm-evaluation-harness's
loglikelihood tasks read through completions' `echo` + `logprobs`) gets, for prompt token i >= 1,
its logprob, its rank and the top `prompt_logprobs` alternatives under the logits of position i - 1.
The rows are those of the step's forward: a prefill chunk over positions [s, e) gives the targets
s + 1 .. min(e, P - 1) (P: prompt length; position P - 1's logits are the sampler's, not a prompt
token's), so a chunked prefill gathers its logprobs chunk by chunk. They are computed as the sampler
computes its logprobs: fp32 `log_softmax` of the head's logits (before temperature and penalties).

A prefix-cache hit would skip the positions whose logits are needed, so the scheduler gives such a
request no hit until its prompt logprobs are complete (core/engine/sched/scheduler.py); a request
recomputed after preemption gathers its positions again and the scheduler keeps the first copy.

The head runs over at most HEAD_ROWS rows at a time: a 2048-token chunk of a 152k vocabulary would
otherwise hold 1.2 GB of fp32 logits at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

import torch

from deepinfer.core.engine.frontend.outputs import TokenLogprob
from deepinfer.core.engine.sched.scheduler_output import ScheduledChunk
from deepinfer.core.engine.worker.transfers import HostCopy, to_device

_asks_prompt_logprobs = attrgetter("request.prompt_logprobs")  # a list (truthy) when asked for, else None

HEAD_ROWS = 256


@dataclass
class PromptSpan:
    """One chunk's share: hidden rows [row, row + count) give prompt tokens first .. first + count - 1."""

    request_id: str
    row: int  # first hidden row of the span in the step's flat batch
    first: int  # index in the prompt of the first token scored
    count: int


def prompt_spans(ordered_chunks: list[ScheduledChunk]) -> list[PromptSpan]:
    """The spans of the chunks (in the order the step's rows are laid out) that score prompt tokens."""
    spans, row = [], 0
    for chunk in ordered_chunks:
        request = chunk.request
        if request.scores_prompt:
            end = min(chunk.start_pos + chunk.num_tokens, request.num_prompt_tokens - 1)
            if end > chunk.start_pos:
                spans.append(PromptSpan(request.request_id, row, chunk.start_pos + 1, end - chunk.start_pos))
        row += chunk.num_tokens
    return spans


def wants_prompt_logprobs(chunks: list[ScheduledChunk]) -> bool:
    """Whether a chunk of the step scores prompt tokens (such a step needs every hidden row: it runs eagerly)."""
    if not any(map(_asks_prompt_logprobs, chunks)):  # in C: most steps have no such request
        return False
    return any(chunk.request.scores_prompt and chunk.start_pos < chunk.request.num_prompt_tokens - 1 for chunk in chunks)


class PromptLogprobs:
    """The prompt logprobs of one step's spans, copied to the host in the background."""

    def __init__(self, spans: list[PromptSpan], table: torch.Tensor, num_top: list[int]) -> None:
        """table: [R, 3 + 2K] float64, R = the spans' rows (see `prompt_logprob_table`); num_top: per span."""
        self.spans = spans
        self._num_top = num_top
        self._copy = HostCopy([table])

    def by_request(self) -> dict[str, tuple[int, list[TokenLogprob]]]:
        """request id -> (index of the first prompt token scored, its entries). Waits for the copy."""
        table = self._copy.get()[0].tolist()
        max_top = (len(table[0]) - 3) // 2 if table else 0
        out, at = {}, 0
        for span, num_top in zip(self.spans, self._num_top):
            entries = []
            for values in table[at:at + span.count]:
                top = [(int(values[3 + max_top + j]), values[3 + j]) for j in range(num_top)]
                entries.append(TokenLogprob(token_id=int(values[0]), logprob=values[1], top=top, rank=int(values[2])))
            out[span.request_id] = (span.first, entries)
            at += span.count
        return out


def gather_prompt_logprobs(model, hidden: torch.Tensor, ordered_chunks: list[ScheduledChunk]) -> PromptLogprobs | None:
    """hidden: [T, hidden] the step's last hidden states, rows laid out in `ordered_chunks` order.
    None when no chunk scores prompt tokens."""
    spans = prompt_spans(ordered_chunks)
    if not spans:
        return None
    requests = {chunk.request.request_id: chunk.request for chunk in ordered_chunks}
    rows, targets, num_top = [], [], []
    for span in spans:
        request = requests[span.request_id]
        rows += range(span.row, span.row + span.count)
        targets += request.prompt_token_ids[span.first:span.first + span.count]
        num_top.append(request.params.prompt_logprobs)
    device = hidden.device
    rows_t = to_device(rows, torch.int64, device)  # [R]
    targets_t = to_device(targets, torch.int64, device)  # [R]
    max_top = max(num_top)
    parts = []
    for start in range(0, len(rows), HEAD_ROWS):
        index = rows_t[start:start + HEAD_ROWS]
        logprobs = torch.log_softmax(model.compute_logits(hidden.index_select(0, index)).float(), dim=-1)
        parts.append(prompt_logprob_table(logprobs, targets_t[start:start + HEAD_ROWS], max_top))
    return PromptLogprobs(spans, torch.cat(parts) if len(parts) > 1 else parts[0], num_top)


def prompt_logprob_table(logprobs: torch.Tensor, targets: torch.Tensor, max_top: int) -> torch.Tensor:
    """logprobs [R, V], targets [R] -> [R, 3 + 2 * max_top] float64 rows: target id, its logprob, its rank
    (1 + the tokens more likely than it), the top max_top logprobs (best first), their ids."""
    chosen = logprobs.gather(1, targets[:, None])  # [R, 1]
    rank = (logprobs > chosen).sum(dim=-1, keepdim=True) + 1  # [R, 1]
    top_values, top_ids = logprobs.topk(max_top, dim=-1)  # [R, K]
    return torch.cat([t.double() for t in (targets[:, None], chosen, rank, top_values, top_ids)], dim=1)
