"""The concurrency sweep: serial (concurrency 1) against concurrent clients, same prompts each level.

At each level `c`, `c` closed-loop clients share the level's requests: each client sends its next
request as soon as its previous one finishes, so exactly `c` requests are in flight until the work
runs out. Each level and repeat gets its own prompts (and its own shared prefix), so the prefix
cache starts cold at every level and only shares what the workload asks it to share. The HF peer
(core/bench/hf_peer.py) runs first, on the same prompts, and is freed before the engine loads,
so each side has the GPU to itself.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from deepinfer.core.bench import engine_client, hf_peer
from deepinfer.core.bench.latency import RequestTiming, mean_std, requests_frame, summarize_requests
from deepinfer.core.bench.progress import SweepProgress
from deepinfer.core.bench.report import concurrency_level_line
from deepinfer.core.bench.workload import default_num_requests, make_prompts, per_level_counts_ok
from deepinfer.core.errors import InvalidRequestError

logger = logging.getLogger(__name__)


@dataclass
class ConcurrencyWorkload:
    concurrency_levels: list[int]
    prompt_len: int = 512
    output_len: int = 128
    # per level: one count for every level, or one per level (in the order of concurrency_levels);
    # None = default_num_requests(concurrency)
    num_requests: int | list[int] | None = None
    shared_prefix_len: int = 0
    repeats: int = 1
    seed: int = 0
    json_schema: dict | None = None  # every request's output follows this JSON schema

    def __post_init__(self) -> None:
        checks = [
            (bool(self.concurrency_levels) and all(c >= 1 for c in self.concurrency_levels),
             f"concurrency levels must be >= 1, got {self.concurrency_levels}"),
            (self.prompt_len >= 1, f"--prompt-len must be >= 1, got {self.prompt_len}"),
            (self.output_len >= 1, f"--output-len must be >= 1, got {self.output_len}"),
            (per_level_counts_ok(self.num_requests, len(self.concurrency_levels)),
             (f"--num-requests takes one count >= 1, or one per level ({len(self.concurrency_levels)}), "
              f"got {self.num_requests}")),
            (0 <= self.shared_prefix_len < self.prompt_len,
             f"--shared-prefix-len must be in [0, --prompt-len {self.prompt_len}), got {self.shared_prefix_len}"),
            (self.repeats >= 1, f"--repeats must be >= 1, got {self.repeats}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)

    def requests_at(self, concurrency: int) -> int:
        if isinstance(self.num_requests, list):
            return self.num_requests[self.concurrency_levels.index(concurrency)]
        return self.num_requests if self.num_requests is not None else default_num_requests(concurrency)

    @property
    def structured_outputs(self) -> dict | None:
        return None if self.json_schema is None else {"json": self.json_schema}

    def prompts(self, concurrency: int, repeat: int, vocab_size: int) -> list[list[int]]:
        return make_prompts(self.requests_at(concurrency), self.prompt_len, vocab_size,
                            shared_prefix_len=self.shared_prefix_len, seed=[self.seed, concurrency, repeat])


async def run_engine_level(engine, prompts: list[list[int]], output_len: int, concurrency: int,
                           label: str, structured_outputs: dict | None = None,
                           progress: SweepProgress | None = None) -> tuple[list[RequestTiming], float]:
    """`concurrency` closed-loop clients over `prompts`: (timings in prompt order, wall seconds)."""
    timings: list[RequestTiming | None] = [None] * len(prompts)
    next_index = iter(range(len(prompts)))

    async def client() -> None:
        for i in next_index:  # the shared iterator hands each prompt to exactly one client
            timings[i] = await engine_client.send_request(engine, prompts[i], output_len, f"{label}-{i}",
                                                          structured_outputs=structured_outputs, progress=progress)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return timings, time.perf_counter() - start


def _level_summary(runs: list[dict]) -> dict:
    return {"repeats": runs, "mean_std": mean_std(runs)}


def _level_runs(workload: ConcurrencyWorkload, concurrency: int, vocab_size: int, progress: SweepProgress,
                who: str) -> Iterator[tuple[int, list]]:
    """(repeat, prompts) for each repeat of one level, each announced on the progress display."""
    for repeat in range(workload.repeats):
        prompts = workload.prompts(concurrency, repeat, vocab_size)
        label = f"{who}c={concurrency}" + (f" {repeat + 1}/{workload.repeats}" if workload.repeats > 1 else "")
        progress.level_started(label, len(prompts))
        yield repeat, prompts


async def _engine_sweep(config, workload: ConcurrencyWorkload, info: dict, levels: list[dict],
                        progress: SweepProgress, engine_process: bool = False) -> None:
    """Fills `info` and appends one entry per finished level to `levels` (kept if interrupted)."""
    progress.level_started("loading", 1)
    engine = await engine_client.start_engine(config, engine_process=engine_process)
    recorder = engine_client.StepRecorder()
    engine.add_stats_listener(recorder)
    # The device memory is the engine process's, out of this one's reach (and CUDA is not started here).
    device = None if engine_process else engine_client.cuda_device_of(engine.config)
    vocab_size = engine.spec.vocab_size
    info.update(model_name=engine.model_name, vocab_size=vocab_size, engine_config=asdict(engine.config),
                weights=engine_client.weight_summary(engine), health=engine.health())
    try:
        progress.level_started("warming up", 1)
        await engine_client.warm_up(engine, vocab_size, workload.prompt_len,
                                    structured_outputs=workload.structured_outputs)
        for concurrency in workload.concurrency_levels:
            runs = []
            for repeat, prompts in _level_runs(workload, concurrency, vocab_size, progress, ""):
                engine_client.reset_peak_memory(device)
                recorder.start()
                timings, wall_s = await run_engine_level(engine, prompts, workload.output_len, concurrency,
                                                         f"c{concurrency}-r{repeat}", workload.structured_outputs, progress)
                steps = recorder.stop()
                run = summarize_requests(timings, wall_s)
                run.update(engine_client.summarize_steps(steps))
                run.update(decode_step_times(steps))
                run.update(engine_client.peak_memory(device))
                run["requests"] = requests_frame(timings).to_dict(orient="records")
                _raise_on_failures(timings, concurrency)
                runs.append(run)
                logger.info("engine c=%d repeat %d: %.1f output tok/s", concurrency, repeat,
                            run["output_tokens_per_s"])
            levels.append({"concurrency": concurrency, "num_requests": workload.requests_at(concurrency),
                           **_level_summary(runs)})
            progress.level_finished(concurrency_level_line(levels[-1]))
    finally:
        await engine.shutdown()


def decode_step_times(steps: list[engine_client.StepRecord]) -> dict:
    """The run's decode-only steps, prefill excluded: a step that sampled tokens and computed no prompt tokens
    takes the time from the report of the step before it to its own (the engine reports a step when its results
    are applied, so consecutive reports of a busy engine are one step apart). -> their count and median in ms
    (None without any)."""
    times = [1e3 * (step.time_s - before.time_s) for before, step in itertools.pairwise(steps)
             if step.num_prompt_tokens == 0 and step.num_generation_tokens > 0]
    return {"decode_steps": len(times), "decode_step_ms": {"p50": statistics.median(times) if times else None}}


def _raise_on_failures(timings: list[RequestTiming], concurrency: int) -> None:
    failed = [t for t in timings if not t.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(timings)} requests failed at concurrency {concurrency}; "
                           f"first: {failed[0].request_id}: {failed[0].error}")


def _peer_sweep(peer_source: dict, workload: ConcurrencyWorkload, info: dict, levels: list[dict],
                progress: SweepProgress) -> None:
    device = peer_source["device"]
    memory_device = device if device.startswith("cuda") else None
    dtype = hf_peer.resolve_peer_dtype(peer_source["dtype"], device)
    model = hf_peer.load_hf_peer(peer_source.get("config_json"), peer_source.get("model_dir"), device, dtype)
    vocab_size = model.config.vocab_size
    info.update(kind="hf", dtype=str(dtype).removeprefix("torch."), device=device, vocab_size=vocab_size,
                batching="static (model.generate, one batch of `concurrency` prompts at a time)")
    try:
        hf_peer.warm_up_peer(model, workload.prompts(1, 0, vocab_size)[0], device)
        for concurrency in workload.concurrency_levels:
            runs = []
            for repeat, prompts in _level_runs(workload, concurrency, vocab_size, progress, "HF "):
                engine_client.reset_peak_memory(memory_device)
                timings, wall_s = hf_peer.run_peer_level(model, prompts, workload.output_len, concurrency, device,
                                                         f"hf-c{concurrency}-r{repeat}")
                progress.advance(requests=len(timings), tokens=sum(t.output_len for t in timings))
                run = summarize_requests(timings, wall_s)
                run.update(engine_client.peak_memory(memory_device))
                runs.append(run)
                logger.info("hf peer c=%d repeat %d: %.1f output tok/s", concurrency, repeat,
                            run["output_tokens_per_s"])
            levels.append({"concurrency": concurrency, **_level_summary(runs)})
            progress.level_finished(concurrency_level_line(levels[-1], who="HF peer"))
    finally:
        del model
        engine_client.release_cuda_memory()


def _mean(level: dict, key: str) -> float | None:
    return level["mean_std"].get(key, {}).get("mean")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare_levels(levels: list[dict], peer_levels: list[dict] | None) -> None:
    """Adds speedup over the serial baseline (concurrency 1) and engine/peer ratios to each level."""
    serial = next((lv for lv in levels if lv["concurrency"] == 1), None)
    serial_tps = _mean(serial, "output_tokens_per_s") if serial else None
    peers = {lv["concurrency"]: lv for lv in peer_levels or []}
    for level in levels:
        tps = _mean(level, "output_tokens_per_s")
        level["speedup_vs_serial"] = _ratio(tps, serial_tps)
        peer = peers.get(level["concurrency"])
        if peer is not None:
            level["peer"] = peer
            level["vs_peer"] = {
                "output_tokens_per_s_ratio": _ratio(tps, _mean(peer, "output_tokens_per_s")),
                "ttft_p50_ratio": _ratio(_mean(level, "ttft_ms.p50"), _mean(peer, "ttft_ms.p50")),
                "tpot_p50_ratio": _ratio(_mean(level, "tpot_ms.p50"), _mean(peer, "tpot_ms.p50")),
            }


def run_concurrency_benchmark(config, workload: ConcurrencyWorkload, peer: dict | None = None,
                              progress: SweepProgress | None = None, engine_process: bool = False) -> dict:
    """The whole sweep (peer first when asked, then the engine); the JSON payload without env info.

    `engine_process`: the engine core runs in its own process (EngineCoreClient), the clients, detokenization
    and stop strings in this one; the payload says so (`engine_process`) and has no peak memory (it is the
    engine process's).
    `peer`: None, or {"device", "dtype", "config_json" | "model_dir"} for the HF transformers peer.
    `progress` hears of every request and of every finished level.
    Interrupted (Ctrl-C, `timeout -s INT`), it returns the levels finished so far, marked "interrupted".
    """
    engine_info: dict = {}
    levels: list[dict] = []
    peer_info, peer_levels = (None, None) if peer is None else ({}, [])
    interrupted = False
    progress = progress or SweepProgress()
    try:
        if peer is not None:
            _peer_sweep(peer, workload, peer_info, peer_levels, progress)
        asyncio.run(_engine_sweep(config, workload, engine_info, levels, progress, engine_process))
    except KeyboardInterrupt:
        interrupted = True
        logger.warning("interrupted: keeping the %d engine level(s) finished so far", len(levels))
    if peer_info and engine_info and peer_info["vocab_size"] != engine_info["vocab_size"]:
        raise RuntimeError(f"HF peer vocab {peer_info['vocab_size']} != engine vocab {engine_info['vocab_size']}: "
                           "the two sides would not see the same prompts")
    compare_levels(levels, peer_levels)
    return {
        "benchmark": "concurrency",
        "engine_process": engine_process,
        "workload": asdict(workload),
        **engine_info,
        "peer": peer_info,
        "levels": levels,
        "interrupted": interrupted,
    }
