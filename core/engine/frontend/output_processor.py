"""OutputProcessor: sampled tokens -> text deltas, stop strings, RequestOutputs and token timings.

One RequestGroup per user request: its `n` samples are separate scheduler Requests, each with an
IncrementalDetokenizer. The detokenizer finds stop strings (the scheduler applies the token
rules, EOS / stop token ids / max_tokens, and finishes the request itself); the engine finishes a
request whose stop string appeared. Every RequestOutput is a snapshot: cumulative fields plus
the deltas since the previous snapshot of that request.

A snapshot costs O(1) per sample, not O(output length): the delta lists are handed over (the live
completion starts new ones), and the cumulative `token_ids` / `logprobs` are copied out of the
sample's append-only lists, and `text` joined from its detokenizer's deltas, only if someone reads
them (`CompletionSnapshot`). Streams read deltas. A token costs the same at the 10th and the 10,000th:
no per-token work grows with the text (the live completion keeps no joined text).

Timings go into the step's IterationStats exactly once: a TTFT (and the request's prompt tokens)
when the group's first token arrives, an inter-token latency for every later token of each sample,
and one FinishedRequestStats when the whole group is done.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from deepinfer.core.engine.frontend.detokenizer import IncrementalDetokenizer, prepare_tables
from deepinfer.core.engine.frontend.outputs import CompletionOutput, RequestMetrics, RequestOutput
from deepinfer.core.engine.sampling_params import SamplingParams
from deepinfer.core.engine.sched.request import FINISHED_STATUSES, Request, RequestStatus
from deepinfer.core.engine.stats import FinishedRequestStats, IterationStats

logger = logging.getLogger(__name__)


class _PrefixOnRead:
    """A snapshot attribute that reads as the first `_num_tokens` entries of a live, append-only
    list (`_live_<name>`, or None), copied on first read and kept; assigning replaces it."""

    def __set_name__(self, owner, name: str) -> None:
        self.name, self.live_name = name, f"_live_{name}"

    def __get__(self, snapshot, owner=None):
        if snapshot is None:
            return self
        values = snapshot.__dict__
        if self.name not in values:
            live = values[self.live_name]
            values[self.name] = None if live is None else live[:values["_num_tokens"]]
        return values[self.name]

    def __set__(self, snapshot, value) -> None:
        snapshot.__dict__[self.name] = value


class _JoinOnRead:
    """The snapshot's `text`: the first `_num_pieces` of the detokenizer's append-only list of deltas,
    joined on first read and kept (streams read only `delta_text`); assigning replaces it."""

    def __get__(self, snapshot, owner=None):
        if snapshot is None:
            return self
        values = snapshot.__dict__
        if "text" not in values:
            values["text"] = "".join(values["_live_pieces"][:values["_num_pieces"]])
        return values["text"]

    def __set__(self, snapshot, value) -> None:
        snapshot.__dict__["text"] = value


class CompletionSnapshot(CompletionOutput):
    """A CompletionOutput as of one step. `token_ids` and `logprobs` are the first `num_tokens`
    entries of the live completion's lists (which only ever grow), `text` the join of the first deltas
    the detokenizer streamed; each is made on first read."""

    token_ids = _PrefixOnRead()
    logprobs = _PrefixOnRead()
    text = _JoinOnRead()

    def __init__(self, live: CompletionOutput, pieces: list[str]) -> None:  # every field except the lazy ones
        self.__dict__ = {  # one dict display: cheaper than update(**fields), once per request and step
            "index": live.index, "finish_reason": live.finish_reason,
            "stop_reason": live.stop_reason, "delta_text": live.delta_text, "delta_token_ids": live.delta_token_ids,
            "delta_logprobs": live.delta_logprobs, "_live_token_ids": live.token_ids,
            "_live_logprobs": live.logprobs, "_num_tokens": len(live.token_ids),
            "_live_pieces": pieces, "_num_pieces": len(pieces)}


@dataclass
class RequestGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[Request]  # index i is sample i
    detokenizers: list[IncrementalDetokenizer] = field(default_factory=list)
    completions: list[CompletionOutput] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.completions:
            want_logprobs = self.params.logprobs is not None
            self.completions = [CompletionOutput(index=i, logprobs=[] if want_logprobs else None)
                                for i in range(len(self.samples))]

    @property
    def finished(self) -> bool:
        return all(sample.is_finished for sample in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        prepare_tables(tokenizer)
        self.groups: dict[str, RequestGroup] = {}
        # sample's request id -> (its group, its live completion, its detokenizer): one lookup per token
        self._samples: dict[str, tuple[RequestGroup, CompletionOutput, IncrementalDetokenizer]] = {}
        self.samples: dict[str, Request] = {}  # sample's request id -> its Request, while its group is open

    def add(self, group: RequestGroup) -> None:
        group.detokenizers = [IncrementalDetokenizer(self.tokenizer, group.prompt_token_ids, group.params,
                                                     set(sample.eos_token_ids)) for sample in group.samples]
        self.groups[group.request_id] = group
        for sample, completion, detokenizer in zip(group.samples, group.completions, group.detokenizers):
            self._samples[sample.request_id] = (group, completion, detokenizer)
            self.samples[sample.request_id] = sample

    def remove(self, request_id: str) -> None:
        """Forget a request that never ran (the engine refused it)."""
        group = self.groups.pop(request_id, None)
        for sample in group.samples if group is not None else ():
            self._samples.pop(sample.request_id, None)
            self.samples.pop(sample.request_id, None)

    def append_tokens(
        self, sampled: list[Request], stats: IterationStats
    ) -> tuple[list[tuple[Request, str]], list[tuple[Request, str]]]:
        """Detokenize each request's newest token. Returns (requests whose stop string appeared, with it)
        and (requests whose detokenization failed, with the error); the engine finishes both."""
        now = time.monotonic()
        stopped, failed = [], []
        samples, inter_token_latency = self._samples, stats.inter_token_latencies_s.append
        for request in sampled:
            group, completion, detokenizer = samples[request.request_id]
            token_id = request.output_token_ids[-1]
            completion.token_ids.append(token_id)
            completion.delta_token_ids.append(token_id)
            if completion.logprobs is not None:
                completion.logprobs.append(request.logprobs[-1])
                completion.delta_logprobs = (completion.delta_logprobs or []) + [request.logprobs[-1]]
            metrics = request.metrics
            if metrics.first_token_time is not None:
                inter_token_latency(now - metrics.last_token_time)
            else:
                metrics.first_token_time = now
                if not any(s.metrics.first_token_time is not None for s in group.samples if s is not request):
                    # The request's first token, of any sample: counted once per request, like its finish.
                    stats.time_to_first_tokens_s.append(now - metrics.arrival_time)
                    stats.request_prompt_tokens += len(group.prompt_token_ids)
                    stats.request_cached_tokens += request.num_cached_tokens
            metrics.last_token_time = now
            try:
                delta_text = detokenizer.append_text(token_id)
            except Exception as err:  # one request's decoding error fails that request only
                logger.exception("detokenizing request %s failed", request.request_id)
                failed.append((request, f"detokenization failed: {type(err).__name__}: {err}"))
                continue
            if delta_text:
                # The live completion's text is the detokenizer's deltas, joined when a snapshot's is read.
                completion.delta_text += delta_text
            if detokenizer.finish_reason is not None and isinstance(detokenizer.stop_reason, str):
                if not request.is_finished:
                    stopped.append((request, detokenizer.stop_reason))
                elif request.status is RequestStatus.FINISHED_LENGTH:  # the last token also completed a stop
                    request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, detokenizer.stop_reason
        return stopped, failed

    def make_outputs(self, requests: list[Request], stats: IterationStats) -> list[RequestOutput]:
        """A snapshot for each group that one of `requests` belongs to; finished groups are dropped."""
        outputs = []
        groups = self.groups
        for parent_id in dict.fromkeys([request.parent_id for request in requests]):
            group = groups.get(parent_id)
            if group is None:
                continue
            samples, completions = group.samples, group.completions
            if len(samples) == 1:  # most requests: the group's one sample, without the loops
                sample, completion = samples[0], completions[0]
                finished = sample.status in FINISHED_STATUSES
                completion.finish_reason = sample.status.value if finished else None
                completion.stop_reason = sample.stop_reason
                metrics = sample.metrics
                outputs.append(RequestOutput(
                    group.request_id, group.prompt, group.prompt_token_ids,
                    [CompletionSnapshot(completion, group.detokenizers[0].pieces)],
                    finished, sample.num_cached_tokens,
                    RequestMetrics(metrics.arrival_time, metrics.first_scheduled_time, metrics.first_token_time,
                                   metrics.last_token_time, metrics.finished_time if finished else None),
                    sample.error, sample.prompt_logprobs))
                # The snapshot took the delta lists.
                completion.delta_text, completion.delta_token_ids, completion.delta_logprobs = "", [], None
            else:
                finished = True
                for sample, completion in zip(samples, completions):
                    if sample.status in FINISHED_STATUSES:
                        completion.finish_reason = sample.status.value
                    else:
                        completion.finish_reason, finished = None, False
                    completion.stop_reason = sample.stop_reason
                outputs.append(self._snapshot(group, finished))
                for completion in completions:  # the snapshot took the delta lists
                    completion.delta_text, completion.delta_token_ids, completion.delta_logprobs = "", [], None
            if finished:
                del groups[parent_id]
                for sample in samples:
                    self._samples.pop(sample.request_id, None)
                    self.samples.pop(sample.request_id, None)
                stats.finished_requests.append(_finished_stats(group))
        return outputs

    def _snapshot(self, group: RequestGroup, finished: bool) -> RequestOutput:
        """The snapshot of a group of several samples."""
        samples = group.samples
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=[CompletionSnapshot(c, d.pieces) for c, d in zip(group.completions, group.detokenizers)],
            finished=finished,
            num_cached_tokens=max(s.num_cached_tokens for s in samples),
            metrics=_group_metrics(samples),
            error=next((s.error for s in samples if s.error), None),
            prompt_logprobs=samples[0].prompt_logprobs,
        )


def _earliest(values):
    values = [v for v in values if v is not None]
    return min(values) if values else None


def _latest(values):
    values = [v for v in values if v is not None]
    return max(values) if values else None


def _group_metrics(samples: list[Request]) -> RequestMetrics:
    if len(samples) == 1:
        metrics = samples[0].metrics
        return RequestMetrics(metrics.arrival_time, metrics.first_scheduled_time, metrics.first_token_time,
                              metrics.last_token_time, metrics.finished_time if samples[0].is_finished else None)
    metrics = [s.metrics for s in samples]
    finished = all(s.is_finished for s in samples)
    return RequestMetrics(
        arrival_time=metrics[0].arrival_time,
        first_scheduled_time=_earliest(m.first_scheduled_time for m in metrics),
        first_token_time=_earliest(m.first_token_time for m in metrics),
        last_token_time=_latest(m.last_token_time for m in metrics),
        finished_time=_latest(m.finished_time for m in metrics) if finished else None,
    )


def _finished_stats(group: RequestGroup) -> FinishedRequestStats:
    metrics = _group_metrics(group.samples)
    end = metrics.finished_time if metrics.finished_time is not None else time.monotonic()
    return FinishedRequestStats(
        finish_reason=group.samples[0].finish_reason,
        num_prompt_tokens=len(group.prompt_token_ids),
        num_generation_tokens=sum(s.num_output_tokens for s in group.samples),
        e2e_latency_s=end - metrics.arrival_time,
        ttft_s=None if metrics.first_token_time is None else metrics.first_token_time - metrics.arrival_time,
        queue_time_s=(None if metrics.first_scheduled_time is None
                      else metrics.first_scheduled_time - metrics.arrival_time),
    )
