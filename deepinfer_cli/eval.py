"""`deepinfer eval`: perplexity over a text file in sliding windows, and KL-divergence against a reference model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from deepinfer.cli.errors import fail

ModelOpt = Annotated[str | None, typer.Option(
    "--model", "-m", help="Model to measure: anything --model of chat takes (HF or GPTQ/AWQ directory, .gguf, "
                          "layered checkpoint, Hugging Face id).", show_default="SmolLM2-135M-Instruct")]
QuantOpt = Annotated[str | None, typer.Option(
    "--quantization", "--quant", help="w4a16 or w3a16: round-to-nearest quantization of --model at load (group 128, "
                                      "or 64 / 32 where 128 does not divide a layer's inputs).")]
ReferenceOpt = Annotated[str | None, typer.Option(
    "--reference", help="Reference model (bf16 HF directory, a GGUF, any model deepinfer loads): adds KL-divergence "
                        "(mean, p99), top-1 agreement and the perplexity ratio.")]
TextOpt = Annotated[Path, typer.Option("--text", help="UTF-8 text file to score.", show_default=False)]
CtxOpt = Annotated[int, typer.Option("--ctx", help="Tokens per window; its second half is scored.")]
StrideOpt = Annotated[int | None, typer.Option(
    "--stride", help="Tokens between window starts.", show_default="--ctx")]
MaxWindowsOpt = Annotated[int | None, typer.Option("--max-windows", help="Score at most this many windows.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="auto, float32, bfloat16 or float16.")]
OutputOpt = Annotated[str | None, typer.Option(
    "--output", help="JSON path (default: results/bench_eval_<model>_<device>_<time>.json).")]


def eval_command(text: TextOpt, model: ModelOpt = None, quantization: QuantOpt = None, reference: ReferenceOpt = None,
                 ctx: CtxOpt = 512, stride: StrideOpt = None, max_windows: MaxWindowsOpt = None,
                 device: DeviceOpt = "auto", dtype: DtypeOpt = "auto", output: OutputOpt = None) -> None:
    """Perplexity of --model over --text in windows of --ctx tokens (llama-perplexity's layout), and with
    --reference its KL-divergence from the reference, top-1 agreement and perplexity ratio: JSON + table."""
    import hashlib
    import sys

    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from deepinfer.cli.bench import _write_and_show
    from deepinfer.core.bench.env_info import env_info
    from deepinfer.core.config import EngineConfig
    from deepinfer.core.engine.worker.startup import resolve_device, resolve_dtype
    from deepinfer.core.eval.quality import evaluate, quality_table
    from deepinfer.core.eval.windows import plan_windows
    from deepinfer.core.models.loader import load_model

    try:
        raw = text.read_bytes()
        content = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as err:
        fail(f"--text: cannot read {text} as UTF-8 text: {err}")
    if quantization not in (None, "w4a16", "w3a16"):
        fail(f"--quantization takes w4a16 or w3a16, got {quantization!r}")
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    loaded = load_model(EngineConfig(model=model, device=device, dtype=dtype, quantization=quantization),
                        torch_device, torch_dtype)
    tokens = loaded.tokenizer.encode(content)
    try:
        windows = plan_windows(len(tokens), ctx, stride, max_windows)
    except ValueError as err:
        fail(str(err))
    reference_model = None
    if reference is not None:
        reference_loaded = load_model(EngineConfig(model=reference, device=device, dtype=dtype), torch_device,
                                      torch_dtype)
        if reference_loaded.tokenizer.encode(content) != tokens:
            fail(f"--reference {reference} tokenizes the text differently from --model: KL-divergence compares "
                 f"the same tokens")
        reference_model = reference_loaded.model
    console = Console(stderr=True)
    columns = (TextColumn("scoring windows"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("", total=len(windows))
        results = evaluate(loaded.model, tokens, windows, reference_model,
                           progress=lambda done, total: progress.update(task, completed=done, total=total))
    payload = {
        "benchmark": "eval", "model_name": loaded.name, "model": model, "quantization": quantization,
        "reference_name": None if reference is None else reference_loaded.name, "reference": reference,
        "text": {"path": str(text), "sha256": hashlib.sha256(raw).hexdigest(), "tokens": len(tokens)},
        "ctx": ctx, "stride": stride or ctx, "device": str(torch_device), "dtype": str(torch_dtype).removeprefix("torch."),
        "results": results,
    }
    subject = loaded.name + (f"-{quantization}" if quantization else "")
    _write_and_show("eval", subject, payload, env_info(["deepinfer", *sys.argv[1:]]), [quality_table(payload)], output)
