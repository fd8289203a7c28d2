"""Decode speed with and without CUDA graphs, timed straight on LLMEngine (no HTTP, no asyncio).

For one model (default: the Qwen2.5-3B body, W4A16 dummy weights) the engine is built twice, with
CUDA graphs and with enforce_eager, and at each concurrency `c` greedy requests (prompt_len-token
prompts, admitted together) run to output_len tokens. Reported per run:
- decode tokens/s: tokens sampled by pure-decode steps over those steps' wall time, and the
  median step time (its inverse is concurrency-1 decode speed);
- output tokens/s: every generated token over the run's wall time (prefill included).
Also: the GPU time of each graph replay alone (CUDA events), a profiler breakdown of one eager
and one replayed decode step (where GPU time goes; host time not covered by kernels), and a run
inside max_vram 4GiB. One JSON.

    python3 scripts/graph_decode_check.py --output results/decode_graphs.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinfer.core.bench.env_info import env_info
from deepinfer.core.config import EngineConfig
from deepinfer.core.engine.llm_engine import LLMEngine
from deepinfer.core.engine.sampling_params import SamplingParams

MiB = 1024**2
logger = logging.getLogger("graph_decode_check")


def prompts_for(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size) for _ in range(length)] for _ in range(count)]


def timed_run(engine: LLMEngine, prompts: list[list[int]], output_len: int, profile_step: int | None = None):
    """Run `prompts` together to completion. -> (summary, token lists, profile rows or None)."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    finals, decode_steps, profile = {}, [], None
    generated = steps = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        profiler = None
        if profile_step is not None and steps == profile_step:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                          torch.profiler.ProfilerActivity.CUDA])
            profiler.__enter__()
        step_start = time.perf_counter()
        outputs, stats = engine.step()
        step_s = time.perf_counter() - step_start
        if profiler is not None:
            torch.cuda.synchronize()
            profiler.__exit__(None, None, None)
            profile = kernel_breakdown(profiler, step_s)
        steps += 1
        generated += stats.num_generation_tokens
        if profiler is None and stats.num_prompt_tokens == 0 and stats.num_generation_tokens:
            decode_steps.append((step_s, stats.num_generation_tokens))
        finals.update({o.request_id: o.token_ids for o in outputs if o.finished})
    wall_s = time.perf_counter() - start
    decode_time = sum(s for s, _ in decode_steps)
    summary = {
        "concurrency": len(prompts), "prompt_len": len(prompts[0]), "output_len": output_len, "steps": steps,
        "decode_steps": len(decode_steps),
        "decode_tokens_per_s": sum(n for _, n in decode_steps) / decode_time if decode_time else None,
        "decode_step_ms_median": 1e3 * statistics.median(s for s, _ in decode_steps) if decode_steps else None,
        "decode_step_ms_p90": (1e3 * statistics.quantiles([s for s, _ in decode_steps], n=10)[-1]
                               if len(decode_steps) >= 10 else None),
        "output_tokens_per_s": generated / wall_s, "wall_s": wall_s,
    }
    return summary, [finals[i] for i in ids], profile


def kernel_breakdown(profiler, step_s: float, top: int = 14) -> dict:
    """GPU time per kernel name of one profiled step, largest first."""
    rows = []
    for event in profiler.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(event, "self_cuda_time_total", 0)
        if device_us > 0:
            rows.append({"name": event.key[:90], "count": event.count, "gpu_us": round(device_us, 1)})
    rows.sort(key=lambda r: -r["gpu_us"])
    gpu_us = sum(r["gpu_us"] for r in rows)
    return {"step_wall_us": round(step_s * 1e6, 1), "gpu_kernel_us": round(gpu_us, 1),
            "num_kernels": sum(r["count"] for r in rows), "top": rows[:top]}


