"""Long-document insertion: how much a running stream stutters while a long prompt is prefilled.

Aggregate tokens/s hides a long prefill that stalls every running stream (without chunked prefill,
for as long as the whole prompt takes). Per chunk size C (the engine's max_num_batched_tokens: a
step's prefill chunk plus its decode tokens) a fresh engine runs, after one untimed warm-up:
  1. baseline:  the short stream alone;
  2. alone:     the long prompt alone (its TTFT with the GPU to itself);
  3. insertion: the short stream again; once it has produced `insert_after` tokens, the long
                prompt arrives. Measured: the stream's ITLs in the insertion window and the long
                prompt's TTFT.
The insertion window runs from the long prompt's arrival to its first token; an ITL belongs to it
when its interval overlaps the window (so the gap that straddles either edge counts). With
`itl_slo_ms`, the sweep picks the largest chunk size whose worst ITL in the window stays within
the SLO, i.e. the fastest long-prompt TTFT the SLO allows.

The long prompt's default length follows the device: 2048 tokens on a GPU, 256 on the CPU, where a
2048-token prompt in 8-token chunks alone takes minutes. The length is in the JSON's workload and
the table's title.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import asdict, dataclass, replace
from itertools import pairwise

from deepinfer.core.bench import engine_client
from deepinfer.core.bench.latency import RequestTiming, percentiles
from deepinfer.core.bench.progress import SweepProgress
from deepinfer.core.bench.report import jitter_chunk_line
from deepinfer.core.bench.workload import make_prompts
from deepinfer.core.errors import InvalidRequestError

logger = logging.getLogger(__name__)


DEFAULT_LONG_PROMPT_LEN = {"gpu": 2048, "cpu": 256}
# On the CPU, chunks beyond the long prompt's length would all run the same one-chunk prefill.
DEFAULT_CHUNK_SIZES = {"gpu": [64, 128, 256, 512, 1024, 2048], "cpu": [16, 32, 64, 128, 256]}


def default_long_prompt_len(on_gpu: bool) -> int:
    return DEFAULT_LONG_PROMPT_LEN["gpu" if on_gpu else "cpu"]


@dataclass
class JitterWorkload:
    chunk_sizes: list[int]
    long_prompt_len: int = DEFAULT_LONG_PROMPT_LEN["gpu"]
    long_output_len: int = 4
    stream_prompt_len: int = 32
    stream_output_len: int | None = None  # None: long enough to outlast the insertion at the smallest chunk size
    insert_after: int = 16  # stream tokens produced before the long prompt arrives
    repeats: int = 1
    itl_slo_ms: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.stream_output_len is None:
            # One chunk of the long prompt per step at the smallest chunk size, plus slack after it.
            prefill_steps = math.ceil(self.long_prompt_len / max(1, min(self.chunk_sizes or [1]) - 1))
            self.stream_output_len = self.insert_after + prefill_steps + 16
        checks = [
            (bool(self.chunk_sizes) and all(c >= 2 for c in self.chunk_sizes),
             f"--chunk-sizes must be >= 2 each (one decode token + a prefill chunk), got {self.chunk_sizes}"),
            (self.long_prompt_len >= 1, f"--long-prompt-len must be >= 1, got {self.long_prompt_len}"),
            (self.long_output_len >= 1, f"--long-output-len must be >= 1, got {self.long_output_len}"),
            (self.stream_prompt_len >= 1, f"--stream-prompt-len must be >= 1, got {self.stream_prompt_len}"),
            (self.insert_after >= 1, f"--insert-after must be >= 1, got {self.insert_after}"),
            (self.stream_output_len > self.insert_after + 1,
             f"--stream-output-len ({self.stream_output_len}) must exceed --insert-after ({self.insert_after}) + 1"),
            (self.repeats >= 1, f"--repeats must be >= 1, got {self.repeats}"),
            (self.itl_slo_ms is None or self.itl_slo_ms > 0, f"--itl-slo-ms must be > 0, got {self.itl_slo_ms}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)


def window_itls(stream: RequestTiming, start_s: float, end_s: float) -> list[float]:
    """ITLs of `stream` whose interval (previous token, token] overlaps the window [start_s, end_s]."""
    times = stream.token_times_s()
    return [b - a for a, b in pairwise(times) if b > start_s and a < end_s]


def steps_in_window(steps: list, start_s: float, end_s: float) -> list:
    """Engine steps reported after `start_s`, through the first one reported at or after `end_s`.

    The listener runs after a step has posted its outputs, so the step that produced the long
    prompt's first token can be stamped just after the client saw that token.
    """
    inside = []
    for step in steps:
        if step.time_s < start_s:
            continue
        inside.append(step)
        if step.time_s >= end_s:
            break
    return inside


async def run_insertion(engine, stream_prompt: list[int], long_prompt: list[int], workload: JitterWorkload,
                        label: str, progress: SweepProgress | None = None) -> dict:
    """The stream, with the long prompt sent right after the stream's `insert_after`-th token arrives."""
    long_task: list[asyncio.Task] = []

    def insert_when_due(timing: RequestTiming) -> None:
        if not long_task and timing.output_len >= workload.insert_after:
            long_task.append(asyncio.create_task(engine_client.send_request(
                engine, long_prompt, workload.long_output_len, f"{label}-long", progress=progress)))

    stream = await engine_client.send_request(engine, stream_prompt, workload.stream_output_len,
                                              f"{label}-stream", on_delivery=insert_when_due, progress=progress)
    if not long_task:
        raise RuntimeError(f"{label}: the stream ended before producing {workload.insert_after} tokens")
    long = await long_task[0]
    for timing in (stream, long):
        if not timing.ok:
            raise RuntimeError(f"{timing.request_id} failed: {timing.error}")
    complete = long.first_token_s <= stream.last_token_s
    return {
        "window_itls_s": window_itls(stream, long.sent_s, long.first_token_s),
        "window_complete": complete,  # False: the stream ended before the long prefill did
        "stream_itls_s": stream.itls_s(),
        "long_ttft_s": long.ttft_s,
        "window_s": (long.sent_s, long.first_token_s),
    }


