"""`deepinfer bench ...`: benchmarks that write JSON under results/ and print Rich tables."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from deepinfer.cli.errors import fail
from deepinfer.cli.options import engine_config, engine_flags

app = typer.Typer(help="Benchmarks (JSON under results/, Rich tables).", no_args_is_help=True,
                  rich_markup_mode=None)

OutputOpt = Annotated[str | None, typer.Option(
    "--output", "-o", help="JSON path (default results/bench_<kind>_<model>_<gpu>_<time>.json).")]
RepeatsOpt = Annotated[int, typer.Option("--repeats", help="Runs per point; tables show mean ± std.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Show engine logs.")]


@app.command("concurrency")
@engine_flags("concurrency")
def concurrency(
    concurrency_levels: Annotated[str, typer.Option(
        "--concurrency", "-c", help="Comma-separated client counts; 1 is the serial baseline.")] = "1,4,8,32,64",
    prompt_len: Annotated[int, typer.Option("--prompt-len", help="Prompt tokens per request.")] = 512,
    output_len: Annotated[int, typer.Option("--output-len", help="Output tokens per request (EOS ignored).")] = 128,
    num_requests: Annotated[int | None, typer.Option(
        "--num-requests", "-n", help="Requests per level (default max(2 x concurrency, 8)).")] = None,
    shared_prefix_len: Annotated[int, typer.Option(
        "--shared-prefix-len", help="Leading prompt tokens all requests of a level share (prefix cache).")] = 0,
    peer: Annotated[str | None, typer.Option(
        "--peer", help="hf: also run HF transformers model.generate (static batches) on the same prompts.")] = None,
    json_schema: Annotated[str | None, typer.Option(
        "--json-schema", help="A JSON Schema file; every request's output is constrained to it.")] = None,
    repeats: RepeatsOpt = 1,
    output: OutputOpt = None,
    verbose: VerboseOpt = False,
    *,
    engine: dict,
) -> None:
    """Serial vs concurrent sweep: TTFT, TPOT, ITL percentiles and throughput."""
    _setup_logging(verbose)
    from deepinfer.core.bench.concurrency import ConcurrencyWorkload, run_concurrency_benchmark
    from deepinfer.core.bench.report import concurrency_tables

    if peer not in (None, "hf"):
        fail(f"--peer must be hf, got {peer!r}")
    config = engine_config(engine)
    workload = ConcurrencyWorkload(
        concurrency_levels=_int_list(concurrency_levels, "--concurrency"), prompt_len=prompt_len,
        output_len=output_len, num_requests=num_requests, shared_prefix_len=shared_prefix_len, repeats=repeats,
        seed=config.seed, json_schema=_json_file(json_schema, "--json-schema") if json_schema else None)
    peer_source = None
    if peer == "hf":
        from deepinfer.core.bench.engine_client import cuda_device_of
        from deepinfer.core.bench.hf_peer import peer_source as hf_peer_source

        peer_source = hf_peer_source(config, cuda_device_of(config) or "cpu")
    with _progress() as progress:
        payload = run_concurrency_benchmark(config, workload, peer_source, progress)
    _finish("concurrency", config, payload, concurrency_tables(payload), output)


@app.command("jitter")
@engine_flags("jitter")
def jitter(
    token_budgets: Annotated[str, typer.Option(
        "--token-budgets", "--chunk-sizes",
        help="Comma-separated max_num_batched_tokens values: the chunked-prefill chunk sizes swept.")
    ] = "64,128,256,512,1024,2048",
    long_prompt_len: Annotated[int, typer.Option("--long-prompt-len", help="Tokens of the inserted prompt.")] = 2048,
    long_output_len: Annotated[int, typer.Option("--long-output-len", help="Output tokens of the long prompt.")] = 4,
    stream_prompt_len: Annotated[int, typer.Option("--stream-prompt-len", help="Prompt tokens of the stream.")] = 32,
    stream_output_len: Annotated[int | None, typer.Option(
        "--stream-output-len", help="Stream output tokens (default: enough to outlast the insertion).")] = None,
    insert_after: Annotated[int, typer.Option(
        "--insert-after", help="Stream tokens received before the long prompt is sent.")] = 16,
    itl_slo_ms: Annotated[float | None, typer.Option(
        "--itl-slo-ms", help="Pick the largest budget whose worst insertion ITL stays within this.")] = None,
    repeats: RepeatsOpt = 1,
    output: OutputOpt = None,
    verbose: VerboseOpt = False,
    *,
    engine: dict,
) -> None:
    """Long-prompt insertion: the running stream's ITL against its baseline, per token budget."""
    _setup_logging(verbose)
    from deepinfer.core.bench.jitter import JitterWorkload, run_jitter_benchmark
    from deepinfer.core.bench.report import jitter_tables

    budgets = _int_list(token_budgets, "--token-budgets")
    config = engine_config(engine, max_num_batched_tokens=max(budgets))
    workload = JitterWorkload(
        token_budgets=budgets, long_prompt_len=long_prompt_len, long_output_len=long_output_len,
        stream_prompt_len=stream_prompt_len, stream_output_len=stream_output_len, insert_after=insert_after,
        repeats=repeats, itl_slo_ms=itl_slo_ms, seed=config.seed)
    with _progress() as progress:
        payload = run_jitter_benchmark(config, workload, progress)
    _finish("jitter", config, payload, jitter_tables(payload), output)