def replay_times(engine: LLMEngine, batches: list[int], iterations: int = 50) -> list[dict]:
    """Per (batch, smallest bound) graph, padding rows only: GPU milliseconds per replay (back to back,
    CUDA events) and the wall time of one replay followed by a sync."""
    runner = engine.step_runner
    bound = runner.context_bounds[0]
    results = []
    for batch in batches:
        if batch not in runner.bucket_sizes:
            continue
        runner.load_padding(batch, bound)
        runner.replay(batch, bound)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(iterations):
            runner.replay(batch, bound)
        end.record()
        torch.cuda.synchronize()
        gpu_ms = begin.elapsed_time(end) / iterations
        walls = []
        for _ in range(10):  # one replay waited for, as a decode step does: launch latency exposed
            start = time.perf_counter()
            runner.replay(batch, bound)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - start)
        results.append({"batch": batch, "bound": bound, "gpu_ms_per_replay": gpu_ms,
                        "wall_ms_replay_and_sync": 1e3 * statistics.median(walls)})
    return results


def build(config: EngineConfig) -> tuple[LLMEngine, dict]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    engine = LLMEngine(config)
    torch.cuda.synchronize()
    health = engine.health()
    info = {"startup_s": time.perf_counter() - start,
            "startup_peak_allocated_mib": torch.cuda.max_memory_allocated() / MiB,
            "attention_backend": health["attention_backend"], "cuda_graphs": health["cuda_graphs"],
            "kv_budget": health["kv_budget"], "kernels": health["kernels"]}
    return engine, info


def release_memory() -> None:
    """After the caller dropped its engine: give the KV pool and graphs back before the next one."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-3b")
    parser.add_argument("--quantization", default="w4a16")
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    levels = [int(c) for c in args.concurrency.split(",")]
    base = {"dummy_weights": True, "shape": args.shape, "quantization": args.quantization,
            "max_model_len": args.max_model_len, "max_num_seqs": max(64, max(levels))}
    result = {"env": env_info(sys.argv), "model": base, "runs": {}}
    output = Path(args.output)

    def save() -> None:
        output.write_text(json.dumps(result, indent=2, default=str))

    tokens = {}
    for mode in ("graphs", "eager"):
        engine, info = build(EngineConfig(**base, enforce_eager=mode == "eager"))
        vocab_size = engine.spec.vocab_size
        timed_run(engine, prompts_for(1, args.prompt_len, vocab_size, seed=99), 8)  # warm-up
        info["levels"] = []
        for level in levels:
            prompts = prompts_for(level, args.prompt_len, vocab_size, seed=level)
            summary, outs, profile = timed_run(engine, prompts, args.output_len, profile_step=args.output_len // 2)
            summary["profiled_decode_step"] = profile
            summary["peak_allocated_mib"] = torch.cuda.max_memory_allocated() / MiB
            info["levels"].append(summary)
            tokens[(mode, level)] = outs
            logger.info("%s c=%d: %.0f decode tok/s, median step %.2f ms", mode, level,
                         summary["decode_tokens_per_s"] or 0, summary["decode_step_ms_median"] or 0)
        if engine.decode_mode == "graphs":
            info["replay_gpu_ms"] = replay_times(engine, [1, 8, 16, 32, 64])
        result["runs"][mode] = info
        save()
        del engine
        release_memory()
    result["greedy_agreement"] = {
        str(level): sum(a == b for ga, ea in zip(tokens[("graphs", level)], tokens[("eager", level)])
                        for a, b in zip(ga, ea)) / (level * args.output_len)
        for level in levels}
    save()

    engine, info = build(EngineConfig(**{**base, "max_num_seqs": 8}, max_vram="4GiB"))
    summary, _, _ = timed_run(engine, prompts_for(8, args.prompt_len, engine.spec.vocab_size, seed=7), 32)
    info["levels"] = [summary]
    info["peak_allocated_mib"] = torch.cuda.max_memory_allocated() / MiB
    result["runs"]["max_vram_4GiB"] = info
    save()
    del engine
    release_memory()
    logger.info("wrote %s", output)


if __name__ == "__main__":
    main()
