"""`deepinfer convert SRC OUT`: GPTQ / AWQ / GGUF / HF checkpoints to the W4A16/W3A16 (or W8A16) layered format."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

SrcArg = Annotated[Path, typer.Argument(
    help="GPTQ, AWQ or HF safetensors directory, or a .gguf file; the kind is detected.", metavar="SRC",
    show_default=False)]
OutArg = Annotated[Path, typer.Argument(help="New directory for the layered checkpoint (must not exist).", metavar="OUT",
                                        show_default=False)]
BitsOpt = Annotated[int | None, typer.Option(
    "--bits", help="Round-to-nearest bits, 4, 3 or 8, for HF sources and re-quantized GGUF tensors (default 4; "
                   "for GGUF, 8 is --keep-8bit). 8-bit layers run on the torch reference, not the CUDA kernels.")]
GroupSizeOpt = Annotated[int | None, typer.Option(
    "--group-size", help="Round-to-nearest group: 32, 64, 128, or -1 per-channel (default 128 for HF, "
                         "or 64 / 32 where 128 does not divide a layer's inputs; 32 for GGUF).")]
SymOpt = Annotated[bool, typer.Option("--sym", help="Symmetric round-to-nearest (zero point 2**(bits-1)).")]
Keep8bitOpt = Annotated[bool, typer.Option(
    "--keep-8bit", help="GGUF: store Q8_0 projections exactly at 8 bits and re-quantize Q5_K/Q6_K/F16 and other "
                        "non-4-bit types to 8 bits (group --group-size, default 32) instead of 4.")]


def convert(src: SrcArg, out: OutArg, bits: BitsOpt = None, group_size: GroupSizeOpt = None, sym: SymOpt = False,
            keep_8bit: Keep8bitOpt = False) -> None:
    """Convert a GPTQ, AWQ, GGUF or HF checkpoint to deepinfer's W4A16/W3A16 (or W8A16) layered format.

    GPTQ, AWQ and GGUF Q4_0/Q4_1/Q4_K weights are re-packed exactly, bit for bit (GGUF Q8_0 too, at
    8 bits, with --keep-8bit).
    HF weights and other GGUF types are round-to-nearest quantized; each tensor's error is reported.
    The result is written beside OUT and moved into place only when complete.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from deepinfer.core.weights.convert.run import convert_checkpoint
    from deepinfer.core.weights.convert.source import ConvertOptions

    options = ConvertOptions(bits=bits, group_size=group_size, sym=sym, keep_8bit=keep_8bit)
    console = Console(stderr=True)
    columns = (TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    # Off a terminal the bar draws nothing but its closing newline, which an error would start with.
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("reading source", total=None)

        def report(done: int, total: int, what: str) -> None:
            progress.update(task, completed=done, total=total, description=what)

        summary = convert_checkpoint(src, out, options, progress=report)
    stdout = Console()
    if not stdout.is_terminal:  # a pipe or a log: whole rows and whole tensor names, never wrapped
        stdout = Console(width=10_000)
    _print_summary(stdout, summary, out)


def _print_summary(console, summary, out: Path) -> None:
    from rich import box
    from rich.table import Table

    console.print(f"deepinfer convert: {summary.source_kind} -> {out} (errors: max / mean abs vs the source)",
                  markup=False, highlight=False, soft_wrap=True)
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("method", "source", "stored as", "n", "size", "max err", "mean err"):
        table.add_column(column, justify="left" if column in ("method", "source", "stored as") else "right",
                         no_wrap=True)
    for row in summary.rows():
        table.add_row(row.method, row.source_type, row.target_type, str(row.tensors),
                      f"{_size(row.bytes_before)} -> {_size(row.bytes_after)}", _error(row.max_abs_error),
                      _error(row.mean_abs_error))
    table.add_section()
    table.add_row("total", "", "", str(len(summary.records)),
                  f"{_size(summary.bytes_before)} -> {_size(summary.bytes_after)}", "", "")
    console.print(table)
    worst = summary.worst_requantized()
    if worst:
        console.print("largest errors (every tensor's is in manifest.json)", markup=False, soft_wrap=True)
        errors = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        for column in ("tensor", "source", "stored as", "max err", "mean err"):
            errors.add_column(column, justify="left" if column in ("tensor", "source", "stored as") else "right",
                              no_wrap=column != "tensor", overflow="fold")
        for record in worst:
            errors.add_row(record.name, record.source_type, record.target_type, _error(record.max_abs_error),
                           _error(record.mean_abs_error))
        console.print(errors)
    console.print(f"wrote {out}", markup=False, highlight=False, soft_wrap=True)


def _size(num_bytes: int) -> str:
    """Bytes in binary units: 612K, 63.3M, 3.52G."""
    if num_bytes >= 2**30:
        return f"{num_bytes / 2**30:.2f}G"
    if num_bytes >= 2**20:
        return f"{num_bytes / 2**20:.1f}M"
    return f"{num_bytes / 2**10:.0f}K"


def _error(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"
