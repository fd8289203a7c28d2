"""`deepinfer bench ...`: benchmarks that write JSON under results/ and print Rich tables."""

from __future__ import annotations

import logging
from pathlib import Path
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
    num_requests: Annotated[str | None, typer.Option(
        "--num-requests", "-n", help="Requests per level, or comma-separated, one per level (default max(2 x "
                                     "concurrency, 8)).")] = None,
    shared_prefix_len: Annotated[int, typer.Option(
        "--shared-prefix-len", help="Leading prompt tokens all requests of a level share (prefix cache).")] = 0,
    peer: Annotated[str | None, typer.Option(
        "--peer", help="hf: also run HF transformers model.generate (static batches) on the same prompts.")] = None,
    json_schema: Annotated[str | None, typer.Option(
        "--json-schema", help="A JSON Schema file; every request's output is constrained to it.")] = None,
    engine_process: Annotated[bool, typer.Option(
        "--engine-process/--no-engine-process",
        help="Run the engine core in its own process; the clients, detokenization and stop strings stay in "
             "this one (as serve --engine-process).")] = False,
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
        output_len=output_len, num_requests=_counts(num_requests, "--num-requests"), shared_prefix_len=shared_prefix_len, repeats=repeats,
        seed=config.seed, json_schema=_json_file(json_schema, "--json-schema") if json_schema else None)
    peer_source = None
    if peer == "hf":
        from deepinfer.core.bench.engine_client import cuda_device_of
        from deepinfer.core.bench.hf_peer import peer_source as hf_peer_source

        peer_source = hf_peer_source(config, cuda_device_of(config) or "cpu")
    with _progress() as progress:
        payload = run_concurrency_benchmark(config, workload, peer_source, progress, engine_process)
    _finish("concurrency", config, payload, concurrency_tables(payload), output)


@app.command("jitter")
@engine_flags("jitter")
def jitter(
    chunk_sizes: Annotated[str | None, typer.Option(
        "--chunk-sizes",
        help="Comma-separated chunked-prefill chunk sizes (the engine's max_num_batched_tokens), one engine "
             "each (default 64,128,256,512,1024,2048 on a GPU, 16,32,64,128,256 on the CPU).")] = None,
    long_prompt_len: Annotated[int | None, typer.Option(
        "--long-prompt-len", help="Tokens of the inserted prompt (default 2048 on a GPU, 256 on the CPU).")] = None,
    long_output_len: Annotated[int, typer.Option("--long-output-len", help="Output tokens of the long prompt.")] = 4,
    stream_prompt_len: Annotated[int, typer.Option("--stream-prompt-len", help="Prompt tokens of the stream.")] = 32,
    stream_output_len: Annotated[int | None, typer.Option(
        "--stream-output-len", help="Stream output tokens (default: enough to outlast the insertion).")] = None,
    insert_after: Annotated[int, typer.Option(
        "--insert-after", help="Stream tokens received before the long prompt is sent.")] = 16,
    itl_slo_ms: Annotated[float | None, typer.Option(
        "--itl-slo-ms", help="Pick the largest chunk size whose worst insertion ITL stays within this.")] = None,
    repeats: RepeatsOpt = 1,
    output: OutputOpt = None,
    verbose: VerboseOpt = False,
    *,
    engine: dict,
) -> None:
    """Long-prompt insertion: the running stream's ITL against its baseline, per chunk size."""
    _setup_logging(verbose)
    from types import SimpleNamespace

    from deepinfer.core.bench.engine_client import cuda_device_of
    from deepinfer.core.bench.jitter import (
        DEFAULT_CHUNK_SIZES,
        JitterWorkload,
        default_long_prompt_len,
        run_jitter_benchmark,
    )
    from deepinfer.core.bench.report import jitter_tables
    from deepinfer.core.config import EngineConfig

    # Only the device flag decides the defaults; the config is built once, with the sweep's largest chunk.
    device = cuda_device_of(SimpleNamespace(device=engine.get("device") or EngineConfig.device))
    sizes = (_int_list(chunk_sizes, "--chunk-sizes") if chunk_sizes is not None
             else DEFAULT_CHUNK_SIZES["gpu" if device else "cpu"])
    config = engine_config(engine, max_num_batched_tokens=max(sizes))
    workload = JitterWorkload(
        chunk_sizes=sizes, long_prompt_len=long_prompt_len or default_long_prompt_len(device is not None),
        long_output_len=long_output_len, stream_prompt_len=stream_prompt_len, stream_output_len=stream_output_len,
        insert_after=insert_after, repeats=repeats, itl_slo_ms=itl_slo_ms, seed=config.seed)
    with _progress() as progress:
        payload = run_jitter_benchmark(config, workload, progress, device="GPU" if device else "CPU")
    _finish("jitter", config, payload, jitter_tables(payload), output)


