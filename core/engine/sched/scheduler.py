"""Scheduler: which requests compute how many tokens in the next forward. Python lists and ints only.

Each step (vLLM v1's policy, FCFS):

1. Running requests, oldest first, each get the tokens they are missing (1 for a decode, a
   chunk for a prompt still being computed), within the step's token budget
   (`max_num_batched_tokens`). When the pool has no block for one, the newest running request is
   preempted by recompute: its blocks are freed and it goes back to the front of the waiting queue.
   The oldest request therefore always progresses, so preemption cannot livelock.
2. If nothing was preempted, waiting requests are admitted in order while the budget, the block
   pool and `max_num_seqs` allow, starting from their longest prefix-cache hit. A request that
   needs more blocks than the whole pool holds can never run: it fails alone (waiting for
   blocks that no running request will ever free would spin forever).

So prefill chunks and decodes of different requests share one flat batch.
`update` then advances `num_computed_tokens`, appends sampled tokens and applies the stop rules
that need no text (EOS, stop token ids, max_tokens, max_model_len); stop strings are the
detokenizer's, applied by the engine through `finish_requests`.

Async scheduling (LLMEngine): `schedule` may run again before the previous output is applied.
Each chunk counts its tokens into the request's `num_inflight_tokens` and, if it samples, one
`num_pending_tokens` (Request), and the next schedule starts after them: a request whose step is
in flight decodes its pending token next (its chunk's `last_token_pending`). A request whose pending token already reaches
max_tokens or max_model_len is not scheduled (it finishes when that token is applied, and its
seat in max_num_seqs goes to a waiting request at once); one that stops on a token's value (EOS,
stop ids, stop strings, abort) may be scheduled once more, and `update` skips its chunk.
Preemption keeps the pending token: the request's K/V are dropped
either way, and `update` appends the token as a synchronous step would have, before the
preemption (so seeded requests draw exactly as they would synchronously); it cannot be admitted
again before that, because a schedule that preempts admits nobody and at most one step is in
flight.
"""

from __future__ import annotations

import time
from collections import deque

