"""Driving an in-process AsyncEngine for benchmarks: send token-id requests, time what comes back.

No HTTP: the client is an asyncio task in the same process, so the numbers are the engine's own
plus one thread hop. Every request is greedy with `ignore_eos` and a fixed `max_tokens`, so every
run produces the same number of tokens and runs stay comparable.
"""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import dataclass

from deepinfer.core.bench.latency import RequestTiming
from deepinfer.core.bench.progress import SweepProgress


def bench_sampling_params(output_len: int, structured_outputs=None):
    """`structured_outputs`: a constraint every request follows (a StructuredOutputsParams or its dict)."""
    from deepinfer.core.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True,
                          structured_outputs=structured_outputs)


async def send_request(engine, prompt: list[int], output_len: int, request_id: str,
                       on_delivery=None, structured_outputs=None, progress: SweepProgress | None = None) -> RequestTiming:
    """Send one request and record when each piece of its output arrives.

    `on_delivery(timing)` runs after every recorded delivery (the jitter test uses it to insert
    the long prompt once the stream has produced N tokens); `progress` hears of every token and
    of the request's end.
    """
    timing = RequestTiming(request_id, len(prompt), time.perf_counter())
    params = bench_sampling_params(output_len, structured_outputs)
    stream = engine.add_request(prompt, params, request_id=request_id)
    finished = False
    try:
        async for out in stream:
            received = time.perf_counter()
            completion = out.outputs[0]
            timing.record(received, len(completion.delta_token_ids))
            if progress is not None:
                progress.advance(tokens=len(completion.delta_token_ids))
            timing.num_cached_tokens = out.num_cached_tokens
            if out.error is not None or completion.finish_reason in ("error", "abort"):
                timing.error = out.error or f"finished with {completion.finish_reason}"
            finished = out.finished
            if on_delivery is not None:
                on_delivery(timing)
    finally:
        if not finished:  # cancelled or failed on our side: free the request's blocks in the engine
            stream.abort()
    if timing.error is None and timing.output_len != output_len:
        timing.error = f"produced {timing.output_len} tokens, expected {output_len}"
    if progress is not None:
        progress.advance(requests=1)
    return timing


@dataclass
class StepRecord:
    time_s: float  # perf_counter when the engine reported the step (engine thread)
    num_prompt_tokens: int
    num_generation_tokens: int
    num_running: int
    num_waiting: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int


class StepRecorder:
    """An engine stats listener that keeps one StepRecord per engine step while recording."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._recording = False
        self._steps: list[StepRecord] = []

    def __call__(self, stats) -> None:  # called from the engine thread
        now = time.perf_counter()
        with self._lock:
            if self._recording:
                self._steps.append(StepRecord(
                    now, stats.num_prompt_tokens, stats.num_generation_tokens, stats.num_running,
                    stats.num_waiting, stats.prefix_cache_queries, stats.prefix_cache_hits,
                    stats.num_preemptions))

    def start(self) -> None:
        with self._lock:
            self._steps = []
            self._recording = True

    def stop(self) -> list[StepRecord]:
        with self._lock:
            self._recording = False
            return list(self._steps)


def summarize_steps(steps: list[StepRecord]) -> dict:
    """Engine-side counters of one run: steps, largest batch, prefix-cache hit rate, preemptions."""
    queries = sum(s.prefix_cache_queries for s in steps)
    hits = sum(s.prefix_cache_hits for s in steps)
    return {
        "num_steps": len(steps),
        "max_running": max((s.num_running for s in steps), default=0),
        "max_prompt_tokens_per_step": max((s.num_prompt_tokens for s in steps), default=0),
        "prefix_cache_hit_rate": hits / queries if queries else None,
        "num_preemptions": sum(s.num_preemptions for s in steps),
    }


def cuda_device_of(config) -> str | None:
    """The CUDA device an engine built from `config` runs on, or None on the CPU."""
    import torch

    if config.device.startswith("cuda"):
        return config.device
    if config.device == "auto" and torch.cuda.is_available():
        return "cuda"
    return None


def reset_peak_memory(device: str | None) -> None:
    import torch

    if device is not None:
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: str | None) -> dict:
    """Peak bytes allocated by tensors and peak reserved by torch's caching allocator since the reset."""
    import torch

    if device is None:
        return {"peak_allocated_bytes": None, "peak_reserved_bytes": None}
    return {"peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
            "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device))}


async def start_engine(config, loaded_model=None, engine_process: bool = False):
    """Build (loads the model unless `loaded_model` is given, blocking) and start an AsyncEngine, or with
    `engine_process` an EngineCoreClient (the engine core in its own process, which loads the model itself).

    A quantized run whose model holds no quantized linear would publish bf16 numbers under a W4A16
    label, so that is an error here rather than a footnote.
    """
    if engine_process:
        from deepinfer.core.engine.frontend.core_client import EngineCoreClient

        engine = EngineCoreClient(config)
    else:
        from deepinfer.core.engine.frontend.async_engine import AsyncEngine

        engine = AsyncEngine(config, loaded_model)
    await engine.start()
    weights = weight_summary(engine)
    if config.quantization is not None and weights["quantized_linears"] == 0:
        await engine.shutdown()
        raise RuntimeError(f"--quantization {config.quantization} was asked for, but the loaded model has no "
                           "quantized linear layers; refusing to report unquantized numbers under that label")
    return engine


def loaded_model_of(engine):
    """The engine's model, tokenizer and spec, to hand to the next engine of a sweep."""
    from deepinfer.core.models.loader import LoadedModel

    inner = engine.engine
    return LoadedModel(inner.spec, inner.model, inner.tokenizer, inner.source_kind, inner.model_name)


def weight_summary(engine) -> dict:
    """How the loaded model holds its weights: quantized linears (and their bit widths), bytes on the device."""
    return engine.weights if hasattr(engine, "weights") else engine.engine.weight_summary()


async def warm_up(engine, vocab_size: int, prompt_len: int, output_len: int = 4, structured_outputs=None) -> None:
    """One untimed request: kernel compilation and allocator growth happen here, not in a measurement
    (and the constraint's grammar compilation, when the requests have one)."""
    from deepinfer.core.bench.workload import make_prompts

    prompt = make_prompts(1, prompt_len, vocab_size, seed=[2**31 - 1])[0]
    await send_request(engine, prompt, output_len, f"warmup-{time.monotonic_ns()}",
                       structured_outputs=structured_outputs)


def release_cuda_memory() -> None:
    """After an engine or a peer model is dropped: give its memory back before the next one loads."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
