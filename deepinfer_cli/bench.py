"""`deepinfer bench ...`: benchmarks that write JSON under results/ and print Rich tables."""

from __future__ import annotations

import typer

from deepinfer_cli.errors import not_landed

app = typer.Typer(help="Benchmarks (JSON under results/, Rich tables).", no_args_is_help=True)


@app.command("concurrency")
def concurrency() -> None:
    """Serial vs concurrent sweep: TTFT, TPOT, ITL percentiles and throughput."""
    not_landed("bench concurrency", 7)


@app.command("jitter")
def jitter() -> None:
    """Long-prompt insertion: the running stream's ITL against its baseline."""
    not_landed("bench jitter", 7)