from deepinfer.core.engine.sched.request import FINISHED_STATUSES, Request, RequestStatus
from deepinfer.core.engine.sched.scheduler_output import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from deepinfer.core.engine.stats import IterationStats
from deepinfer.core.errors import QueueFullError
from deepinfer.core.kv.kv_manager import KVCacheManager


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_waiting_requests: int,
        max_model_len: int,
    ) -> None:
        self.kv = kv_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_waiting_requests = max_waiting_requests
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is preempted first
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.num_preemptions_total = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_room(self, num_requests: int = 1) -> bool:
        """Whether `num_requests` new requests fit in the bounded waiting queue now."""
        return len(self.waiting) + num_requests <= self.max_waiting_requests

    def add_request(self, request: Request) -> None:
        if not self.has_room():
            raise QueueFullError(
                f"the waiting queue is full ({self.max_waiting_requests} requests); retry later")
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.length_limit = min(request.length_limit, self.max_model_len)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        now = time.monotonic()
        kv, add_chunk = self.kv, out.chunks.append
        block_size = kv.block_size

        num_finishing = 0
        running = self.running
        # Preemption pops from the end of `running`, which the iteration then never reaches.
        for request in running:
            if budget <= 0:
                break
            num_tokens = len(request.all_token_ids)
            pending = request.num_pending_tokens
            if pending and num_tokens + pending >= request.length_limit:
                # Its pending token reaches max_tokens or max_model_len: no step after it can be kept.
                num_finishing += 1
                continue
            inflight = request.num_inflight_tokens
            start = request.num_computed_tokens + inflight
            missing = num_tokens + pending - start
            num_new = min(budget, missing)
            table = request.block_table
            if start + num_new > len(table) * block_size:  # by counts: most decode steps need no new block
                # The KV manager counts from the computed tokens; in-flight ones already hold their slots.
                while not kv.allocate_slots(request, inflight + num_new):
                    victim = running.pop()
                    self._preempt(victim)
                    out.preempted.append(victim)
                    if victim is request:
                        break
                if request.status is RequestStatus.PREEMPTED:
                    break  # it was the newest, so nothing after it is left to schedule
            sample = num_new == missing
            add_chunk(ScheduledChunk(request, start, num_new, table, sample, start + num_new > num_tokens,
                                     request.table_row))
            request.num_inflight_tokens = inflight + num_new
            if sample:
                request.num_pending_tokens = pending + 1
            budget -= num_new

        if not out.preempted:
            budget = self._admit_waiting(out, budget, now, num_finishing)
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        out.block_tables = kv.tables.array
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int, now: float, num_finishing: int) -> int:
        """num_finishing: running requests left out of this step because the step in flight samples
        their last token; they finish when it is applied (before the next schedule), so their seats
        are free now."""
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) - num_finishing < self.max_num_seqs:
            request = self.waiting[0]
            if self._waits_for_sibling(request):
                skipped.append(self.waiting.popleft())
                continue
            blocks_needed = self.kv.blocks_needed(request.num_tokens)
            if blocks_needed > self.kv.num_blocks:
                self._finish(request, RequestStatus.FINISHED_ERROR, error=(
                    f"request {request.request_id!r} needs {blocks_needed} KV blocks for its "
                    f"{request.num_tokens} tokens but the whole KV pool has {self.kv.num_blocks}; "
                    f"shorten the prompt or give the KV cache more memory"))
                out.failed.append(request)
                continue
            # A request still scoring its prompt computes every prompt position (core/engine/worker/prompt_logprobs.py).
            cached_blocks = [] if request.scores_prompt else self.kv.find_cached_blocks(request)
            num_cached = len(cached_blocks) * self.kv.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(request, num_new, cached_blocks):
                break
            if self.kv.prefix_cache is not None:
                self.kv.prefix_cache.count_lookup(request.num_tokens, num_cached)
                out.prefix_cache_queries += request.num_tokens
                out.prefix_cache_hits += num_cached
            self.waiting.popleft()
            if request.status is RequestStatus.WAITING:
                request.num_cached_tokens = num_cached
            request.num_computed_tokens = num_cached
            request.max_computed_prompt_tokens = max(request.max_computed_prompt_tokens, num_cached)
            request.status = RequestStatus.RUNNING
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
            self.running.append(request)
            start = request.next_position
            out.chunks.append(self._chunk(request, start, num_new, num_new == request.num_missing_tokens,
                                          request.num_tokens))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _waits_for_sibling(self, request: Request) -> bool:
        """Later samples of an n > 1 request wait until the first sample's prompt blocks are cached."""
        leader = request.wait_for
        if leader is None:
            return False
        if leader.is_finished or leader.max_computed_prompt_tokens >= leader.num_prompt_tokens:
            request.wait_for = None
            return False
        return True

    def _chunk(self, request: Request, start: int, num_new: int, sample: bool, num_tokens: int) -> ScheduledChunk:
        """The chunk of `num_new` tokens from position `start` (the running loop above does the same
        inline); `sample`: it reaches the last token."""
        chunk = ScheduledChunk(request, start, num_new, request.block_table, sample, start + num_new > num_tokens,
                               request.table_row)
        request.num_inflight_tokens += num_new
        if sample:
            request.num_pending_tokens += 1
        return chunk

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_inflight_tokens = 0  # its in-flight K/V are dropped; a pending token is still applied
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    def update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
               stats: IterationStats | None = None) -> list[Request]:
        """Apply a finished forward: advance computed tokens, append sampled ones, stop finished requests.
        Returns the requests that got a new token, in chunk order. A chunk of a request finished since
        it was scheduled is skipped; one of a request preempted since only appends its sampled token.
        `stats` gets the prompt tokens computed for the first time."""
        sampled: list[Request] = []
        finished = False
        tokens, logprobs = runner_output.sampled_token_ids, runner_output.logprobs
        prompt_logprobs = runner_output.prompt_logprobs
        kv, running, new_prompt_tokens = self.kv, RequestStatus.RUNNING, 0
        append = sampled.append
        for chunk in scheduler_output.chunks:
            request = chunk.request
            status = request.status
            if status in FINISHED_STATUSES:
                continue
            num_tokens = chunk.num_tokens
            if chunk.start_pos < len(request.prompt_token_ids):  # the chunk computes prompt positions
                # A preempted request's K/V are gone, but its prompt tokens were computed (stats count them
                # once, as a synchronous step would have before the preemption).
                computed_prompt = min(chunk.start_pos + num_tokens, len(request.prompt_token_ids))
                if computed_prompt > request.max_computed_prompt_tokens:
                    new_prompt_tokens += computed_prompt - request.max_computed_prompt_tokens
                    request.max_computed_prompt_tokens = computed_prompt
                if status is running:
                    request.num_inflight_tokens -= num_tokens
                    request.num_computed_tokens += num_tokens
                    kv.cache_computed_blocks(request)
            elif status is running:  # past the prompt no new full prompt block can be cached
                request.num_inflight_tokens -= num_tokens
                request.num_computed_tokens += num_tokens
            if prompt_logprobs and request.request_id in prompt_logprobs:
                _extend_prompt_logprobs(request, *prompt_logprobs[request.request_id])
            if not chunk.sample:
                continue
            request.num_pending_tokens -= 1
            request_id = request.request_id
            token_id = tokens[request_id]
            request.output_token_ids.append(token_id)
            all_token_ids = request.all_token_ids
            all_token_ids.append(token_id)
            if request.logprobs is not None:
                request.logprobs.append(logprobs[request_id])
            # The stop rules that need no text: EOS, a stop token, max_tokens or max_model_len (Request's two
            # precomputed fields make that one set test and one comparison).
            if token_id in request.ending_token_ids or len(all_token_ids) >= request.length_limit:
                self._finish_on_token(request, token_id)
                finished = True
            append(request)
        if finished:
            self.running = [request for request in self.running if not request.is_finished]
        if stats is not None:
            stats.num_prompt_tokens += new_prompt_tokens
        return sampled

    def _finish_on_token(self, request: Request, token_id: int) -> None:
        """Finish a request its new token ends, by the first rule that holds: EOS, a stop token (its
        stop reason), max_tokens or max_model_len. It stays in `running` until `update` filters it out."""
        if token_id in request.ending_token_ids:
            if request.params.ignore_eos or token_id not in request.eos_token_ids:
                request.stop_reason = token_id
            self._finish(request, RequestStatus.FINISHED_STOPPED, remove_from_running=False)
        else:
            self._finish(request, RequestStatus.FINISHED_LENGTH, remove_from_running=False)

    def finish_requests(
        self, request_ids: list[str], status: RequestStatus, error: str | None = None,
        stop_reason: str | int | None = None,
    ) -> list[Request]:
        """Finish unfinished requests now (abort, stop string, error) and free their blocks.
        Unknown or already finished ids are ignored; returns the requests it finished."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if stop_reason is not None:
                request.stop_reason = stop_reason
            self._finish(request, status, error=error)
            finished.append(request)
        return finished

    def _finish(self, request: Request, status: RequestStatus, error: str | None = None,
                remove_from_running: bool = True) -> None:
        if request.status is RequestStatus.RUNNING:
            if remove_from_running:
                self.running.remove(request)
        elif not request.is_finished:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = status
        request.error = error
        request.metrics.finished_time = time.monotonic()
        self.requests.pop(request.request_id, None)

    def check_invariants(self) -> None:
        """Scheduler and KV state agree. O(requests + blocks): for tests and debugging."""
        self.kv.check_invariants()
        assert len(self.running) <= self.max_num_seqs, "more running requests than max_num_seqs"
        assert all(r.status is RequestStatus.RUNNING for r in self.running), "a non-running request runs"
        assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in self.waiting)
        assert len(self.running) + len(self.waiting) == len(self.requests), "a request is lost or duplicated"
        for request in self.waiting:
            assert not self.kv.block_table(request.request_id), f"waiting {request} holds blocks"
            assert request.block_table is None and request.table_row is None, f"waiting {request} keeps a table"
            assert request.num_inflight_tokens == request.num_pending_tokens == 0, f"{request} waits in flight"
        for request in self.running:
            table = self.kv.block_table(request.request_id)
            assert request.block_table is table and request.table_row is not None, f"{request}'s table is stale"
            assert len(table) >= self.kv.blocks_needed(request.next_position), f"{request} lacks blocks"
            assert request.num_pending_tokens <= 1, f"{request} has more than one step in flight"
            assert request.num_missing_tokens >= 0, f"{request} is scheduled past its tokens"


def _extend_prompt_logprobs(request: Request, first: int, entries: list) -> None:
    """Append a chunk's prompt logprobs (those of prompt tokens first, first + 1, ...) that the request lacks:
    a chunk recomputed after a preemption scores positions it has already."""
    have = len(request.prompt_logprobs)
    if first > have:
        raise RuntimeError(f"request {request.request_id!r}: prompt logprobs from token {first} arrived "
                           f"with only {have} before them")
    request.prompt_logprobs += entries[have - first:]