@app.command("host")
@engine_flags("concurrency")
def host(
    num_seqs: Annotated[str, typer.Option(
        "--num-seqs", help="Comma-separated numbers of running sequences.")] = "1,32,64,128,256,512",
    modes: Annotated[str, typer.Option(
        "--modes", help="decode (every stream decodes), mixed (a long prompt chunked beside them), or both.")
    ] = "decode,mixed",
    forward: Annotated[str, typer.Option(
        "--forward", help="stand-in: a forward and sampler that cost nothing, on the CPU; model: the real "
                          "model and sampler on --device (a GPU), with the device time of the same steps "
                          "and wall/GPU beside wall and CPU.")] = "stand-in",
    steps: Annotated[int, typer.Option("--steps", help="Timed steps per point (and as many for the phases).")] = 64,
    repeats: Annotated[int, typer.Option(
        "--repeats", help="Timed passes per point; the least disturbed (cheapest core) is kept.")] = 3,
    warmup_steps: Annotated[int, typer.Option("--warmup-steps", help="Untimed steps once every stream decodes.")] = 8,
    prompt_len: Annotated[int, typer.Option("--prompt-len", help="Prompt tokens of each stream.")] = 128,
    long_prompt_len: Annotated[int, typer.Option(
        "--long-prompt-len", help="Tokens of the prompt mixed steps chunk.")] = 8192,
    baseline: Annotated[str | None, typer.Option(
        "--baseline", help="A previous bench host JSON, kept in this one as `baseline` and set beside it.")] = None,
    output: OutputOpt = None,
    verbose: VerboseOpt = False,
    *,
    engine: dict,
) -> None:
    """The engine loop's host cost per step and per running sequence, and where it goes (the engine in this
    process: the front end's share is measured beside the core's, on the same thread)."""
    _setup_logging(verbose)
    from rich.console import Console

    from deepinfer.core.bench.host_bench import HostWorkload, host_tables, run_host_benchmark

    baseline_run = _json_file(baseline, "--baseline") if baseline else None
    if forward not in ("stand-in", "model"):
        fail(f"--forward takes stand-in or model, got {forward!r}")
    # --tokenizer: the model's (the engine flag) with --forward model; the stand-in's otherwise: byte (one id
    # per byte), a tokenizer path, or by default the default model's when it is on disk
    tokenizer = engine.get("tokenizer") if forward == "stand-in" else None
    if tokenizer is not None:
        del engine["tokenizer"]
    config = engine_config(engine) if forward == "model" else _stand_in_config(engine)
    workload = HostWorkload(num_seqs=_int_list(num_seqs, "--num-seqs"),
                            modes=[m.strip() for m in modes.split(",") if m.strip()], steps=steps, repeats=repeats,
                            warmup_steps=warmup_steps, prompt_len=prompt_len, long_prompt_len=long_prompt_len,
                            seed=config.seed)
    console = Console(stderr=True)

    def on_point(point: dict) -> None:
        console.print(f"{point['mode']} {point['num_seqs']} seqs: {point['cpu_us_per_step_mean']:.0f} CPU µs/step, "
                      f"core {point['core_cpu_us_per_seq']:.2f} µs/seq, front end "
                      f"{point['front_end_cpu_us_per_token'] or 0:.2f} µs/token")

    stand_in_tokenizer = None
    if tokenizer is not None:
        from deepinfer.core.bench.host_bench import STAND_IN_VOCAB_SIZE, stand_in_spec
        from deepinfer.core.errors import ModelLoadError
        from deepinfer.core.models.loader import load_given_tokenizer
        from deepinfer.core.tokenizer import ByteTokenizer

        try:
            stand_in_tokenizer = (ByteTokenizer(STAND_IN_VOCAB_SIZE) if tokenizer == "byte" else
                                  load_given_tokenizer(Path(tokenizer).expanduser(),
                                                       stand_in_spec(STAND_IN_VOCAB_SIZE, config.max_model_len or 4096)))
        except ModelLoadError as err:
            fail(f"--tokenizer: {err}")
    payload = run_host_benchmark(config, workload, forward, on_point, stand_in_tokenizer)
    if baseline_run is not None:
        payload["baseline"] = {key: baseline_run.get(key) for key in ("env", "points", "fit", "workload")}
    _finish("host", config, payload, host_tables(payload), output, subject="stand-in" if forward == "stand-in" else None)


