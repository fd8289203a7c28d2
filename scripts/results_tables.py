"""Print docs/RESULTS.md's tables, in Markdown, from the JSON files under results/.

After a new benchmark run (scripts/gpu_final.sh, scripts/gpu_bench.sh) overwrites the files, this
prints every section's table and its environment line; paste them over the old ones and reread the
findings. Values over repeats print as their mean. A missing file skips its section.

    python3 scripts/results_tables.py [--results results] [--gpu nvidia_h200] [--subject qwen2.5-3b-w4a16]
        [--gemv FILE] [--attention FILE]

Needs only the standard library.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GIB = 1024**3


def mean(stats: dict, key: str) -> float | None:
    """A level's `mean_std` entry ('ttft_ms.p50', 'output_tokens_per_s', ...) as its mean."""
    entry = stats.get(key)
    return None if entry is None else entry.get("mean")


def cell(value: float | None, digits: int = 1, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---:" for _ in header) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def env_line(document: dict) -> str:
    env = document.get("env", {})
    settings = " ".join(f"{name}={value}" for name, value in env.get("settings", {}).items())
    return (f"{env.get('gpu')}, driver {env.get('driver')}, torch {env.get('torch')}, CuPy {env.get('cupy')}, "
            f"NVRTC {env.get('nvrtc')}, commit {env.get('git_commit')}, {env.get('timestamp', 'time not recorded')}\n"
            f"`{(settings + ' ') if settings else ''}{env.get('command')}`")


def concurrency(document: dict) -> str:
    has_peer = document.get("peer") is not None
    header = ["concurrency", "output tok/s", "TPOT p50 ms", "decode tok/s per stream", "TTFT p50 ms", "ITL p99 ms"]
    if has_peer:
        header += ["HF tok/s", "vs HF"]
    rows = []
    for level in document["levels"]:
        stats = level["mean_std"]
        tpot = mean(stats, "tpot_ms.p50")
        row = [str(level["concurrency"]), cell(mean(stats, "output_tokens_per_s")), cell(tpot, 2),
               cell(None if not tpot else 1000 / tpot, 0), cell(mean(stats, "ttft_ms.p50")),
               cell(mean(stats, "itl_ms.p99"), 2)]
        if has_peer:
            peer = level.get("peer", {}).get("mean_std", {})
            ratio = level.get("vs_peer", {}).get("output_tokens_per_s_ratio")
            row += [cell(mean(peer, "output_tokens_per_s")), cell(ratio, 1, "x")]
        rows.append(row)
    return table(header, rows)


def side_by_side(first: dict, second: dict, labels: tuple[str, str]) -> str:
    """Output tok/s and TPOT p50 per concurrency level of two runs of the same sweep, and their ratio (with a
    warning line where the two files come from different commits, so the ratio is not one run's)."""
    commits = (first.get("env", {}).get("git_commit"), second.get("env", {}).get("git_commit"))
    warning = "" if commits[0] == commits[1] else f"<!-- different commits: {commits[0]} and {commits[1]} -->\n"
    other = {level["concurrency"]: level["mean_std"] for level in second["levels"]}
    rows = []
    for level in first["levels"]:
        a, b = level["mean_std"], other.get(level["concurrency"])
        if b is None:
            continue
        a_tps, b_tps = mean(a, "output_tokens_per_s"), mean(b, "output_tokens_per_s")
        rows.append([str(level["concurrency"]), cell(a_tps), cell(b_tps),
                     cell(a_tps / b_tps if a_tps and b_tps else None, 2, "x"),
                     cell(mean(a, "tpot_ms.p50"), 2), cell(mean(b, "tpot_ms.p50"), 2)])
    one, two = labels
    return warning + table(["concurrency", f"output tok/s, {one}", f"output tok/s, {two}", "gain",
                            f"TPOT p50 ms, {one}", f"TPOT p50 ms, {two}"], rows)


def budget(document: dict) -> str:
    rows = []
    for level in document["levels"]:
        stats = level["mean_std"]
        rows.append([str(level["concurrency"]), cell(mean(stats, "output_tokens_per_s")),
                     cell(mean(stats, "tpot_ms.p50"), 2), cell(mean(stats, "ttft_ms.p50")),
                     cell((mean(stats, "peak_allocated_bytes") or 0) / GIB, 2),
                     cell((mean(stats, "peak_reserved_bytes") or 0) / GIB, 2),
                     cell(mean(stats, "num_preemptions"), 0)])
    text = table(["concurrency", "output tok/s", "TPOT p50 ms", "TTFT p50 ms", "peak allocated GiB",
                  "peak reserved GiB", "preemptions"], rows)
    health = document.get("health", {})
    kv, graphs = health.get("kv_budget"), health.get("cuda_graphs", {})
    if kv:
        tokens = kv["num_blocks"] * health["blocks"]["block_size"]
        text += ("\n\n" + table(
            ["budget GiB", "weights GiB", "warm-up activations GiB", "CUDA graphs set aside GiB",
             "CUDA graphs hold GiB", "KV pool GiB", "KV blocks", "KV tokens"],
            [[cell(document["engine_config"]["max_vram"] / GIB, 2), cell(kv["weights_bytes"] / GIB, 2),
              cell(kv["activation_peak_bytes"] / GIB, 2), cell(kv["cuda_graph_bytes"] / GIB, 2),
              cell(graphs.get("memory_bytes", 0) / GIB, 2), cell(kv["pool_bytes"] / GIB, 2),
              str(kv["num_blocks"]), f"{tokens:,}"]]))
    return text


def jitter(document: dict) -> str:
    rows = []
    # Files written before the sweep's one name for the chunk size say "budgets" and "token_budget".
    for result in document.get("chunk_sizes", document.get("budgets", [])):
        alone, window = result["baseline_itl_ms"], result["insertion_window_itl_ms"]
        ttft_alone = result["long_ttft_alone_ms"]["mean"]
        ttft_inserted = result["long_ttft_inserted_ms"]["mean"]
        rows.append([
            str(result.get("chunk_size", result.get("token_budget"))), cell(alone["p50"], 2),
            f"{cell(window['p50'])} / {cell(window['max'])}" + ("" if result["insertion_window_complete"] else " (cut)"),
            cell(window["max"] / alone["p50"] if window["max"] and alone["p50"] else None, 2, "x"),
            f"{cell(ttft_alone, 0)} / {cell(ttft_inserted, 0)}",
            cell(ttft_inserted / ttft_alone if ttft_alone and ttft_inserted else None, 2, "x")])
    text = table(["chunk size", "stream ITL alone p50 ms", "during insertion p50 / max ms", "max / alone p50",
                  "long TTFT alone / inserted ms", "inserted / alone"], rows)
    slo = document.get("slo")
    if slo:
        chosen = slo.get("chosen_chunk_size", slo.get("chosen_token_budget"))
        text += (f"\n\nITL SLO {slo['itl_slo_ms']:g} ms: chunk size {chosen}, worst ITL "
                 f"{cell(slo.get('insertion_window_itl_max_ms'), 2)} ms, long-prompt TTFT "
                 f"{cell(slo.get('long_ttft_inserted_ms'), 0)} ms")
    return text


def profile(document: dict) -> str:
    rows = []
    for streams in (1, 32, 64):
        step = document.get(f"decode_step_us_{streams}_streams")
        if step is None:
            continue
        rows.append([str(streams), cell(step, 0), cell(document.get(f"decode_gpu_busy_us_per_step_{streams}_streams"), 0),
                     cell(document.get(f"decode_gpu_span_us_per_step_{streams}_streams"), 0),
                     cell(1000 * document.get(f"decode_step_wall_ms_median_{streams}_streams", 0), 0)])
    text = table(["streams", "decode step µs", "GPU busy µs", "GPU span µs", "host wall µs (cProfile)"], rows)
    for bucket, entry in document["buckets"].items():
        kernels = [[str(k["count"]), cell(k["gpu_us"]), f"`{k['name'].split('(')[0].removeprefix('void ')}`"]
                   for k in entry["kernels"] if k["gpu_us"] >= 10]
        text += (f"\n\nReplay of the {bucket}-token graph: {entry['gpu_ms_per_replay']:.3f} ms of GPU time\n\n"
                 + table(["launches", "GPU µs", "kernel"], kernels))
    return text


def stream_floor(document: dict) -> str:
    rows = [[name, cell(document[name]["median_us"], 0), cell(document[name]["tb_per_s"], 2)]
            for name in ("one kernel", "chain, PDL", "chain, PDL, wait first", "chain, no PDL")]
    return (f"{document['bytes'] / 1e9:.3f} GB a step, {document['kernels_in_chain']} kernels in the chain\n\n"
            + table(["variant", "median µs", "TB/s"], rows))


def gemv_one_token(document: dict) -> str:
    """Per shape at one token: every kernel's time, the fastest marked."""
    copy = document["copy_bandwidth"]["gbps_mean"]
    shapes: dict[tuple[int, int], list[dict]] = {}
    for record in document["quant_matmul"]:
        if record["tokens"] == 1 and record["bits"] == 4 and record.get("us_mean") is not None:
            shapes.setdefault((record["in_features"], record["out_features"]), []).append(record)
    rows = []
    for (k, n), records in shapes.items():
        best = min(records, key=lambda r: r["us_mean"])
        rows.append([f"{k}x{n}", f"`{best['kernel']}`", cell(best["us_mean"], 2), cell(best["gbps"] / 1000, 2),
                     cell(100 * best["fraction_of_copy"], 0, "%")])
    return (f"device-to-device copy: {copy / 1000:.2f} TB/s\n\n"
            + table(["in x out", "fastest kernel", "µs", "TB/s", "of copy bandwidth"], rows))


def attention(document: dict) -> str:
    rows = []
    for r in document["paged_attention"]:
        if r.get("default_variant", True) and r.get("us_mean") is not None:
            rows.append([str(r["batch"]), str(r["context"]), f"{r['heads']}/{r['kv_heads']} x {r['head_dim']}",
                         "int8" if r.get("kv") == "int8" else {"float16": "fp16", "bfloat16": "bf16"}.get(r.get("dtype"), "-"), cell(r["us_mean"]),
                         cell(100 * r["fraction_of_copy"], 0, "%"), cell(r.get("speedup_vs_torch"), 1, "x")])
    return table(["batch", "context", "heads/KV heads x dim", "KV", "µs", "of copy bandwidth",
                  "vs torch gather + SDPA"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="results", help="folder of the JSON files")
    parser.add_argument("--gpu", default="nvidia_h200", help="GPU part of the file names")
    parser.add_argument("--subject", default="qwen2.5-3b-w4a16", help="model part of the file names")
    parser.add_argument("--gemv", help="bench gemv JSON for the products (default: gpu_bench.sh's gemv section)")
    parser.add_argument("--attention", help="bench gemv JSON for decode attention (default: the --gemv file)")
    args = parser.parse_args()
    results, subject, gpu = Path(args.results), args.subject, args.gpu
    gemv = args.gemv or str(results / f"bench_gemv_qwen2.5-w4a16-bf16_{gpu}.json")

    def load(name: str) -> dict | None:
        path = Path(name) if "/" in name else results / name
        if not path.exists():
            print(f"<!-- {path}: missing, section skipped -->\n")
            return None
        return json.loads(path.read_text())

    def show(title: str, name: str, render, *extra: str) -> None:
        document = load(name)
        others = [load(e) for e in extra]
        if document is None or any(o is None for o in others):
            return
        print(f"### {title}: `{name}`\n\n{env_line(document)}\n\n{render(document, *others)}\n")

    show("Concurrency", f"bench_concurrency_{subject}_{gpu}.json", concurrency)
    show("Programmatic dependent launch", f"bench_concurrency_{subject}_{gpu}.json",
         lambda on, off: side_by_side(on, off, ("PDL", "`DEEPINFER_PDL=0`")),
         f"bench_concurrency_{subject}-no-pdl_{gpu}.json")
    show("Serving sweep, W4A16 against bf16", f"bench_serving_{subject}_{gpu}.json",
         lambda w4, bf16: side_by_side(w4, bf16, ("W4A16", "bf16")), f"bench_serving_qwen2.5-3b-bf16_{gpu}.json")
    show("INT8 KV cache", f"bench_serving_{subject}-int8-kv_{gpu}.json",
         lambda int8, same: side_by_side(int8, same, ("INT8 KV", "bf16 KV")), f"bench_serving_{subject}_{gpu}.json")
    structured = load(f"bench_structured_{subject}_{gpu}.json")  # a bundle: both runs of one device call
    if structured is not None:
        print(f"### Structured outputs: `bench_structured_{subject}_{gpu}.json`\n\n{env_line(structured['constrained'])}\n\n"
              f"{side_by_side(structured['constrained'], structured['plain'], ('JSON schema', 'unconstrained'))}\n")
    show("Inside a 4 GiB budget", f"bench_concurrency_{subject}-4gib_{gpu}.json", budget)
    show("Long-prompt insertion", f"bench_jitter_{subject}_{gpu}.json", jitter)
    show("Async scheduling", f"bench_concurrency_{subject}-async_{gpu}.json",
         lambda on, off: side_by_side(on, off, ("async", "synchronous")),
         f"bench_concurrency_{subject}-sync_{gpu}.json")
    show("Decode step profile", f"profile_graph_steps_{subject}_{gpu}.json", profile)
    show("Stream floor", f"stream_floor_{subject}_{gpu}.json", stream_floor)
    show("Quantized products at one token", gemv, gemv_one_token)
    show("Decode attention", args.attention or gemv, attention)


if __name__ == "__main__":
    main()
