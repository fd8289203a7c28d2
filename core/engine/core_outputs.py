"""What an engine core in its own process reports per step, and how the front end applies it.

The core (core/engine/sched/core_process.py) sends, per step, plain lists, no object per token:

    sample_ids, token_ids   the samples the step gave a token (one each) and those tokens, in order
    logprobs                None, or per sampled sample its TokenLogprob (None where not asked for)
    starts                  [(sample id, first scheduled time, prompt tokens the prefix cache served, prompt
                            logprobs or None)] of the samples whose first token this is, or that finished
                            before any (a request scoring its prompt has scored it all by then)
    finishes                [(sample id, finish reason, stop reason, error, finished time)] of the samples
                            the core finished (EOS, stop token, max_tokens, abort, error)

Times are time.monotonic(), one clock for every process of the machine.

The front end (core/engine/frontend/core_client.py) keeps its own Request per sample, the view of the
core's one that the OutputProcessor reads (the same processor the in-process engine runs), and
`apply_core_outputs` brings those up to date. A sample the front end has finished already (a stop
string or a detokenization error it found, which it then tells the core) takes no more tokens: those
the core computed before it heard are discarded, as the in-process engine discards the step in
flight's token of a request that finished.
"""

from __future__ import annotations

from deepinfer.core.engine.sched.request import FINISHED_STATUSES, Request, RequestStatus


def core_outputs(sampled: list[Request], touched: list[Request]) -> tuple:
    """(sample_ids, token_ids, logprobs, starts, finishes) of one core step: `sampled` got a token each,
    `touched` holds them and every sample the step (or an abort) finished."""
    sample_ids = [request.request_id for request in sampled]
    token_ids = [request.output_token_ids[-1] for request in sampled]
    logprobs = None
    if any(request.logprobs is not None for request in sampled):
        logprobs = [None if request.logprobs is None else request.logprobs[-1] for request in sampled]
    starts = [_start(request) for request in sampled if len(request.output_token_ids) == 1]
    finishes = []
    for request in dict.fromkeys(request for request in touched if request.status in FINISHED_STATUSES):
        if not request.output_token_ids:
            starts.append(_start(request))
        finishes.append((request.request_id, request.status.value, request.stop_reason, request.error,
                         request.metrics.finished_time))
    return sample_ids, token_ids, logprobs, starts, finishes


def _start(request: Request) -> tuple:
    return (request.request_id, request.metrics.first_scheduled_time, request.num_cached_tokens,
            request.prompt_logprobs)


def apply_core_outputs(outputs: tuple, samples: dict[str, Request]) -> tuple[list[Request], list[Request], int]:
    """Apply one core step's `core_outputs` to the front end's samples (`samples`: by sample id).
    -> (the samples that got a token, the samples touched, tokens discarded: of samples already finished)."""
    sample_ids, token_ids, logprobs, starts, finishes = outputs
    for sample_id, first_scheduled_time, num_cached_tokens, prompt_logprobs in starts:
        sample = samples.get(sample_id)
        if sample is not None:
            sample.metrics.first_scheduled_time, sample.num_cached_tokens = first_scheduled_time, num_cached_tokens
            if prompt_logprobs is not None:
                sample.prompt_logprobs = prompt_logprobs
    sampled, discarded, finished = [], 0, FINISHED_STATUSES
    for index, (sample_id, token_id) in enumerate(zip(sample_ids, token_ids)):
        sample = samples.get(sample_id)
        if sample is None or sample.status in finished:
            discarded += 1
            continue
        sample.output_token_ids.append(token_id)
        if logprobs is not None and sample.logprobs is not None:
            sample.logprobs.append(logprobs[index])
        sampled.append(sample)
    touched = list(sampled)
    for sample_id, reason, stop_reason, error, finished_time in finishes:
        sample = samples.get(sample_id)
        if sample is None or sample.status in finished:
            continue
        sample.status, sample.stop_reason, sample.error = RequestStatus(reason), stop_reason, error
        sample.metrics.finished_time = finished_time
        touched.append(sample)
    return sampled, touched, discarded


def finish_sample(sample: Request, status: RequestStatus, finished_time: float, stop_reason: str | int | None = None,
                  error: str | None = None) -> None:
    """Finish the front end's view of a sample (a stop string or a detokenization error found there)."""
    sample.status, sample.stop_reason, sample.error = status, stop_reason, error
    sample.metrics.finished_time = finished_time
