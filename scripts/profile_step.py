"""Host overhead of one mixed engine step (a prefill chunk sharing the step with 16 decodes), on the CPU.

    python3 scripts/profile_step.py [--steps 6] [--shape smollm2-135m] [--top 25]

Builds a dummy-weight W4A16 engine on the CPU, brings 16 requests into decode, then adds a long
prompt whose prefill is chunked over the next steps, so every profiled step is mixed (one prefill
chunk + 16 decodes). On the CPU the torch math dominates the wall time, so the report also counts
Python-level calls per step: the host work an eager GPU step (`--enforce-eager`, or a step beyond the
captured graphs) pays whatever its kernels cost (kernel lookups, PackedWeight builds, dispatch
checks, output snapshots). No GPU needed; about 30 s with `--steps 2`. A second section times the output processing alone (detokenize,
snapshot, metrics) for `--concurrency` streams that already hold `--generated` tokens each.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

# (label, file suffix, function name): the per-step call counts this script reports
WATCHED = (
    ("get_kernel", "kernels/compiler.py", "get_kernel"),
    ("source_hash", "kernels/compiler.py", "source_hash"),
    ("PackedWeight.__post_init__", "core/quant/packed.py", "__post_init__"),
    ("QuantLinear.packed", "core/quant/quant_linear.py", "packed"),
    ("kernel_blocker", "core/ops/dispatch.py", "kernel_blocker"),
    ("force_reference", "core/ops/dispatch.py", "force_reference"),
    ("unsupported_reason (all ops)", "kernels/", "unsupported_reason"),
    ("rotary_and_cache_write (one op)", "core/ops/rotary.py", "rotary_and_cache_write"),
    ("KVCache.write (backend)", "core/kv/cache.py", "write"),
    ("OutputProcessor._snapshot", "core/engine/frontend/output_processor.py", "_snapshot"),
    ("dataclasses.replace", "dataclasses.py", "replace"),
)


def _count(stats: pstats.Stats, suffix: str, name: str) -> int:
    total = 0
    for (filename, _, function), (primitive_calls, *_rest) in stats.stats.items():
        if function == name and suffix in filename:
            total += primitive_calls
    return total


def profile_outputs(engine, concurrency: int, generated: int, steps: int = 200) -> None:
    """Host time of OutputProcessor.append_tokens + make_outputs per step, `concurrency` streams."""
    from deepinfer.core.engine.frontend.output_processor import OutputProcessor
    from deepinfer.core.engine.sampling_params import SamplingParams
    from deepinfer.core.engine.stats import IterationStats

    processor = OutputProcessor(engine.tokenizer)
    params = SamplingParams(max_tokens=generated + steps + 1, ignore_eos=True)
    requests = []
    for i in range(concurrency):
        group = engine.make_request_group([1 + i, 2, 3], params)
        processor.add(group)
        requests.append(group.samples[0])

    def one_step(token: int) -> None:
        for request in requests:
            request.append_output_token(token)
        stats = IterationStats()
        processor.append_tokens(requests, stats)
        processor.make_outputs(requests, stats)

    for token in range(generated):
        one_step(65 + token % 26)
    start = time.perf_counter()
    for token in range(steps):
        one_step(65 + token % 26)
    seconds = (time.perf_counter() - start) / steps
    print(f"output processing, {concurrency} streams at {generated}+ tokens: {1e6 * seconds:.0f} us per step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="mixed steps to profile")
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--decodes", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=64, help="prefill tokens per step")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--concurrency", type=int, default=32, help="streams in the output-processing timing")
    parser.add_argument("--generated", type=int, default=1000, help="tokens each stream already holds")
    args = parser.parse_args()

    import torch

    from deepinfer.core.config import EngineConfig
    from deepinfer.core.engine.llm_engine import LLMEngine
    from deepinfer.core.engine.sampling_params import SamplingParams

    torch.set_num_threads(max(1, torch.get_num_threads()))
    config = EngineConfig(dummy_weights=True, shape=args.shape, quantization="w4a16", device="cpu",
                          dtype="float32", max_num_seqs=args.decodes + 1,
                          max_num_batched_tokens=args.decodes + args.chunk, enable_prefix_caching=False,
                          num_gpu_blocks=256)
    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=10_000 // 10, temperature=0.0, ignore_eos=True)
    for i in range(args.decodes):
        engine.add_request([1 + i, 2, 3, 4], params)
    for _ in range(3):  # prefills, then the first decodes
        engine.step()
    engine.add_request(list(range(5, 5 + args.chunk * (args.steps + 2))), SamplingParams(max_tokens=1))
    engine.step()  # the first mixed step: compiles/caches whatever is lazily built

    profiler = cProfile.Profile()
    wall = []
    for _ in range(args.steps):
        start = time.perf_counter()
        profiler.enable()
        engine.step()
        profiler.disable()
        wall.append(time.perf_counter() - start)
    stats = pstats.Stats(profiler)
    print(f"{args.steps} mixed steps ({args.chunk}-token prefill chunk + {args.decodes} decodes), "
          f"{args.shape} W4A16 fp32 on the CPU")
    print(f"wall per step: {1000 * sum(wall) / len(wall):.1f} ms (min {1000 * min(wall):.1f} ms)")
    print(f"Python-level calls per step (cProfile, primitive): {stats.prim_calls / args.steps:.0f}")
    print("calls per step:")
    for label, suffix, name in WATCHED:
        print(f"  {label:32s} {_count(stats, suffix, name) / args.steps:8.1f}")
    profile_outputs(engine, args.concurrency, args.generated)
    print()
    stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