def _ms(values: list[float]) -> list[float]:
    return [v * 1000.0 for v in values]


def _mean_std_ms(values: list[float]) -> dict:
    ms = _ms(values)
    mean = sum(ms) / len(ms)
    std = math.sqrt(sum((v - mean) ** 2 for v in ms) / (len(ms) - 1)) if len(ms) > 1 else None
    return {"mean": mean, "std": std}


REQUESTS_PER_REPEAT = 4  # baseline stream, long prompt alone, then the stream and the inserted long prompt


def estimated_engine_steps(workload: JitterWorkload, chunk_size: int) -> int:
    """Engine steps one chunk size takes: the warm-up and each repeat's long prompt alone (its chunks,
    then its other output tokens), the baseline stream and the insertion (the stream's prompt chunks,
    then a step per further token; the inserted prompt's chunks share those steps)."""
    long_prompt = math.ceil(workload.long_prompt_len / chunk_size) + workload.long_output_len - 1
    stream = math.ceil(workload.stream_prompt_len / chunk_size) + workload.stream_output_len - 1
    return long_prompt + workload.repeats * (long_prompt + 2 * stream)


def sweep_summary(workload: JitterWorkload, device: str) -> str:
    """What the sweep will run, in a line, before it starts."""
    steps = sum(estimated_engine_steps(workload, c) for c in workload.chunk_sizes)
    return (f"bench jitter on the {device}: chunk sizes {', '.join(map(str, workload.chunk_sizes))}, each on a fresh "
            f"engine; long prompt {workload.long_prompt_len} tokens, stream "
            f"{workload.stream_prompt_len}+{workload.stream_output_len} tokens, repeats {workload.repeats}: "
            f"about {steps} engine steps")


