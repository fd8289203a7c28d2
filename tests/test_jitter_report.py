"""bench jitter's output: its table read at 80 columns with every value whole, and its up-front
estimate of the engine steps against the steps the sweep really runs."""

from __future__ import annotations

import pytest
from rich.console import Console

from deepinfer.core.bench.report import jitter_tables


def _result(chunk_size: int, complete: bool = True) -> dict:
    # CPU-sized values (seconds-long TTFTs) with a spread, the widest cells the table gets.
    return {"chunk_size": chunk_size,
            "baseline_itl_ms": {"p50": 180.66, "p95": 223.1, "p99": 248.6, "mean": 171.0, "max": 259.9},
            "insertion_window_itl_ms": {"p50": 370.93, "p95": 470.0, "p99": 490.0, "mean": 380.0, "max": 1494.87},
            "insertion_window_num_itls": 39, "insertion_window_complete": complete,
            "insertion_stream_itl_ms": {"p50": 200.0, "p95": 400.0, "p99": 450.0, "mean": 220.0, "max": 494.9},
            "insertion_window_engine_steps": 40, "insertion_window_max_prompt_tokens_per_step": chunk_size - 1,
            "long_ttft_alone_ms": {"mean": 111138.4, "std": 12345.6},
            "long_ttft_inserted_ms": {"mean": 114148.8, "std": 2345.6}}


def _payload(slo: bool) -> dict:
    results = [_result(8), _result(16), _result(2048, complete=False)]
    return {"model_name": "SmolLM2-135M-Instruct.Q4_1",
            "workload": {"chunk_sizes": [8, 16, 2048], "long_prompt_len": 256, "long_output_len": 4,
                         "stream_prompt_len": 32, "stream_output_len": 69, "insert_after": 16, "repeats": 3},
            "chunk_sizes": results,
            "slo": {"itl_slo_ms": 12.5, "chosen_chunk_size": 16, "long_ttft_inserted_ms": 114148.8,
                    "insertion_window_itl_max_ms": 1494.87, "note": None} if slo else None}


@pytest.mark.parametrize("slo", [False, True])
def test_the_jitter_table_reads_whole_at_80_columns(slo):
    payload = _payload(slo)
    console = Console(width=80, record=True, color_system=None)
    for table in jitter_tables(payload):
        console.print(table)
    text = console.export_text()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in text
    assert "long prompt 256 tokens" in " ".join(text.split())  # the title (wrapped) names the prompt's length
    header = [line for line in lines if "chunk" in line and "stream ITL" in line]
    assert header, text  # no blank header: each column's name is printed
    for name in ("size", "alone p50", "inserted p50/max", "max /", "long TTFT", "alone / inserted"):
        assert name in text
    for result in payload["chunk_sizes"]:
        row = next(line for line in lines if line.split() and line.split()[0] == str(result["chunk_size"]))
        for cell in ("180.7", "370.9 / 1494.9", "8.27x", "111138 / 114149"):
            assert cell in row, (cell, row)
        assert ("cut" in row) == (not result["insertion_window_complete"])
        if slo:
            assert row.split()[-1] == ("chosen" if result["chunk_size"] == 16 else "no")


def test_the_estimate_up_front_is_near_the_steps_the_sweep_runs(tiny_llama_dir):
    from deepinfer.core.bench.jitter import JitterWorkload, run_jitter_benchmark
    from deepinfer.core.bench.progress import SweepProgress
    from deepinfer.core.config import EngineConfig

    class Counter(SweepProgress):
        estimate, steps, summary = 0, 0, ""

        def sweep_started(self, summary, total_steps):
            self.summary, self.estimate = summary, total_steps

        def engine_steps(self, steps):
            self.steps += steps

    counter = Counter()
    workload = JitterWorkload(chunk_sizes=[4, 16], long_prompt_len=40, stream_prompt_len=6, insert_after=3)
    run_jitter_benchmark(EngineConfig(model=str(tiny_llama_dir), device="cpu", max_num_batched_tokens=16),
                         workload, counter)
    assert counter.summary.endswith(f"about {counter.estimate} engine steps")
    assert 0.8 * counter.steps <= counter.estimate <= 1.2 * counter.steps, (counter.estimate, counter.steps)


def test_the_sweep_bars_keep_every_number_whole_at_80_columns():
    import io

    from deepinfer.core.bench.progress import RichSweepProgress

    console = Console(file=io.StringIO(), width=80, color_system=None, record=True)
    progress = RichSweepProgress(console)
    progress.sweep_started("bench jitter on the CPU: ...", 1000)
    progress.level_started("chunk 64: starting", 4)
    progress.advance(requests=1, tokens=30)
    progress.engine_steps(10)
    console.print(*progress._progress.get_renderables())  # what a redraw draws: the counters synced first
    sweep, level = console.export_text().splitlines()[-2:]
    assert sweep.split()[0] == "sweep" and {"10/1000", "steps", "left"} <= set(sweep.split())
    assert "1/4" in level.split() and "tok/s" in level.split() and len(level.rstrip()) <= 80