@app.command("gemv")
def gemv(
    shapes: Annotated[str, typer.Option(
        "--shapes", help="Comma-separated in x out feature pairs.")] = "2048x2048,2048x11008,4096x4096,4096x14336,"
                                                                      "14336x4096,8192x8192",
    batches: Annotated[str, typer.Option("--batches", help="Comma-separated token counts.")] = "1,2,4,8,16,32,64",
    bits: Annotated[str, typer.Option("--bits", help="Comma-separated weight bit widths (4, 3).")] = "4,3",
    attention: Annotated[bool, typer.Option(help="Also time paged decode attention.")] = True,
    dtype: Annotated[str, typer.Option("--dtype", help="Activation dtype of the quantized products: "
                                                       "float16 | bfloat16.")] = "float16",
    repeats: RepeatsOpt = 5,
    device: Annotated[int, typer.Option("--device", help="CUDA device index.")] = 0,
    output: OutputOpt = None,
) -> None:
    """W4A16/W3A16 kernels and paged decode attention: achieved bandwidth vs device copy bandwidth; from 16
    tokens also the W4 GEMM, cuBLAS on the dense weight, and each product's share of its floor."""
    from deepinfer.kernels import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    if reason is not None:
        fail(f"bench gemv needs an NVIDIA GPU with CUDA and CuPy: {reason}")
    import sys

    import torch
    from rich.console import Console

    from deepinfer.core.bench.env_info import env_info, gpu_slug
    from deepinfer.core.bench.gemv_bench import gemv_tables, run_gemv_benchmark
    from deepinfer.core.bench.report import results_path, write_json
    try:
        pairs = [tuple(int(side) for side in item.split("x")) for item in shapes.split(",") if item.strip()]
    except ValueError:
        fail(f"--shapes takes pairs like 4096x4096, got {shapes!r}")
    if not pairs or any(len(pair) != 2 for pair in pairs):
        fail(f"--shapes takes pairs like 4096x4096, got {shapes!r}")
    if dtype not in ("float16", "bfloat16"):
        fail(f"--dtype takes float16 or bfloat16, got {dtype!r}")
    torch.cuda.set_device(device)
    env = env_info(["deepinfer", *sys.argv[1:]])
    payload = run_gemv_benchmark(torch.device("cuda", device), pairs, _int_list(batches, "--batches"),
                                 _int_list(bits, "--bits"), attention, repeats, dtype=getattr(torch, dtype))
    path = write_json(results_path("gemv", "w4a16-w3a16-attention", gpu_slug(env), output), payload, env)
    console = Console(width=200)
    for table in gemv_tables(payload):
        console.print(table)
    console.print(f"wrote {path}")

