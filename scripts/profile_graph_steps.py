"""Where a graphed step's time goes on a GPU: the GPU time of one replay per token bucket (CUDA
events over back-to-back replays), the kernels inside a replay (torch.profiler), and the host's view
of a decoding stream's steps (cProfile), so the gap between a step's wall time and its GPU time shows. The
replays run on padding rows (one-token contexts); the decoding streams' steps read real contexts of 256+ tokens.
The model is a dummy-weight W4A16 body of `--shape`, with CUDA graphs and async scheduling as `serve` runs it.

    python3 scripts/profile_graph_steps.py [--shape qwen2.5-3b] [--buckets 1,32,64] [--streams 1,64] [--dtype auto]
                                           [--kv-cache-dtype auto] [--out DIR]

Writes DIR/profile_graph_steps_<shape>-w4a16_<gpu>.json (with the environment block every results JSON
carries) and a .txt of the same tables. Needs the package installed with its GPU extra.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen2.5-3b")
    parser.add_argument("--buckets", default="1,32,64")
    parser.add_argument("--streams", default="1,64")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--out", default="results")
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from deepinfer.core.bench.env_info import env_info, gpu_slug
    from deepinfer.core.config import EngineConfig
    from deepinfer.core.engine.llm_engine import LLMEngine
    from deepinfer.core.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(dummy_weights=True, shape=args.shape, quantization="w4a16", max_model_len=4096, dtype=args.dtype,
                                    kv_cache_memory="8GiB", max_num_seqs=64, kv_cache_dtype=args.kv_cache_dtype))
    runner = engine.step_runner
    bound = runner.context_bounds[0]
    report: dict = {"shape": args.shape, "bound": bound, "buckets": {}}
    text = io.StringIO()
    for tokens in (int(b) for b in args.buckets.split(",")):
        runner.load_padding(tokens, bound)
        runner.replay(tokens, bound)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(50):
            runner.replay(tokens, bound)
        end.record()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.replay(tokens, bound)
            torch.cuda.synchronize()
        kernels = [{"name": e.key[:100], "count": e.count, "gpu_us": round(e.device_time_total, 1)}
                   for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:15]]
        report["buckets"][tokens] = {"gpu_ms_per_replay": begin.elapsed_time(end) / 50, "kernels": kernels}
        text.write(f"--- bucket {tokens}: {begin.elapsed_time(end) / 50:.3f} ms GPU per replay\n")
        for k in kernels:
            text.write(f"  {k['count']:5d} {k['gpu_us']:9.1f} us  {k['name']}\n")

    # Decoding streams: wall time per step and the host's view of it.
    for streams in (int(n) for n in args.streams.split(",")):
        ids = [engine.add_request(list(range(1 + i, 257 + i)), SamplingParams(temperature=0, max_tokens=400,
                                                                               ignore_eos=True))
               for i in range(streams)]
        for _ in range(12):  # prefills (2048-token budget) and the first decodes
            engine.step()
        # Steady decoding with nothing attached: a step's real cost (the bucket replays above run on padding
        # rows, whose attention reads one token; these read their 268-368-token contexts)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(100):
            engine.step()
        torch.cuda.synchronize()
        report[f"decode_step_us_{streams}_streams"] = (time.perf_counter() - start) / 100 * 1e6
        text.write(f"--- {streams} streams: {report[f'decode_step_us_{streams}_streams']:.1f} us per decode step "
                   f"(100 steps, contexts 268-368)\n")
        walls = []
        profiler = cProfile.Profile()
        for _ in range(50):
            torch.cuda.synchronize()
            start = time.perf_counter()
            profiler.enable()
            engine.step()
            profiler.disable()
            walls.append(time.perf_counter() - start)
        walls.sort()
        report[f"decode_step_wall_ms_median_{streams}_streams"] = 1e3 * walls[len(walls) // 2]
        text.write(f"--- {streams} streams: decode step wall {1e3 * walls[len(walls) // 2]:.3f} ms (median of 50, "
                   f"under cProfile)\n")
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(22)
        stats.sort_stats("cumulative").print_stats(22)
        # The GPU's view of the same steps: busy time (union of kernel and copy intervals; PDL overlaps them)
        # against the span, and what runs besides the graphs' kernels.
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                engine.step()
            torch.cuda.synchronize()
        intervals = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                           if e.device_type.name == "CUDA")
        busy, reach = 0.0, float("-inf")
        for start, end, _ in intervals:
            busy += max(0.0, end - max(start, reach))
            reach = max(reach, end)
        span = intervals[-1][1] - intervals[0][0]
        report[f"decode_gpu_busy_us_per_step_{streams}_streams"] = busy / 20
        report[f"decode_gpu_span_us_per_step_{streams}_streams"] = span / 20
        text.write(f"--- {streams} streams: GPU busy {busy / 20:.1f} us of a {span / 20:.1f} us step (20 steps)\n")
        names: dict[str, list[float]] = {}
        for start, end, name in intervals:
            names.setdefault(name[:100], []).append(end - start)
        for name, times in sorted(names.items(), key=lambda item: -len(item[1]) * 1000 - sum(item[1]))[:25]:
            text.write(f"  {len(times) / 20:6.1f}/step {sum(times) / 20:9.1f} us/step  {name}\n")
        for request_id in ids:  # the next measurement starts from an idle engine
            engine.abort(request_id)
        while engine.has_unfinished_requests():  # a step may still be in flight (async scheduling)
            engine.step()
    env = env_info()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"profile_graph_steps_{args.shape}-w4a16_{gpu_slug(env)}"
    (out / f"{stem}.json").write_text(json.dumps({"env": env, "dtype": args.dtype, **report}, indent=1) + "\n")
    (out / f"{stem}.txt").write_text(text.getvalue())
    print(text.getvalue()[-9000:])


if __name__ == "__main__":
    main()
