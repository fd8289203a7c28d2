"""Engine options shared by `chat`, `serve` and `bench`: one Annotated alias per flag, one builder.

Commands declare `model: ModelOpt = None, ...` and pass their values to `engine_config(...)`,
so a flag means the same thing everywhere and EngineConfig stays the single source of defaults.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

ModelOpt = Annotated[str | None, typer.Option(
    "--model", "-m", help="HF directory, .gguf file or deepinfer layered dir (default: SmolLM2-135M-Instruct).")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="auto | float32 | bfloat16 | float16.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto | cpu | cuda | cuda:N.")]
BlockSizeOpt = Annotated[int, typer.Option("--block-size", help="Tokens per KV block.")]
KvCacheDtypeOpt = Annotated[str, typer.Option("--kv-cache-dtype", help="auto (model dtype) | int8.")]
MaxNumSeqsOpt = Annotated[int, typer.Option("--max-num-seqs", help="Most requests running at once.")]
MaxBatchedTokensOpt = Annotated[int, typer.Option(
    "--max-num-batched-tokens", help="Per-step token budget: prefill chunks + decode tokens.")]
MaxModelLenOpt = Annotated[int | None, typer.Option("--max-model-len", help="Context length cap.")]
GpuMemUtilOpt = Annotated[float, typer.Option(
    "--gpu-memory-utilization", help="Fraction of GPU memory deepinfer may use.")]
ReserveMbOpt = Annotated[int, typer.Option("--reserve-memory-mb", help="MiB left free for other programs.")]
KvCacheMemoryOpt = Annotated[str | None, typer.Option(
    "--kv-cache-memory", help="KV pool size exactly, e.g. 2GiB.")]
MaxVramOpt = Annotated[str | None, typer.Option(
    "--max-vram", help="What torch reserves (weights, activations, CUDA graphs, KV) stays inside this, "
                        "e.g. 4GiB; the CUDA context comes on top.")]
PrefixCachingOpt = Annotated[bool, typer.Option(
    "--prefix-caching/--no-prefix-caching", help="Share full prompt blocks between requests.")]
EnforceEagerOpt = Annotated[bool, typer.Option("--enforce-eager", help="Never use CUDA graphs.")]
AsyncSchedulingOpt = Annotated[bool, typer.Option(
    "--async-scheduling/--no-async-scheduling",
    help="Schedule and launch each step while the previous one still runs on the device, hiding the "
         "host's per-step work (same tokens; outputs come one step later).")]
AttentionBackendOpt = Annotated[str, typer.Option("--attention-backend", help="auto | torch | native.")]
DummyWeightsOpt = Annotated[bool, typer.Option("--dummy-weights", help="Random weights (benchmarks).")]
ShapeOpt = Annotated[str | None, typer.Option("--shape", help="configs/shapes/NAME.json for --dummy-weights.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Engine seed.")]


def engine_config(**options: Any):
    """Build an EngineConfig from command options, dropping the ones left unset (None)."""
    from deepinfer.core.config import EngineConfig

    options = {k: v for k, v in options.items() if v is not None}
    if "prefix_caching" in options:
        options["enable_prefix_caching"] = options.pop("prefix_caching")
    return EngineConfig(**options)