@app.command("cpu")
def cpu(
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="A .gguf file (default: the default model).")] = None,
    converted: Annotated[str | None, typer.Option(
        "--converted", help="Its `deepinfer convert` output (default: converted now into a temporary directory).")
    ] = None,
    prompt_len: Annotated[int, typer.Option("--prompt-len", help="Prompt tokens (prefill).")] = 2048,
    output_len: Annotated[int, typer.Option("--output-len", help="Greedy output tokens (decode).")] = 64,
    threads: Annotated[int | None, typer.Option(
        "--threads", help="torch CPU threads for every subject (default: torch's, the core count).")] = None,
    repeats: RepeatsOpt = 1,
    output: OutputOpt = None,
) -> None:
    """A GGUF and its W4A16 conversion through deepinfer on the CPU, beside HF transformers (fp32) on the same
    GGUF: prefill time and decode tok/s at one thread count."""
    import sys
    import tempfile
    from pathlib import Path

    import torch
    from rich.console import Console

    from deepinfer.core.bench.cpu_bench import CpuWorkload, cpu_tables, run_cpu_benchmark
    from deepinfer.core.bench.env_info import env_info
    from deepinfer.core.bench.report import results_path, write_json
    from deepinfer.core.weights.default_model import default_model_path

    gguf = Path(model).expanduser() if model else default_model_path()
    if gguf.suffix.lower() != ".gguf" or not gguf.is_file():
        fail(f"--model takes a .gguf file, got {str(gguf)!r}")
    if prompt_len < 1 or output_len < 2 or repeats < 1 or (threads is not None and threads < 1):
        fail("--prompt-len, --repeats and --threads take positive integers, --output-len at least 2")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # transformers' per-tensor bars (the GGUF tokenizer, its peer) bury the lines
    workload = CpuWorkload(prompt_len, output_len, threads or torch.get_num_threads(), repeats)
    console = Console(stderr=True)
    with tempfile.TemporaryDirectory(prefix="deepinfer-bench-cpu-") as scratch:
        if converted is None:
            from deepinfer.core.weights.convert.run import convert_checkpoint

            converted_path = Path(scratch) / f"{gguf.stem}-w4a16"
            console.print(f"converting {gguf.name} -> {converted_path}")
            convert_checkpoint(gguf, converted_path)
        else:
            converted_path = Path(converted).expanduser()
        env = env_info(["deepinfer", *sys.argv[1:]])
        payload = run_cpu_benchmark(gguf, converted_path, workload, say=console.print)
    path = write_json(results_path("cpu", gguf.stem, "cpu", output), payload, env)
    out = Console(width=200)
    for table in cpu_tables(payload):
        out.print(table)
    out.print(f"wrote {path}")


def _progress():
    """The sweep's progress bars on stderr, keeping stdout for the tables."""
    from rich.console import Console

    from deepinfer.core.bench.progress import RichSweepProgress

    return RichSweepProgress(Console(stderr=True))


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        fail(f"{flag} takes comma-separated integers, got {text!r}")
    if not values:
        fail(f"{flag} is empty")
    return values


def _json_file(path: str, flag: str) -> dict:
    import json

    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as err:
        fail(f"{flag}: cannot read {path}: {err}")
    if not isinstance(value, dict):
        fail(f"{flag}: {path} does not hold a JSON object")
    return value


def _finish(benchmark: str, config, payload: dict, tables: list, output: str | None) -> None:
    """Print the tables, write the JSON with the environment, say where it went."""
    import sys
    from pathlib import Path

    from rich.console import Console

    from deepinfer.core.bench.env_info import env_info, gpu_slug
    from deepinfer.core.bench.report import results_path, write_json

    env = env_info(["deepinfer", *sys.argv[1:]])
    subject = Path(config.shape or config.model or payload.get("model_name") or "default").stem
    if config.quantization:
        subject += f"-{config.quantization}"
    path = write_json(results_path(benchmark, subject, gpu_slug(env), output), payload, env)
    console = Console()
    if not console.is_terminal:  # logs and pipes: keep rows whole instead of wrapping at 80 columns
        console = Console(width=200)
    for table in tables:
        console.print(table)
    console.print(f"wrote {path}")
    if payload.get("interrupted"):
        fail(f"interrupted; what finished before it is in {path}", code=130)
