"""`deepinfer validate-kernels`: every CUDA kernel against its torch reference on this GPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from deepinfer.cli.errors import fail


def gpu_unavailable_reason(device: int) -> str | None:
    """Why the kernels cannot run on CUDA device `device` here (no CuPy, no GPU, torch without CUDA, a GPU older
    than the kernels need), or None."""
    from deepinfer.kernels import cuda_unavailable_reason, device_unsupported_reason

    reason = cuda_unavailable_reason()
    if reason is not None:
        return reason
    import torch

    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    if not 0 <= device < torch.cuda.device_count():
        return f"--device {device}: torch sees {torch.cuda.device_count()} CUDA device(s)"
    return device_unsupported_reason(device)


def _format(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def validate_kernels(
    output: Annotated[Path | None, typer.Option(help="JSON report path (default: results/kernel_validation_<gpu>.json)")] = None,
    device: Annotated[int, typer.Option(help="CUDA device index.")] = 0,
    workers: Annotated[int, typer.Option(help="Processes compiling kernels in parallel.")] = 8,
    seed: Annotated[int | None, typer.Option(help="Seed of the random inputs (default: from the clock).")] = None,
    show_passed: Annotated[bool, typer.Option(help="List passing checks too, not only failures.")] = True,
    only: Annotated[str | None, typer.Option(
        help="Comma-separated check groups to run (quant_matmul, dequantize, paged_decode_attention, "
             "paged_prefill_attention, rms_norm, act_and_mul, rope_cache_write, quant_matmul_rope_cache, "
             "quant_matmul_act_and_mul, w4_fragment_gemm, w8_gemm, token_bitmask, cuda_graph, end_to_end); default all.")] = None,
) -> None:
    """Check each CUDA kernel against its torch reference and write results/kernel_validation_<gpu>.json."""
    reason = gpu_unavailable_reason(device)
    if reason is not None:
        fail(f"validate-kernels needs an NVIDIA GPU with CuPy: {reason}")
    from rich.console import Console
    from rich.table import Table

    from deepinfer.core.bench.env_info import gpu_slug
    from deepinfer.validate.run import CHECK_GROUPS, run_validation

    groups = tuple(item.strip() for item in only.split(",") if item.strip()) if only else None
    unknown = [group for group in groups or () if group not in CHECK_GROUPS]
    if unknown:
        fail(f"--only: unknown check group(s) {', '.join(unknown)}; choose from {', '.join(CHECK_GROUPS)}")
    report = run_validation(device, workers, seed, command=["deepinfer", *sys.argv[1:]], only=groups)
    console = Console()
    table = Table(title=f"Kernel validation on {report['env'].get('gpu')} (seed {report['seed']})")
    for column in ("op", "case", "rel err", "cosine", "max abs", "result"):
        table.add_column(column, justify="left" if column in ("op", "case") else "right")
    for result in report["results"]:
        if result["ok"] and not show_passed:
            continue
        status = "[green]pass[/green]" if result["ok"] else f"[red]FAIL[/red] {result['detail'] or ''}"
        table.add_row(result["op"], result["case"], _format(result["rel_err"], ".2e"),
                      _format(result["cosine"], ".7f"), _format(result["max_abs"], ".3g"), status)
    console.print(table)
    compile_info = report["compile"]
    summary = report["summary"]
    console.print(f"compiled {compile_info['kernels']} kernels in {compile_info['wall_seconds']} s; "
                  f"{summary['checks']} checks, {summary['failed']} failed")
    path = output or Path("results") / f"kernel_validation_{gpu_slug(report['env'])}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    console.print(f"wrote {path}")
    if not report["passed"]:
        raise typer.Exit(1)
