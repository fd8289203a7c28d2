"""Where an eager mixed step's time goes on a GPU: wall time per step, cProfile's host view and
torch.profiler's CUDA kernel view of steps that carry one prefill chunk beside a decoding stream.

    python3 scripts/profile_gpu_step.py [--shape qwen2.5-3b] [--budget 64] [--steps 4]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen2.5-3b")
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    import torch

    from deepinfer.core.config import EngineConfig
    from deepinfer.core.engine.llm_engine import LLMEngine
    from deepinfer.core.engine.sampling_params import SamplingParams

    config = EngineConfig(dummy_weights=True, shape=args.shape, quantization="w4a16", max_model_len=4096,
                          kv_cache_memory="4GiB", max_num_batched_tokens=args.budget, max_num_seqs=4)
    engine = LLMEngine(config)
    params = SamplingParams(temperature=0, max_tokens=4096 - 64, ignore_eos=True)
    engine.add_request(list(range(1, 33)), params)
    for _ in range(4):
        engine.step()
    engine.add_request(list(range(100, 2148)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))

    def timed_steps(n: int) -> list[float]:
        times = []
        for _ in range(n):
            torch.cuda.synchronize()
            start = time.perf_counter()
            engine.step()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1000)
        return times

    print("mixed step wall ms:", [round(t, 2) for t in timed_steps(args.steps)])
    profiler = cProfile.Profile()
    profiler.enable()
    timed_steps(args.steps)
    profiler.disable()
    stats = pstats.Stats(profiler)
    print(f"--- cProfile, {args.steps} mixed steps, by own time ---")
    stats.sort_stats("tottime").print_stats(25)
    print("--- by cumulative time ---")
    stats.sort_stats("cumulative").print_stats(30)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        timed_steps(2)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
