"""`deepinfer bench gemv`: achieved bandwidth of the W4A16/W3A16/W8A16 kernels and of paged decode attention.

Both are memory-bound at decode, so each is timed against the bytes it must move, divided by the
device-to-device copy bandwidth measured in the same run (bytes read + written):
- quant matmul: packed weights + scales + zeros + activations in + outputs;
- paged decode attention: the K/V rows (and int8 scales) of every context token + queries + outputs.
From 16 tokens a product also has a floor, max(its packed-weight bytes over the copy bandwidth, its
FLOPs over the cuBLAS rate on an 8192^3 product in the activation dtype, measured in the same run),
and two more points: the W4 GEMM (kernels/w4_gemm.py, its planned launch) and cuBLAS on the dense
weight (what the same model unquantized runs). The W4 kernels over the fragment layout (the layout made once per
weight copy) are timed too, each at its planned launch: the few-token kernel (kernels/w4_fragment_gemm.py) up to 64
tokens ("fragment"), the 33-128-token kernel (kernels/w4_fragment_batch.py) from 16 up to 256 ("fragment_batch").
8-bit weights (`bits` 8) time the W8 kernel (kernels/w8_gemm.py) up to 64 tokens and cuBLAS on the
dense weight at every token count (what 8-bit is held to: at least bf16's speed), the dense path from 16 tokens.
Each point is a CUDA graph of launches over enough distinct weight copies (or block tables) that
the data is several times the L2, replayed many times after warm-up and timed with CUDA events;
`repeats` such timings give mean ± std per call.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable

import torch

from deepinfer.core.bench.paged_kv import random_paged_kv

SHAPES = ((2048, 2048), (2048, 11008), (11008, 2048), (4096, 4096), (4096, 14336), (14336, 4096),
          (8192, 8192))  # (K in, N out)
BATCHES = (1, 2, 4, 8, 16, 32, 64)
ATTENTION_BATCHES = (1, 4, 16, 64)
ATTENTION_CONTEXTS = (512, 2048, 4096, 16384)
ROTATE_BYTES = 512 * 2**20  # data per graph replay, ~8x the H200's 60 MB L2
TARGET_REPEAT_SECONDS = 0.02
# (kernel, most tokens it is timed at): the tc and tcs kernels (W4 weights they take) up to 32, the CUDA-core
# kernels for a few tokens, ksplit up to 32, the staged tensor-core kernel and the few-token fragment kernel up to
# 64, the 33-128-token fragment kernel and the W4 GEMM up to 256, the dense path and cuBLAS on the dense weight always
KERNEL_MAX_TOKENS = (("tc", 32), ("tcs", 32), ("gemv", 4), ("stream", 4), ("ksplit", 32), ("staged", 64),
                     ("fragment", 64), ("fragment_batch", 256), ("w4_gemm", 256), ("w8_gemm", 64), ("dense", 1 << 30),
                     ("cublas", 1 << 30))
W4_ONLY = ("w4_gemm", "fragment", "fragment_batch")
W8_POINTS = ("w8_gemm", "dense", "cublas")  # the kernels timed on 8-bit weights (the others read 4- and 3-bit codes)
# "dense": kernels/dequantize.cu into an [N, K] copy, then cuBLAS (the path of many tokens); "w4_gemm": the
# tensor-core GEMM on the packed weight (4-bit only); "cublas": cuBLAS on a dense weight made once, not a W4 path
MANY_TOKEN_KERNELS = ("fragment_batch", "w4_gemm", "dense", "cublas")
MANY_TOKENS_FROM = 16


def _events_ms(fn: Callable[[], None], count: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(count):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def copy_bandwidth(device, nbytes: int = 2**30, repeats: int = 5) -> dict:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    samples = [2 * nbytes * 10 / (_events_ms(lambda: dst.copy_(src), 10) * 1e-3) / 1e9 for _ in range(repeats)]
    return {"bytes": nbytes, "gbps_mean": statistics.mean(samples), "gbps_std": statistics.stdev(samples)}


def matmul_tflops(device, dtype: torch.dtype = torch.bfloat16, size: int = 8192) -> float:
    """cuBLAS's rate on a size^3 product of random data in `dtype`: the math ceiling of the products' floor."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ a
    return 2 * size**3 / (_events_ms(lambda: a @ a, 10) / 10 * 1e-3) / 1e12


