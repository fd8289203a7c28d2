"""What an engine core in its own process reports per step, and how the front end applies it.

The core (core/engine/sched/core_process.py) sends, per sample a step gave a token or finished, one
record, plain data only:

    (sample id, new token ids, their logprobs or None, start or None, finish or None)
    start:  (first scheduled time, prompt tokens the prefix cache served), with the sample's first record
    finish: (finish reason, stop reason, error, finished time), when the core finished the sample
            (EOS, stop token, max_tokens, abort, error)

Times are time.monotonic(), one clock for every process of the machine. `sent` holds how many of a
sample's tokens have gone out, so each token crosses exactly once whatever the step touched twice.

The front end (core/engine/frontend/core_client.py) keeps its own Request per sample, the view of the
core's one that the OutputProcessor reads (the same processor the in-process engine runs), and
`apply_records` brings those up to date. A sample the front end has finished already (a stop string
or a detokenization error it found, which it then tells the core) takes no more tokens: those the core
computed before it heard are discarded, as the in-process engine discards the step in flight's token
of a request that finished.
"""

from __future__ import annotations

from collections.abc import Iterable

from deepinfer.core.engine.sched.request import FINISHED_STATUSES, Request, RequestStatus


def core_records(requests: Iterable[Request], sent: dict[str, int]) -> list[tuple]:
    """The records of `requests` (the core's samples), each once; `sent` is updated (finished samples leave)."""
    records = []
    for request in dict.fromkeys(requests):
        sample_id = request.request_id
        first = sent.get(sample_id, 0)
        tokens = request.output_token_ids[first:]
        logprobs = request.logprobs[first:] if request.logprobs is not None else None
        finish = None
        if request.status in FINISHED_STATUSES:
            sent.pop(sample_id, None)
            finish = (request.status.value, request.stop_reason, request.error, request.metrics.finished_time)
        else:
            sent[sample_id] = first + len(tokens)
        start = (request.metrics.first_scheduled_time, request.num_cached_tokens) if first == 0 else None
        records.append((sample_id, tokens, logprobs, start, finish))
    return records


def apply_records(records: list[tuple], samples: dict[str, Request]) -> tuple[list[Request], list[Request], int]:
    """Apply the core's records to the front end's samples (`samples`: by sample id).
    -> (the samples that got a token, the samples touched, tokens discarded: of samples already finished)."""
    sampled, touched, discarded = [], [], 0
    for sample_id, tokens, logprobs, start, finish in records:
        sample = samples.get(sample_id)
        if sample is None or sample.status in FINISHED_STATUSES:
            discarded += len(tokens)
            continue
        if start is not None:
            sample.metrics.first_scheduled_time, sample.num_cached_tokens = start
        if tokens:  # one a step: the core applies one step per record
            sample.output_token_ids += tokens
            if sample.logprobs is not None and logprobs:
                sample.logprobs += logprobs
            sampled.append(sample)
        if finish is not None:
            reason, sample.stop_reason, sample.error, sample.metrics.finished_time = finish
            sample.status = RequestStatus(reason)
        touched.append(sample)
    return sampled, touched, discarded


def finish_sample(sample: Request, status: RequestStatus, finished_time: float, stop_reason: str | int | None = None,
                  error: str | None = None) -> None:
    """Finish the front end's view of a sample (a stop string or a detokenization error found there)."""
    sample.status, sample.stop_reason, sample.error = status, stop_reason, error
    sample.metrics.finished_time = finished_time