def _stand_in_config(engine: dict):
    """The stand-in's EngineConfig: only the scheduling flags matter (block size, budget, prefix caching)."""
    from deepinfer.core.config import EngineConfig

    kept = ("seed", "block_size", "enable_prefix_caching", "max_num_batched_tokens", "async_scheduling",
            "max_waiting_requests")
    return EngineConfig(**{key: value for key, value in engine.items() if key in kept})


@app.command("gemv")
def gemv(
    shapes: Annotated[str, typer.Option(
        "--shapes", help="Comma-separated in x out feature pairs.")] = "2048x2048,2048x11008,4096x4096,4096x14336,"
                                                                      "14336x4096,8192x8192",
    batches: Annotated[str, typer.Option("--batches", help="Comma-separated token counts.")] = "1,2,4,8,16,32,64",
    bits: Annotated[str, typer.Option("--bits", help="Comma-separated weight bit widths (4, 3, 8).")] = "4,3",
    attention: Annotated[bool, typer.Option(help="Also time paged decode attention.")] = True,
    dtype: Annotated[str, typer.Option("--dtype", help="Activation dtype of the quantized products: "
                                                       "float16 | bfloat16.")] = "float16",
    repeats: RepeatsOpt = 5,
    device: Annotated[int, typer.Option("--device", help="CUDA device index.")] = 0,
    output: OutputOpt = None,
) -> None:
    """W4A16/W3A16/W8A16 kernels and paged decode attention: achieved bandwidth vs device copy bandwidth; from 16
    tokens also the W4 GEMM, cuBLAS on the dense weight (at every count for 8-bit), and each product's share of its
    floor."""
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

