"""Benchmark output: one JSON file per run (with the environment that produced it) and Rich tables.

Tables follow llama-bench: a value over repeats reads `mean ± std` (just the mean for one run).
Latencies are milliseconds; percentile cells read `p50 / p95 / p99`.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

from rich.table import Table

GIB = 1024**3


def results_path(benchmark: str, subject: str, device_name: str, output: str | None,
                 results_dir: str | Path = "results") -> Path:
    """`--output PATH` as given, else results/bench_<benchmark>_<subject>_<device>_<timestamp>.json."""
    if output is not None:
        return Path(output)
    def slug(text: str) -> str:
        return re.sub(r"[^A-Za-z0-9._]+", "-", text).strip("-").lower() or "unknown"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(results_dir) / f"bench_{benchmark}_{slug(subject)}_{slug(device_name)}_{stamp}.json"


def _finite(value):
    """JSON has no NaN/inf: write them as null, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_json(path: Path, payload: dict, env: dict) -> Path:
    """`payload` plus `env` (GPU, driver, versions, git commit, command line) as indented JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"env": env, **payload}
    path.write_text(json.dumps(_finite(document), indent=2, default=str) + "\n")
    return path


def format_mean_std(stat: dict | None, digits: int = 1, scale: float = 1.0) -> str:
    """{'mean': m, 'std': s} -> 'm ± s' ('m' alone for one run, '-' when missing)."""
    if not stat or stat.get("mean") is None:
        return "-"
    text = f"{stat['mean'] * scale:.{digits}f}"
    if stat.get("std") is not None:
        text += f" ± {stat['std'] * scale:.{digits}f}"
    return text


def _triplet(stats: dict, name: str, keys: tuple[str, ...] = ("p50", "p95", "p99"), digits: int = 1) -> str:
    values = [stats.get(f"{name}.{k}", {}).get("mean") for k in keys]
    return " / ".join("-" if v is None else f"{v:.{digits}f}" for v in values)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def concurrency_tables(payload: dict) -> list[Table]:
    """Two tables: throughput and memory per level, then latency percentiles per level."""
    workload = payload["workload"]
    title = (f"deepinfer bench concurrency: {payload.get('model_name')}  prompt {workload['prompt_len']}, "
             f"output {workload['output_len']}, shared prefix {workload['shared_prefix_len']}, "
             f"repeats {workload['repeats']}")
    has_peer = payload.get("peer") is not None
    throughput = Table(title=title, title_justify="left")
    latency = Table(title="latency, ms (p50 / p95 / p99)", title_justify="left")
    columns = ["c", "reqs", "out tok/s", "req/s", "vs c=1", "peak alloc GiB", "peak reserved GiB", "prefix hit",
               "preempt"]
    if has_peer:
        columns += ["HF tok/s", "vs HF"]
    for name in columns:
        throughput.add_column(name, justify="right", no_wrap=True)
    for name in ["c", "TTFT", "TPOT", "ITL", "decode step p50"] + (["HF TTFT", "HF TPOT"] if has_peer else []):
        latency.add_column(name, justify="right", no_wrap=True)
    for level in payload["levels"]:
        stats = level["mean_std"]
        hit = stats.get("prefix_cache_hit_rate", {}).get("mean")
        row = [
            str(level["concurrency"]), str(level["num_requests"]),
            format_mean_std(stats.get("output_tokens_per_s")), format_mean_std(stats.get("requests_per_s"), 2),
            _ratio(level.get("speedup_vs_serial")),
            format_mean_std(stats.get("peak_allocated_bytes"), 2, 1 / GIB),
            format_mean_std(stats.get("peak_reserved_bytes"), 2, 1 / GIB),
            "-" if hit is None else f"{hit:.0%}",
            format_mean_std(stats.get("num_preemptions"), 0),
        ]
        latency_row = [str(level["concurrency"]), _triplet(stats, "ttft_ms"), _triplet(stats, "tpot_ms", digits=2),
                       _triplet(stats, "itl_ms", digits=2), _triplet(stats, "decode_step_ms", ("p50",), digits=2)]
        if has_peer:
            peer = level.get("peer", {}).get("mean_std", {})
            row += [format_mean_std(peer.get("output_tokens_per_s")),
                    _ratio(level.get("vs_peer", {}).get("output_tokens_per_s_ratio"))]
            latency_row += [_triplet(peer, "ttft_ms"), _triplet(peer, "tpot_ms", digits=2)]
        throughput.add_row(*row)
        latency.add_row(*latency_row)
    return [throughput, latency]


def _pct(stats: dict, keys: tuple[str, ...] = ("p50", "p95", "max")) -> str:
    return " / ".join("-" if stats.get(k) is None else f"{stats[k]:.1f}" for k in keys)


def _mean(stat: dict | None) -> str:
    return "-" if not stat or stat.get("mean") is None else f"{stat['mean']:.0f}"


def jitter_tables(payload: dict) -> list[Table]:
    """One table that fits 80 columns: medians, worst cases and TTFTs per chunk size (every percentile,
    window size and per-step chunk is in the JSON)."""
    from rich import box

    workload = payload["workload"]
    slo = payload.get("slo")
    title = (f"deepinfer bench jitter: {payload.get('model_name')}, long prompt {workload['long_prompt_len']} tokens "
             f"sent after {workload['insert_after']} of the stream's {workload['stream_prompt_len']}+"
             f"{workload['stream_output_len']} tokens, repeats {workload['repeats']}")
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, caption_justify="left")
    columns = ["chunk\nsize", "stream ITL\nalone p50", "stream ITL\ninserted p50/max", "max /\nalone",
               "long TTFT\nalone / inserted"]
    if slo is not None:
        columns.append(f"max ITL\n<= {slo['itl_slo_ms']:g}")
    for name in columns:
        table.add_column(name, justify="right", no_wrap=True)
    for result in payload["chunk_sizes"]:
        alone, window = result["baseline_itl_ms"], result["insertion_window_itl_ms"]
        worst = window["max"] / alone["p50"] if window["max"] and alone["p50"] else None
        row = [
            str(result["chunk_size"]), _pct(alone, ("p50",)),
            _pct(window, ("p50", "max")) + ("" if result["insertion_window_complete"] else " cut"), _ratio(worst),
            f"{_mean(result['long_ttft_alone_ms'])} / {_mean(result['long_ttft_inserted_ms'])}",
        ]
        if slo is not None:
            meets = (result["insertion_window_complete"] and window["max"] is not None
                     and window["max"] <= slo["itl_slo_ms"])
            row.append("chosen" if result["chunk_size"] == slo["chosen_chunk_size"] else "yes" if meets else "no")
        table.add_row(*row)
    caption = ("Milliseconds. The stream's inter-token latency alone and while the long prompt is prefilled "
               "(\"cut\": the stream ended first); the long prompt's time to first token alone and inserted"
               + (", means over the repeats (their spread is in the JSON)." if workload["repeats"] > 1 else "."))
    if slo is not None:
        caption += f" SLO max ITL <= {slo['itl_slo_ms']:g} ms: " + (
            f"chunk size {slo['chosen_chunk_size']}, long-prompt TTFT {slo['long_ttft_inserted_ms']:.0f} ms."
            if slo["chosen_chunk_size"] is not None else slo["note"] + ".")
    table.caption = caption
    return [table]


def concurrency_level_line(level: dict, who: str = "engine") -> str:
    """One finished level in a line, printed while the sweep goes on (the tables come at the end)."""
    stats = level["mean_std"]

    def p50(name: str, digits: int) -> str:
        value = stats.get(f"{name}.p50", {}).get("mean")
        return "-" if value is None else f"{value:.{digits}f}"

    return (f"{who} c={level['concurrency']}: {format_mean_std(stats.get('output_tokens_per_s'))} out tok/s, "
            f"TTFT p50 {p50('ttft_ms', 1)} ms, TPOT p50 {p50('tpot_ms', 2)} ms, ITL p50 {p50('itl_ms', 2)} ms"
            + ("" if who != "engine" else f", decode step p50 {p50('decode_step_ms', 2)} ms"))


def jitter_chunk_line(result: dict) -> str:
    """One finished chunk size in a line, printed while the sweep goes on."""
    cut = "" if result["insertion_window_complete"] else " (window cut short)"
    return (f"chunk {result['chunk_size']}: insertion ITL ms p50/p95/max {_pct(result['insertion_window_itl_ms'])}"
            f"{cut} (baseline {_pct(result['baseline_itl_ms'])}), long TTFT inserted "
            f"{format_mean_std(result['long_ttft_inserted_ms'])} ms, alone {format_mean_std(result['long_ttft_alone_ms'])} ms")