async def _measure_chunk_size(config, chunk_size: int, workload: JitterWorkload, engine_info: dict,
                              weights: dict, progress: SweepProgress) -> dict:
    # The weights load once per sweep (kept in `weights`); each chunk size gets a fresh engine (KV pool,
    # CUDA graphs) over them.
    progress.level_started(f"chunk {chunk_size}: starting", 1)
    engine = await engine_client.start_engine(replace(config, max_num_batched_tokens=chunk_size),
                                              weights.get("loaded_model"))
    weights.setdefault("loaded_model", engine_client.loaded_model_of(engine))
    if not engine_info:
        engine_info.update(model_name=engine.model_name, weights=engine_client.weight_summary(engine),
                           health=engine.health())
    recorder = engine_client.StepRecorder()
    engine.add_stats_listener(recorder)
    engine.add_stats_listener(lambda _stats: progress.engine_steps(1))
    vocab_size = engine.spec.vocab_size
    baseline_itls, alone_ttfts, insert_runs, window_steps = [], [], [], []
    try:
        # A whole long prompt, not one chunk's worth: its later chunks (longer contexts, at large chunk sizes steps
        # past the CUDA graphs' attention limit, run eagerly) meet shapes the first chunk does not, and their
        # first-use costs belonged to the first measured long prompt ("alone") otherwise.
        await engine_client.warm_up(engine, vocab_size, workload.long_prompt_len, workload.long_output_len)
        progress.level_started(f"chunk {chunk_size}", REQUESTS_PER_REPEAT * workload.repeats)
        for repeat in range(workload.repeats):
            seed = [workload.seed, chunk_size, repeat]
            stream_prompt = make_prompts(1, workload.stream_prompt_len, vocab_size, seed=[*seed, 0])[0]
            long_prompt = make_prompts(1, workload.long_prompt_len, vocab_size, seed=[*seed, 1])[0]
            label = f"c{chunk_size}-r{repeat}"
            # Fresh prompts per phase: a prefix-cache hit must not make the insertion look cheap.
            alone_prompt = make_prompts(1, workload.long_prompt_len, vocab_size, seed=[*seed, 2])[0]
            baseline_prompt = make_prompts(1, workload.stream_prompt_len, vocab_size, seed=[*seed, 3])[0]

            baseline = await engine_client.send_request(engine, baseline_prompt, workload.stream_output_len,
                                                        f"{label}-baseline", progress=progress)
            alone = await engine_client.send_request(engine, alone_prompt, workload.long_output_len,
                                                     f"{label}-alone", progress=progress)
            recorder.start()
            run = await run_insertion(engine, stream_prompt, long_prompt, workload, label, progress)
            steps = recorder.stop()
            for timing in (baseline, alone):
                if not timing.ok:
                    raise RuntimeError(f"{timing.request_id} failed: {timing.error}")
            baseline_itls += baseline.itls_s()
            alone_ttfts.append(alone.ttft_s)
            insert_runs.append(run)
            start_s, end_s = run["window_s"]
            window_steps += steps_in_window(steps, start_s, end_s)
    finally:
        await engine.shutdown()
        del engine
        engine_client.release_cuda_memory()

    window = [itl for run in insert_runs for itl in run["window_itls_s"]]
    result = {
        "chunk_size": chunk_size,
        "baseline_itl_ms": percentiles(_ms(baseline_itls)),
        "insertion_window_itl_ms": percentiles(_ms(window)),
        "insertion_window_num_itls": len(window),
        "insertion_window_complete": all(run["window_complete"] for run in insert_runs),
        "insertion_stream_itl_ms": percentiles(_ms([i for run in insert_runs for i in run["stream_itls_s"]])),
        "insertion_window_engine_steps": len(window_steps),
        "insertion_window_max_prompt_tokens_per_step": max((s.num_prompt_tokens for s in window_steps), default=0),
        "long_ttft_alone_ms": _mean_std_ms(alone_ttfts),
        "long_ttft_inserted_ms": _mean_std_ms([run["long_ttft_s"] for run in insert_runs]),
    }
    if not result["insertion_window_complete"]:
        logger.warning("chunk size %d: the stream ended before the long prefill finished; raise --stream-output-len",
                       chunk_size)
    progress.level_finished(jitter_chunk_line(result))
    return result


def choose_chunk_size(results: list[dict], itl_slo_ms: float) -> dict:
    """The largest chunk size whose worst ITL in the insertion window is within the SLO, with its TTFT.

    A chunk size whose window the stream did not fully cover is never chosen: its max is a lower bound.
    """
    meeting = [r for r in results
               if r["insertion_window_complete"] and r["insertion_window_itl_ms"]["max"] is not None
               and r["insertion_window_itl_ms"]["max"] <= itl_slo_ms]
    if not meeting:
        return {"itl_slo_ms": itl_slo_ms, "chosen_chunk_size": None, "long_ttft_inserted_ms": None,
                "insertion_window_itl_max_ms": None,
                "note": "no chunk size in the sweep keeps the worst insertion ITL within the SLO; add smaller ones"}
    best = max(meeting, key=lambda r: r["chunk_size"])
    return {"itl_slo_ms": itl_slo_ms, "chosen_chunk_size": best["chunk_size"],
            "long_ttft_inserted_ms": best["long_ttft_inserted_ms"]["mean"],
            "insertion_window_itl_max_ms": best["insertion_window_itl_ms"]["max"], "note": None}


async def _sweep(config, workload: JitterWorkload, engine_info: dict, results: list[dict],
                 progress: SweepProgress) -> None:
    weights: dict = {}
    for chunk_size in workload.chunk_sizes:
        results.append(await _measure_chunk_size(config, chunk_size, workload, engine_info, weights, progress))


def run_jitter_benchmark(config, workload: JitterWorkload, progress: SweepProgress | None = None,
                         device: str = "CPU") -> dict:
    """The whole sweep, one fresh engine per chunk size; the JSON payload without env info.
    `progress` hears of the sweep's estimated engine steps first, then of every step, every request
    and every finished chunk size; `device` ("CPU", "GPU") only names where it runs, in that first line.

    Interrupted (Ctrl-C, `timeout -s INT`), it returns the chunk sizes finished so far, marked "interrupted".
    """
    progress = progress or SweepProgress()
    progress.sweep_started(sweep_summary(workload, device),
                           sum(estimated_engine_steps(workload, c) for c in workload.chunk_sizes))
    engine_info: dict = {}
    results: list[dict] = []
    interrupted = False
    try:
        asyncio.run(_sweep(config, workload, engine_info, results, progress))
    except KeyboardInterrupt:
        interrupted = True
        logger.warning("interrupted: keeping the %d chunk size(s) finished so far", len(results))
    return {
        "benchmark": "jitter",
        "workload": asdict(workload),
        **engine_info,
        "engine_config": asdict(config),
        "chunk_sizes": results,
        "slo": choose_chunk_size(results, workload.itl_slo_ms) if workload.itl_slo_ms is not None else None,
        "interrupted": interrupted,
    }