@app.command("serve", context_settings={"allow_extra_args": True})
def serve(
    ctx: typer.Context,
    base_url: Annotated[str | None, typer.Option(
        "--base-url", help="The server to benchmark, e.g. http://127.0.0.1:8000 (or use --serve).")] = None,
    model: Annotated[str | None, typer.Option(
        "--model", help="Model name sent to the server (default: the first entry of its /v1/models).")] = None,
    compare: Annotated[list[str] | None, typer.Option(
        "--compare", help="URL[=MODEL] of another server to run the same workload against (repeatable).")] = None,
    serve_model: Annotated[str | None, typer.Option(
        "--serve", help="Start `deepinfer serve --model MODEL` on a free local port, benchmark it, stop it.")] = None,
    serve_args: Annotated[str, typer.Option(
        "--serve-args", help="Flags for --serve's server, one string (e.g. \"--max-num-seqs 64 --dtype bfloat16\").")
    ] = "",
    endpoint: Annotated[str, typer.Option("--endpoint", help="completions | chat.")] = "completions",
    concurrency_levels: Annotated[str | None, typer.Option(
        "--concurrency", "-c", help="Comma-separated closed-loop client counts (default 1,8,32,64 without "
                                    "--request-rate).")] = None,
    request_rates: Annotated[str | None, typer.Option(
        "--request-rate", help="Comma-separated open-loop arrival rates in requests/s; inf sends all at once.")
    ] = None,
    burstiness: Annotated[float, typer.Option(
        "--burstiness", help="Gamma shape of the arrival gaps: 1 is Poisson, < 1 bursts, > 1 more even.")] = 1.0,
    num_prompts: Annotated[str | None, typer.Option(
        "--num-prompts", "-n", help="Requests per level, or comma-separated, one per level (default max(2 x "
                                    "concurrency, 8), as bench concurrency; 100 per rate).")
    ] = None,
    max_concurrency: Annotated[int | None, typer.Option(
        "--max-concurrency", help="Open loop: requests in flight at most (later arrivals wait).")] = None,
    dataset: Annotated[str, typer.Option("--dataset", help="random | shared-prefix | sharegpt.")] = "random",
    input_len: Annotated[int, typer.Option("--input-len", help="Prompt tokens (random, shared-prefix).")] = 512,
    output_len: Annotated[int | None, typer.Option(
        "--output-len", help="Output tokens per request (default 128; sharegpt: each reply's length).")] = None,
    range_ratio: Annotated[float, typer.Option(
        "--range-ratio", help="Lengths drawn uniformly within +- this fraction of --input-len/--output-len.")] = 0.0,
    prefix_len: Annotated[int, typer.Option(
        "--prefix-len", help="shared-prefix: tokens of the prefix in front of every prompt.")] = 256,
    num_prefixes: Annotated[int, typer.Option(
        "--num-prefixes", help="shared-prefix: distinct prefixes, used round robin.")] = 1,
    dataset_path: Annotated[str | None, typer.Option(
        "--dataset-path", help="A ShareGPT-format JSON file (implies --dataset sharegpt).")] = None,
    tokenizer: Annotated[str | None, typer.Option(
        "--tokenizer", help="Tokenizer (a GGUF file, a directory or a Hub id) that makes the prompts and counts "
                            "tokens a server does not report (default: --serve's model, else the model name).")
    ] = None,
    goodput: Annotated[list[str] | None, typer.Option(
        "--goodput", help="SLOs in ms: --goodput ttft:500 tpot:20 (ttft, tpot, e2e); a request that meets "
                          "all is good.")] = None,
    temperature: Annotated[float, typer.Option("--temperature", help="Sampling temperature sent.")] = 0.0,
    ignore_eos: Annotated[bool, typer.Option(
        help="Send ignore_eos so every request runs to its output length.")] = True,
    extra_body: Annotated[str | None, typer.Option(
        "--extra-body", help="A JSON object merged into every request body.")] = None,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="OPENAI_API_KEY", help="Sent as 'Authorization: Bearer KEY' (not recorded).")] = None,
    request_timeout: Annotated[float, typer.Option(
        "--request-timeout", help="Seconds a request may take in all; then it counts as an error.")] = 600.0,
    stall_timeout: Annotated[float, typer.Option(
        "--stall-timeout", help="Seconds without a byte from the server; then the request counts as an error.")
    ] = 60.0,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed requests per server before the levels.")] = 1,
    seed: Annotated[int, typer.Option("--seed", help="Prompts and arrival schedule (the same for every server).")
    ] = 0,
    output: OutputOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Benchmark OpenAI-compatible HTTP servers: closed-loop concurrency or open-loop request rates,
    TTFT / TPOT / ITL / E2E, throughput, errors and goodput; several servers side by side."""
    _setup_logging(verbose)
    from deepinfer.core.bench.serve_bench import ServeSweep, ServeTarget, resolve_targets, run_serve_benchmark
    from deepinfer.core.bench.serve_client import ENDPOINTS, RequestSettings
    from deepinfer.core.bench.serve_launcher import LocalServer
    from deepinfer.core.bench.serve_report import serve_tables
    from deepinfer.core.bench.serve_workload import PromptMaker, ServeWorkload
    from deepinfer.core.errors import DeepInferError

    # `--goodput ttft:500 tpot:20` as vllm bench serve takes it: the pairs after the first arrive as extra args
    stray = [arg for arg in ctx.args if not (goodput and ":" in arg and not arg.startswith("-"))]
    if stray:
        fail(f"unexpected argument {stray[0]!r}")
    goodput = [*(goodput or []), *ctx.args]
    if (base_url is None) == (serve_model is None):
        fail("give either --base-url URL or --serve MODEL")
    if endpoint not in ENDPOINTS:
        fail(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
    if concurrency_levels is not None and request_rates is not None:
        fail("give --concurrency or --request-rate, not both")
    if max_concurrency is not None and request_rates is None:
        fail("--max-concurrency caps an open loop (--request-rate); closed-loop levels are their own cap")
    if dataset_path is not None:
        dataset = "sharegpt"
    for flag, value in (("--request-timeout", request_timeout), ("--stall-timeout", stall_timeout)):
        if not value > 0:
            fail(f"{flag} must be > 0, got {value}")
    try:
        workload = ServeWorkload(kind=dataset, input_len=input_len,
                                 output_len=output_len if output_len is not None or dataset == "sharegpt" else 128,
                                 range_ratio=range_ratio, prefix_len=prefix_len if dataset == "shared-prefix" else 0,
                                 num_prefixes=num_prefixes, dataset_path=dataset_path, seed=seed)
        sweep = ServeSweep(
            concurrency_levels=None if request_rates is not None else _int_list(concurrency_levels or "1,8,32,64",
                                                                                "--concurrency"),
            request_rates=None if request_rates is None else _rate_list(request_rates), burstiness=burstiness,
            num_prompts=_counts(num_prompts, "--num-prompts"), max_concurrency=max_concurrency, goodput_slo_ms=_goodput(goodput),
            warmup_requests=warmup, seed=seed)
    except DeepInferError as err:
        fail(str(err))
    settings = RequestSettings(endpoint=endpoint, temperature=temperature, ignore_eos=ignore_eos,
                               extra_body=_json_object(extra_body, "--extra-body") if extra_body else {},
                               request_timeout_s=request_timeout, stall_timeout_s=stall_timeout)
    targets = [] if base_url is None else [ServeTarget(base_url, model, api_key)]
    for item in compare or []:
        url, _, name = item.partition("=")
        targets.append(ServeTarget(url, name or None, api_key))
    for target in targets:
        if not target.base_url.startswith(("http://", "https://")):
            fail(f"a server URL must start with http:// or https://, got {target.base_url!r}")

    def run(served_tokenizer: str | None) -> dict:
        resolve_targets(targets)
        tokenizer_spec = tokenizer or served_tokenizer or targets[0].model
        try:
            maker = PromptMaker(workload, _load_tokenizer(tokenizer_spec, given=tokenizer is not None))
        except DeepInferError as err:
            fail(str(err))
        with _progress() as progress:
            return run_serve_benchmark(targets, settings, sweep, maker, progress)

    if serve_model is None:
        payload = run(None)
    else:
        from deepinfer.core.weights.hub import resolve_model

        local_model = str(resolve_model(serve_model))  # downloads once; the server then finds it cached
        with LocalServer(local_model, serve_args) as server:
            targets.insert(0, ServeTarget(server.base_url, model, started_by=server.serve_command))
            payload = run(local_model)
    payload["tokenizer"] = tokenizer or (serve_model if serve_model else payload["targets"][0]["model"])
    _finish_serve(payload, serve_tables(payload, workload.describe()), output)


def _load_tokenizer(spec: str, given: bool):
    from deepinfer.core.bench.serve_workload import load_tokenizer
    from deepinfer.core.errors import DeepInferError

    try:
        return load_tokenizer(spec)
    except DeepInferError as err:
        if given:
            fail(f"--tokenizer: {err}")
        fail(f"no tokenizer for {spec!r} ({err}); pass --tokenizer (a GGUF file, a directory or a Hub id)")


def _rate_list(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        fail(f"--request-rate takes comma-separated numbers or inf, got {text!r}")
    if not values:
        fail("--request-rate is empty")
    return values


def _goodput(items: list[str]) -> dict[str, float]:
    """['ttft:500 tpot:20', 'e2e:3000'] -> {'ttft': 500.0, 'tpot': 20.0, 'e2e': 3000.0}."""
    slo: dict[str, float] = {}
    for pair in " ".join(items).replace(",", " ").split():
        name, _, value = pair.partition(":")
        name = "e2e" if name == "e2el" else name
        try:
            slo[name] = float(value)
        except ValueError:
            fail(f"--goodput takes NAME:MS pairs (ttft, tpot, e2e), got {pair!r}")
    return slo


def _json_object(text: str, flag: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except ValueError as err:
        fail(f"{flag}: not JSON: {err}")
    if not isinstance(value, dict):
        fail(f"{flag} must be a JSON object, got {text!r}")
    return value


def _redacted_argv() -> list[str]:
    """The command line to record, without the value of --api-key."""
    import sys

    args, hide = [], False
    for arg in sys.argv[1:]:
        if hide:
            args.append("REDACTED")
            hide = False
        elif arg == "--api-key":
            args.append(arg)
            hide = True
        else:
            args.append("--api-key=REDACTED" if arg.startswith("--api-key=") else arg)
    return ["deepinfer", *args]


def _finish_serve(payload: dict, tables: list, output: str | None) -> None:
    from deepinfer.core.bench.env_info import env_info

    subject = (payload["targets"][0].get("model") if payload["targets"] else None) or "server"
    path = _write_and_show("serve", subject.rsplit("/", 1)[-1], payload, env_info(_redacted_argv()), tables, output)
    failed = [target for target in payload["targets"] if target.get("error")]
    if failed:
        fail("; ".join(target["error"] for target in failed) + f" (the others are in {path})")


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


def _counts(text: str | None, flag: str) -> int | list[int] | None:
    """A request count for every level, or one per level."""
    if text is None:
        return None
    values = _int_list(text, flag)
    return values[0] if len(values) == 1 else values


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


def _finish(benchmark: str, config, payload: dict, tables: list, output: str | None,
            subject: str | None = None) -> None:
    """Print the tables, write the JSON with the environment, say where it went."""
    import sys
    from pathlib import Path

    from deepinfer.core.bench.env_info import env_info

    subject = subject or Path(config.shape or config.model or payload.get("model_name") or "default").stem
    if config.quantization:
        subject += f"-{config.quantization}"
    _write_and_show(benchmark, subject, payload, env_info(["deepinfer", *sys.argv[1:]]), tables, output)


def _write_and_show(benchmark: str, subject: str, payload: dict, env: dict, tables: list, output: str | None):
    """Write the JSON with `env`, print the tables and where the file went; exit 130 for an interrupted run.
    Returns the file's path."""
    from rich.console import Console

    from deepinfer.core.bench.env_info import gpu_slug
    from deepinfer.core.bench.report import results_path, write_json

    path = write_json(results_path(benchmark, subject, gpu_slug(env), output), payload, env)
    console = Console()
    if not console.is_terminal:  # logs and pipes: keep rows whole instead of wrapping at 80 columns
        console = Console(width=200)
    for table in tables:
        console.print(table)
    console.print(f"wrote {path}")
    if payload.get("interrupted"):
        fail(f"interrupted; what finished before it is in {path}", code=130)
    return path
