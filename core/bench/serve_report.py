"""`bench serve`'s Rich tables: throughput and errors, latency percentiles, and the servers' ratios.

Latencies are milliseconds; percentile cells read `p50 / p95 / p99`. With several servers every
row names its server, and a last table divides each server's figures by the first one's.
"""

from __future__ import annotations

from rich.table import Table

from deepinfer.core.bench.serve_bench import level_label


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _triplet(stats: dict, digits: int = 1) -> str:
    return " / ".join(_num(stats.get(k), digits) for k in ("p50", "p95", "p99"))


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _server(target: dict) -> str:
    return f"{target['base_url']} ({target.get('model')})"


def _share(value: float | None) -> str:
    """The benchmark process's CPU seconds per second of the level (near 100%: the client is the bottleneck)."""
    return "-" if value is None else f"{value:.0%}"


def serve_tables(payload: dict, workload_text: str) -> list[Table]:
    targets = payload["targets"]
    several = len(targets) > 1
    has_goodput = bool(payload["sweep"]["goodput_slo_ms"])
    title = f"deepinfer bench serve: {payload['endpoint']}, {workload_text}"
    if not several and targets:
        title += f"  {_server(targets[0])}"
    throughput = Table(title=title, title_justify="left")
    latency = Table(title="latency, ms (p50 / p95 / p99)", title_justify="left")
    lead = (["server"] if several else []) + ["level"]
    columns = lead + ["ok / sent", "errors", "out tok/s", "total tok/s", "req/s", "client CPU"]
    if has_goodput:
        slo = ", ".join(f"{k} <= {v:g}" for k, v in payload["sweep"]["goodput_slo_ms"].items())
        columns += [f"goodput req/s ({slo} ms)", "good"]
    for name in columns:
        throughput.add_column(name, justify="right", no_wrap=True)
    for name in lead + ["TTFT", "TPOT", "ITL", "E2E"]:
        latency.add_column(name, justify="right", no_wrap=True)
    for target in targets:
        for level in target["levels"]:
            head = ([target["base_url"]] if several else []) + [
                level_label(level) + (" (partial)" if level["partial"] else "")]
            errors = ", ".join(f"{kind} {count}" for kind, count in sorted(level["errors"].items())) or "-"
            row = head + [f"{level['num_completed']} / {level['num_sent']}", errors,
                          _num(level["output_tokens_per_s"]), _num(level["total_tokens_per_s"]),
                          _num(level["requests_per_s"], 2), _share(level.get("client_cpu_per_wall"))]
            if has_goodput:
                goodput = level["goodput"]
                fraction = goodput["fraction"]
                row += [_num(goodput["requests_per_s"], 2), "-" if fraction is None else f"{fraction:.0%}"]
            throughput.add_row(*row)
            latency.add_row(*head, _triplet(level["ttft_ms"]), _triplet(level["tpot_ms"], 2),
                            _triplet(level["itl_ms"], 2), _triplet(level["e2e_ms"]))
    tables = [throughput, latency]
    if payload["comparison"]:
        first = targets[0]
        ratios = Table(title=f"each server over {_server(first)} (same prompts and schedule)", title_justify="left")
        for name in ["server", "level", "out tok/s", "req/s", "TTFT p50", "TPOT p50", "E2E p50"] + (
                ["goodput"] if has_goodput else []):
            ratios.add_column(name, justify="right", no_wrap=True)
        for row in payload["comparison"]:
            cells = [f"{row['base_url']} ({row['model']})", row["level"], _ratio(row["output_tokens_per_s_ratio"]),
                     _ratio(row["requests_per_s_ratio"]), _ratio(row["ttft_p50_ratio"]),
                     _ratio(row["tpot_p50_ratio"]), _ratio(row["e2e_p50_ratio"])]
            if has_goodput:
                cells.append(_ratio(row["goodput_ratio"]))
            ratios.add_row(*cells)
        tables.append(ratios)
    return tables