def time_graph(launch_all: Callable[[], None], calls: int, repeats: int, device) -> tuple[float, float]:
    """Capture `launch_all` (which makes `calls` launches) in a CUDA graph; (mean, std) microseconds per call."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        launch_all()
        launch_all()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_all()
    for _ in range(3):
        graph.replay()
    once_ms = _events_ms(graph.replay, 3) / 3
    replays = max(3, min(500, int(TARGET_REPEAT_SECONDS * 1e3 / max(once_ms, 1e-3))))
    samples = [_events_ms(graph.replay, replays) * 1e3 / (replays * calls) for _ in range(repeats)]
    del graph
    return statistics.mean(samples), statistics.stdev(samples)


def _random_weight(in_features: int, out_features: int, bits: int, group_size: int, device) -> dict:
    """Random packed words (every bit pattern is a valid code), fp16 scales, integer zeros."""
    words = in_features * bits // 32
    groups = in_features // group_size
    return {
        "qweight": torch.randint(-2**31, 2**31 - 1, (out_features, words), dtype=torch.int32, device=device),
        "scales": (torch.rand(out_features, groups, device=device) * 0.02 + 0.005).half(),
        "zeros": torch.randint(0, 2**bits, (out_features, groups), device=device).half(),
    }


def quant_points(num_tokens: int, tc_takes: bool = True, bits: int = 4) -> list[str]:
    """The kernels timed at one token count: every kernel of KERNEL_MAX_TOKENS that serves it (tc and tcs where
    `tc_takes`, the W4 GEMM for 4-bit weights, the many-token kernels from MANY_TOKENS_FROM)."""
    if bits == 8:  # cuBLAS on the dense weight at every count: the bf16 speed 8-bit weights are held to
        return [kernel for kernel, most in KERNEL_MAX_TOKENS if kernel in W8_POINTS and num_tokens <= most
                and not (kernel == "dense" and num_tokens < MANY_TOKENS_FROM)]
    return [kernel for kernel, most in KERNEL_MAX_TOKENS
            if num_tokens <= most and not (kernel in MANY_TOKEN_KERNELS and num_tokens < MANY_TOKENS_FROM)
            and not (kernel in ("tc", "tcs") and not tc_takes) and not (kernel in W4_ONLY and bits != 4)
            and kernel != "w8_gemm"]


def product_floor_us(num_tokens: int, in_features: int, out_features: int, weight_bytes: int, copy_gbps: float,
                     tflops: float) -> float:
    """max(packed-weight bytes over the copy bandwidth, the product's FLOPs over the matmul rate), microseconds."""
    return max(weight_bytes / (copy_gbps * 1e9), 2 * num_tokens * in_features * out_features / (tflops * 1e12)) * 1e6


def bench_quant_matmul(device, copy_gbps: float, shapes=SHAPES, batches=BATCHES, bits_list=(4, 3),
                       group_size: int = 128, dtype: torch.dtype = torch.float16, repeats: int = 5,
                       tflops: float | None = None) -> list[dict]:
    """Every kernel that suits each token count (KERNEL_MAX_TOKENS), each point marked `auto` where it is the
    kernel dispatch's table picks (core/ops/quant_matmul_table.py), and from MANY_TOKENS_FROM tokens its share
    of the product's floor (`tflops`: the matmul rate); a point whose launch fails is recorded with its error
    instead of a time."""
    from deepinfer.core.ops.quant_matmul_table import ProductShape, product_row
    from deepinfer.kernels.quant_matmul import tc_reason

    records = []
    for in_features, out_features in shapes:
        for bits in bits_list:
            weight_bytes = out_features * in_features * bits // 8 + 2 * out_features * (in_features // group_size) * 2
            copies = max(1, min(128, -(-ROTATE_BYTES // weight_bytes)))
            weights = [_random_weight(in_features, out_features, bits, group_size, device) for _ in range(copies)]
            operands = _ProductOperands(weights, bits, group_size, dtype)
            for num_tokens in batches:
                x = torch.randn(num_tokens, in_features, dtype=dtype, device=device)
                outs = [torch.empty(num_tokens, out_features, dtype=dtype, device=device) for _ in range(copies)]
                tc_takes = tc_reason(bits, in_features, out_features, group_size) is None
                chosen = product_row(ProductShape(num_tokens, in_features, out_features, bits, group_size)).kernel
                floor_us = None
                if tflops is not None and num_tokens >= MANY_TOKENS_FROM:
                    floor_us = product_floor_us(num_tokens, in_features, out_features, weight_bytes, copy_gbps, tflops)
                for kernel in quant_points(num_tokens, tc_takes, bits):
                    point = {"in_features": in_features, "out_features": out_features, "bits": bits,
                             "tokens": num_tokens, "kernel": kernel, "dtype": str(dtype).removeprefix("torch.")}
                    try:
                        launch_all, launches = operands.launches(kernel, x, outs)
                        mean_us, std_us = time_graph(launch_all, launches, repeats, device)
                    except Exception as err:  # noqa: BLE001 - one broken kernel must not end the sweep
                        records.append(point | {"error": f"{type(err).__name__}: {err}"})
                        torch.cuda.synchronize(device)
                        continue
                    moved = weight_bytes + x.nbytes + outs[0].nbytes
                    records.append(point | {
                        "group_size": group_size, "tile": operands.tile(kernel, num_tokens, in_features, out_features,
                                                                        device.index),
                        "auto": kernel == chosen,
                        "us_mean": mean_us, "us_std": std_us, "bytes": moved, "weight_copies": launches,
                        "gbps": moved / (mean_us * 1e-6) / 1e9,
                        "fraction_of_copy": moved / (mean_us * 1e-6) / 1e9 / copy_gbps,
                        "floor_us": floor_us, "fraction_of_floor": None if floor_us is None else floor_us / mean_us,
                    })
            del weights, operands
            torch.cuda.empty_cache()
    return records


class _ProductOperands:
    """One shape's rotating weight copies and what each kernel needs of them beyond the packed words: the W4
    GEMM's scale pairs, the fragment layouts and cuBLAS's dense weights, each made once, on first use."""

    def __init__(self, weights: list[dict], bits: int, group_size: int, dtype: torch.dtype):
        self.weights, self.bits, self.group_size, self.dtype = weights, bits, group_size, dtype
        self._scale_pairs: list[tuple[torch.Tensor, int]] | None = None
        self._fragments: list | None = None
        self._dense: list[torch.Tensor] | None = None

    def _dequantized(self, weight: dict) -> torch.Tensor:
        from deepinfer.kernels.dequantize import dequantize

        return dequantize(weight["qweight"], weight["scales"], weight["zeros"], self.bits, self.group_size, "zero",
                          self.dtype)  # [N, K]

    def scale_pairs(self) -> list[tuple[torch.Tensor, int]]:
        from deepinfer.kernels import w4_gemm

        if self._scale_pairs is None:
            self._scale_pairs = [w4_gemm.gemm_scales(w["scales"], w["zeros"], "zero", self.dtype) for w in self.weights]
        return self._scale_pairs

    def fragments(self) -> list:
        from deepinfer.kernels import w4_fragment_gemm

        if self._fragments is None:
            self._fragments = []
            for w in self.weights:
                out_features, words = w["qweight"].shape
                self._fragments.append(w4_fragment_gemm.fragment_layout(
                    w["qweight"], w["scales"], w["zeros"], self.group_size, out_features, words * 8, self.dtype))
        return self._fragments

    def dense(self) -> list[torch.Tensor]:
        """Enough dense copies [N, K] to leave the L2 (fewer than the packed copies: each is 4x a W4 weight)."""
        if self._dense is None:
            size = self.weights[0]["qweight"].shape[0] * self.weights[0]["qweight"].shape[1] * 32 // self.bits * 2
            count = max(1, min(len(self.weights), -(-ROTATE_BYTES // size)))
            self._dense = [self._dequantized(w) for w in self.weights[:count]]
        return self._dense

    def tile(self, kernel: str, num_tokens: int, in_features: int, out_features: int, device_index: int) -> str:
        """The launch a point timed: the packed kernels' tile, the GEMM's planned shape and K splits."""
        from deepinfer.kernels import w4_fragment_batch, w4_fragment_gemm, w4_gemm, w8_gemm
        from deepinfer.kernels.quant_matmul import default_tile

        if kernel == "fragment_batch":
            config, ctas = w4_fragment_batch.plan(num_tokens, out_features, in_features, device_index)
            return f"{config.label}/ctas={ctas}"
        if kernel == "fragment":
            config, splits = w4_fragment_gemm.plan(num_tokens, out_features, in_features, device_index)
            return f"{config.label}/splits={splits}"
        if kernel == "w4_gemm":
            config, splits = w4_gemm.plan(num_tokens, out_features, in_features, device_index)
            return f"{config.label}/splits={splits}"
        if kernel == "w8_gemm":
            launch = w8_gemm.plan(num_tokens, in_features, out_features, device_index)
            return f"{launch.tiles}x{launch.row_warps}/splits={launch.splits}"
        return "-" if kernel in ("dense", "cublas") else str(default_tile(kernel, num_tokens))

    def launches(self, kernel: str, x: torch.Tensor, outs: list[torch.Tensor]) -> tuple[Callable[[], None], int]:
        """(a function making one launch per weight copy, how many it makes)."""
        from deepinfer.kernels import w4_fragment_batch, w4_fragment_gemm, w4_gemm, w8_gemm
        from deepinfer.kernels.quant_matmul import quant_matmul

        weights, bits, group_size = self.weights, self.bits, self.group_size
        if kernel == "fragment_batch":
            fragments = self.fragments()

            def launch_all() -> None:
                for fragment, out in zip(fragments, outs):
                    w4_fragment_batch.w4_fragment_batch(x, fragment, out=out)
            return launch_all, len(fragments)
        if kernel == "fragment":
            fragments = self.fragments()

            def launch_all() -> None:
                for fragment, out in zip(fragments, outs):
                    w4_fragment_gemm.w4_fragment_gemm(x, fragment, out=out)
            return launch_all, len(fragments)
        if kernel == "cublas":
            dense = self.dense()

            def launch_all() -> None:
                for weight, out in zip(dense, outs):
                    torch.matmul(x, weight.t(), out=out)
            return launch_all, len(dense)
        if kernel == "dense":
            def launch_all() -> None:
                for weight, out in zip(weights, outs):
                    torch.matmul(x, self._dequantized(weight).t(), out=out)
            return launch_all, len(weights)
        if kernel == "w4_gemm":
            pairs = self.scale_pairs()

            def launch_all() -> None:
                for weight, (sz, zmode), out in zip(weights, pairs, outs):
                    w4_gemm.w4_gemm(x, weight["qweight"], sz, zmode, group_size, out=out)
            return launch_all, len(weights)
        if kernel == "w8_gemm":
            def launch_all() -> None:
                for weight, out in zip(weights, outs):
                    w8_gemm.w8_gemm(x, weight["qweight"], weight["scales"], weight["zeros"], group_size, "zero", True,
                                    out=out)
            return launch_all, len(weights)

        def launch_all() -> None:
            for weight, out in zip(weights, outs):
                quant_matmul(x, weight["qweight"], weight["scales"], weight["zeros"], bits, group_size, "zero",
                             kernel=kernel, out=out, integer_zeros=True)
        return launch_all, len(weights)


def _torch_decode(query, k_cache, v_cache, tables, seq_lens, max_seq_len: int, scale: float) -> torch.Tensor:
    """The torch path the reference backend takes for decodes: gather blocks, then SDPA (GQA) with a mask."""
    num_seqs, _, head_dim = query.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    num_blocks = -(-max_seq_len // block_size)
    blocks = tables[:, :num_blocks].long()
    keys = k_cache[blocks].transpose(1, 2).reshape(num_seqs, num_kv_heads, num_blocks * block_size, head_dim)
    values = v_cache[blocks].transpose(1, 2).reshape(num_seqs, num_kv_heads, num_blocks * block_size, head_dim)
    mask = torch.arange(num_blocks * block_size, device=query.device)[None, :] < seq_lens[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        query.unsqueeze(2), keys, values, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
    return out.squeeze(2)


def bench_paged_attention(device, copy_gbps: float, batches=ATTENTION_BATCHES, contexts=ATTENTION_CONTEXTS,
                          heads: int = 32, kv_heads: int = 8, head_dim: int = 128, block_size: int = 16,
                          dtype: torch.dtype = torch.float16, int8: bool = False, repeats: int = 5,
                          torch_baseline_max_bytes: int = 4 * 2**30, pipelined: bool | None = None,
                          fp8: bool = False) -> list[dict]:
    """Decode attention on the path dispatch picks for each batch and context (core/ops/paged_attention_table.py),
    with the load variant it picks (`decode_pipelined`) or the one `pipelined` names; over an int8 or (`fp8`) e4m3
    cache."""
    from deepinfer.core.ops import paged_attention_table
    from deepinfer.core.ops.paged_attention import decode_path
    from deepinfer.kernels.paged_attention import AttentionOperands, paged_decode_attention, plan_for

    kv_dtype = torch.int8 if int8 else torch.float8_e4m3fn if fp8 else dtype
    operands = AttentionOperands(dtype, heads, kv_heads, head_dim, kv_dtype, block_size)

    records = []
    element = torch.tensor([], dtype=kv_dtype).element_size()
    for num_seqs in batches:
        for context in contexts:
            kv_bytes = 2 * num_seqs * context * kv_heads * (head_dim * element + (2 if int8 else 0))
            copies = max(1, min(256, -(-ROTATE_BYTES // kv_bytes)))
            lengths = [context] * (num_seqs * copies)
            k_cache, v_cache, k_scales, v_scales, tables = random_paged_kv(
                lengths, kv_heads, head_dim, block_size, dtype, int8, device, spare_blocks=0, fp8=fp8)
            seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=device)
            query = torch.randn(num_seqs, heads, head_dim, dtype=dtype, device=device)
            outs = [torch.empty_like(query) for _ in range(copies)]
            table_sets = [tables[i * num_seqs:(i + 1) * num_seqs] for i in range(copies)]
            scale = head_dim**-0.5
            path = decode_path(num_seqs, operands, context, device.index)
            default_variant = paged_attention_table.decode_pipelined(path, kv_dtype != dtype)
            variant = default_variant if pipelined is None else pipelined

            def launch_all(caches=(k_cache, v_cache, k_scales, v_scales), query=query, seq_lens=seq_lens, outs=outs,
                           table_sets=table_sets, context=context, scale=scale, path=path, variant=variant):
                for table, out in zip(table_sets, outs):
                    paged_decode_attention(query, caches[0], caches[1], table, seq_lens, context, scale,
                                           key_scales=caches[2], value_scales=caches[3], out=out, path=path,
                                           pipelined=variant)

            mean_us, std_us = time_graph(launch_all, copies, repeats, device)
            moved = kv_bytes + 2 * query.nbytes
            splits, per_split = plan_for(query, k_cache, context, path, variant)
            record = {
                "batch": num_seqs, "context": context, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
                "block_size": block_size, "dtype": str(dtype).removeprefix("torch."), "kv": "int8" if int8 else "fp8" if fp8 else "same",
                "pipelined": variant, "default_variant": variant == default_variant,
                "path": path,
                "splits": splits, "tokens_per_split": per_split, "us_mean": mean_us, "us_std": std_us,
                "bytes": moved, "gbps": moved / (mean_us * 1e-6) / 1e9,
                "fraction_of_copy": moved / (mean_us * 1e-6) / 1e9 / copy_gbps,
                "torch_us_mean": None, "speedup_vs_torch": None,
            }
            gathered = 2 * num_seqs * context * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
            if kv_dtype == dtype and gathered <= torch_baseline_max_bytes:
                baseline = functools.partial(_torch_decode, query, k_cache, v_cache, table_sets[0], seq_lens,
                                             context, scale)
                for _ in range(2):
                    baseline()
                samples = [_events_ms(baseline, 5) * 1e3 / 5 for _ in range(3)]
                record["torch_us_mean"] = statistics.mean(samples)
                record["speedup_vs_torch"] = record["torch_us_mean"] / mean_us
            records.append(record)
    return records


def bandwidth_checks(quant: list[dict], attention: list[dict]) -> dict:
    """How close the dispatched kernels come to the copy bandwidth, each against a fixed bar: W4 at one token
    >= 70% of copy bandwidth on shapes of at least 4096x4096; 16 tokens at most 1.5x one token's time; decode
    attention >= 60% of copy bandwidth at 16 sequences and contexts of 4k and more."""
    auto = [r for r in quant if r.get("auto") and r["bits"] == 4]
    by_shape = {}
    for r in auto:
        by_shape.setdefault((r["in_features"], r["out_features"]), {})[r["tokens"]] = r
    batch1, ratio16 = [], []
    for (k, n), rows in by_shape.items():
        if 1 in rows and k * n >= 4096 * 4096:
            batch1.append({"shape": f"{k}x{n}", "fraction_of_copy": rows[1]["fraction_of_copy"],
                           "passes": rows[1]["fraction_of_copy"] >= 0.70})
        if 1 in rows and 16 in rows:
            ratio = rows[16]["us_mean"] / rows[1]["us_mean"]
            ratio16.append({"shape": f"{k}x{n}", "batch16_over_batch1": ratio, "passes": ratio <= 1.5})
    attn = [{"batch": r["batch"], "context": r["context"], "kv": r["kv"],
             "heads": f"{r['heads']}/{r['kv_heads']}x{r['head_dim']}", "fraction_of_copy": r["fraction_of_copy"],
             "passes": r["fraction_of_copy"] >= 0.60}
            for r in attention if r["batch"] == 16 and r["context"] >= 4096 and r["default_variant"]]
    return {"w4_batch1_bandwidth": batch1, "w4_batch16_cost": ratio16, "decode_attention_bandwidth": attn}


def run_gemv_benchmark(device, shapes=SHAPES, batches=BATCHES, bits_list=(4, 3), attention: bool = True,
                       repeats: int = 5, dtype: torch.dtype = torch.float16) -> dict:
    """Copy bandwidth, quant-matmul sweep (activations in `dtype`), decode-attention sweep and the bandwidth
    checks, as one JSON payload."""
    from deepinfer.core.ops import paged_attention_table

    copy = copy_bandwidth(device)
    tflops = matmul_tflops(device, dtype) if any(tokens >= MANY_TOKENS_FROM for tokens in batches) else None
    quant = bench_quant_matmul(device, copy["gbps_mean"], shapes, batches, bits_list, dtype=dtype, repeats=repeats,
                               tflops=tflops)
    attention_records = []
    if attention:
        attention_records = bench_paged_attention(device, copy["gbps_mean"], repeats=repeats)
        attention_records += bench_paged_attention(device, copy["gbps_mean"], batches=(16,), contexts=(4096, 16384),
                                                   int8=True, repeats=repeats)
        attention_records += bench_paged_attention(device, copy["gbps_mean"], batches=(16,), contexts=(4096, 16384),
                                                   fp8=True, repeats=repeats)
        attention_records += bench_paged_attention(device, copy["gbps_mean"], batches=(16,), contexts=(4096,),
                                                   heads=9, kv_heads=3, head_dim=64, repeats=repeats)
        attention_records += bench_paged_attention(device, copy["gbps_mean"], batches=(16, 64), contexts=(4096, 16384),
                                                   repeats=repeats, pipelined=not paged_attention_table.PIPELINED,
                                                   torch_baseline_max_bytes=0)
    return {"copy_bandwidth": copy, "matmul_tflops": tflops, "quant_matmul": quant, "paged_attention": attention_records,
            "bandwidth_checks": bandwidth_checks(quant, attention_records)}


def _attention_path_label(record: dict) -> str:
    """'combined' (one CTA of warps a sequence and KV head, no reduce), 'clustered' (a cluster of such CTAs), the
    combined_split path's or the split path's split count (also for records that lack the path)."""
    path = record.get("path")
    if path in ("combined", "clustered"):
        return path
    return f"{'combined_split' if path == 'combined_split' else 'split'} {record['splits']}"


def gemv_tables(payload: dict) -> list:
    """Rich tables of a run_gemv_benchmark payload: quant matmul, decode attention, bandwidth checks."""
    from rich.table import Table

    copy = payload["copy_bandwidth"]
    dtype = next((r["dtype"] for r in payload["quant_matmul"]), "float16")
    rate = payload.get("matmul_tflops")
    quant = Table(title=f"W4A16/W3A16/W8A16 matmul, {dtype} activations, G128 (copy bandwidth "
                        f"{copy['gbps_mean']:.0f} ± {copy['gbps_std']:.0f} GB/s"
                        + (f", cuBLAS {rate:.0f} TFLOP/s" if rate else "") + ")")
    for column in ("in x out", "bits", "tokens", "kernel", "us / call", "GB/s", "% copy BW", "% floor"):
        quant.add_column(column, justify="right")
    for r in payload["quant_matmul"]:
        if "error" in r:
            quant.add_row(f"{r['in_features']}x{r['out_features']}", str(r["bits"]), str(r["tokens"]), r["kernel"],
                          "FAILED", "-", r["error"][:60], "-")
            continue
        kernel = r["kernel"] + ("" if r["tile"] in ("-", 0) else f"/{r['tile']}")
        kernel += "" if r["auto"] else " (peer)" if r["kernel"] == "cublas" else " (alt)"
        floor = r.get("fraction_of_floor")
        quant.add_row(f"{r['in_features']}x{r['out_features']}", str(r["bits"]), str(r["tokens"]), kernel,
                      f"{r['us_mean']:.2f} ± {r['us_std']:.2f}", f"{r['gbps']:.0f}", f"{100 * r['fraction_of_copy']:.1f}",
                      "-" if floor is None else f"{100 * floor:.0f}")
    tables = [quant]
    if payload["paged_attention"]:
        attn = Table(title="Paged decode attention (one query token per sequence)")
        for column in ("batch", "context", "H/KVH x D", "KV", "tile loads", "path / splits", "us / call", "GB/s",
                       "% copy BW", "torch us", "speedup"):
            attn.add_column(column, justify="right")
        for r in payload["paged_attention"]:
            torch_us = "-" if r["torch_us_mean"] is None else f"{r['torch_us_mean']:.1f}"
            speedup = "-" if r["speedup_vs_torch"] is None else f"{r['speedup_vs_torch']:.1f}x"
            attn.add_row(str(r["batch"]), str(r["context"]), f"{r['heads']}/{r['kv_heads']}x{r['head_dim']}",
                         f"{r['dtype']}/{r['kv']}", "ahead" if r["pipelined"] else "in-step",
                         _attention_path_label(r),
                         f"{r['us_mean']:.1f} ± {r['us_std']:.1f}",
                         f"{r['gbps']:.0f}", f"{100 * r['fraction_of_copy']:.1f}", torch_us, speedup)
        tables.append(attn)
    checks = Table(title="Bandwidth checks")
    for column in ("check", "point", "value", "passes"):
        checks.add_column(column)
    for row in payload["bandwidth_checks"]["w4_batch1_bandwidth"]:
        checks.add_row("W4 batch 1 >= 70% copy BW", row["shape"], f"{100 * row['fraction_of_copy']:.1f}%",
                       "yes" if row["passes"] else "NO")
    for row in payload["bandwidth_checks"]["w4_batch16_cost"]:
        checks.add_row("W4 batch 16 <= 1.5x batch 1", row["shape"], f"{row['batch16_over_batch1']:.2f}x",
                       "yes" if row["passes"] else "NO")
    for row in payload["bandwidth_checks"]["decode_attention_bandwidth"]:
        checks.add_row("attention >= 60% copy BW",
                       f"batch {row['batch']} ctx {row['context']} {row.get('heads', '')} {row['kv']} KV",
                       f"{100 * row['fraction_of_copy']:.1f}%", "yes" if row["passes"] else "NO")
    tables.append(checks)
    return tables
