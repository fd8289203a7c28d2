"""Sweep the W4A16 GEMM's launch shapes on the product shapes of Qwen2.5-3B and 7B (W4, group 128, bf16).

For each (shape, token count): cuBLAS bf16 on the dense weight, the dense path the engine used before this GEMM
(kernels/dequantize.cu into a bf16 copy, then cuBLAS), and every launch shape of kernels/w4_gemm.py (mma.sync and,
on SM90, wgmma tiles) at 1, ~2 and ~4 CTAs per SM of K splits. Each point is a CUDA graph of launches over enough
weight copies to leave the L2 (core/bench/gemv_bench.time_graph). The floor is max(packed bytes over the measured
copy bandwidth, FLOPs over the measured cuBLAS bf16 rate), both measured in the same run. The choices of
kernels/w4_gemm.py `plan` and of the dispatch table come from this sweep.

    python3 scripts/tune_w4_gemm.py --tokens 16,32,64,128,256 --output results/w4_gemm_sweep_nvidia_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from deepinfer.core.bench.env_info import env_info
from deepinfer.core.bench.gemv_bench import copy_bandwidth, matmul_tflops, product_floor_us, time_graph
from deepinfer.core.quant.packed import PackedWeight
from deepinfer.core.quant.packing import dequantize
from deepinfer.kernels import w4_gemm
from deepinfer.kernels.dequantize import dequantize as dequantize_kernel

SHAPES = {"qwen2.5-3b": [(2048, 2560), (2048, 2048), (2048, 22016), (11008, 2048)],  # (K, N): qkv, o, gate_up, down
          "qwen2.5-7b": [(3584, 4608), (3584, 3584), (3584, 37888), (18944, 3584)]}
ROTATE_BYTES = 256 * 2**20


def random_weight(out_features: int, in_features: int, group_size: int, device) -> PackedWeight:
    groups = in_features // group_size
    return PackedWeight(
        qweight=torch.randint(-2**31, 2**31 - 1, (out_features, in_features // 8), dtype=torch.int32, device=device),
        scales=(torch.rand(out_features, groups, device=device) * 0.02 + 0.005).half(),
        zeros=torch.randint(0, 16, (out_features, groups), device=device).half(),
        bits=4, group_size=group_size, in_features=in_features, out_features=out_features)


def launch_shapes(num_tokens: int, device_index: int) -> list:
    shapes = [w4_gemm.TileConfig(4, 2, tt, 4) for tt in (1, 2, 4, 8)] + [w4_gemm.TileConfig(8, 2, tt, 3) for tt in (2, 4)]
    if w4_gemm.wgmma_available(device_index):
        shapes += [w4_gemm.WgmmaConfig(wg, mt, n, 4) for wg, mt in ((2, 1), (1, 1), (1, 2)) for n in (16, 32, 64)]
        shapes += [w4_gemm.WgmmaConfig(2, 1, 128, 3), w4_gemm.WgmmaConfig(1, 2, 128, 3),
                   w4_gemm.WgmmaConfig(2, 1, 256, 2), w4_gemm.WgmmaConfig(2, 2, 64, 3)]
    return [s for s in shapes if s.tokens <= max(16, num_tokens) * 2 and s.tokens * 4 >= num_tokens]


def sweep_point(weights, dense, x, outs, group_size, device_index) -> dict:
    num_tokens, in_features = x.shape
    out_features = weights[0].out_features
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    scale_pairs = [w4_gemm.gemm_scales(w.scales, w.zeros, "zero", x.dtype) for w in weights]

    def cublas():
        for i, weight in enumerate(dense):
            torch.matmul(x, weight.T, out=outs[i % 2])

    def dense_path():
        for i, w in enumerate(weights):
            copy = dequantize_kernel(w.qweight, w.scales, w.zeros, 4, group_size, "zero", x.dtype)
            torch.matmul(x, copy.T, out=outs[i % 2])

    point = {"cublas_bf16_us": time_graph(cublas, len(dense), 3, x.device)[0],
             "dense_path_us": time_graph(dense_path, len(weights), 3, x.device)[0], "gemm_us": {}}
    num_kb = -(-in_features // w4_gemm.BK)
    for shape in launch_shapes(num_tokens, device_index):
        ctas = -(-out_features // shape.rows) * -(-num_tokens // shape.tokens)
        for per_sm in (0, 2, 4):
            splits = 1 if per_sm == 0 else max(1, min(round(per_sm * sms / ctas), num_kb // 2))
            key = f"{shape.label}/splits={splits}"
            if key in point["gemm_us"]:
                continue

            def gemm(shape=shape, splits=splits):
                for i, w in enumerate(weights):
                    w4_gemm.w4_gemm(x, w.qweight, *scale_pairs[i], group_size, config=shape, splits=splits,
                                    out=outs[i % 2])

            point["gemm_us"][key] = time_graph(gemm, len(weights), 3, x.device)[0]
    best = min(point["gemm_us"], key=point["gemm_us"].get)
    point["best"], point["best_us"] = best, point["gemm_us"][best]
    planned, planned_splits = w4_gemm.plan(num_tokens, out_features, in_features, device_index)
    point["plan"] = f"{planned.label}/splits={planned_splits}"
    return point


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="16,32,64,128,256")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--output", default="results/w4_gemm_sweep.json")
    args = parser.parse_args()
    device = torch.device("cuda")
    index = torch.cuda.current_device()
    bandwidth = copy_bandwidth(device)["gbps_mean"]
    tflops = matmul_tflops(device)
    rows = []
    for model, shapes in SHAPES.items():
        for in_features, out_features in shapes:
            packed_bytes = out_features * in_features // 2 + out_features * (in_features // args.group_size) * 4
            copies = max(2, min(32, ROTATE_BYTES // packed_bytes))
            weights = [random_weight(out_features, in_features, args.group_size, device) for _ in range(copies)]
            dense = [dequantize(weights[i % copies], torch.bfloat16)
                     for i in range(max(2, min(16, ROTATE_BYTES // (out_features * in_features * 2))))]
            for num_tokens in (int(t) for t in args.tokens.split(",")):
                x = torch.randn(num_tokens, in_features, device=device, dtype=torch.bfloat16)
                outs = [torch.empty(num_tokens, out_features, device=device, dtype=torch.bfloat16) for _ in range(2)]
                floor_us = product_floor_us(num_tokens, in_features, out_features, packed_bytes, bandwidth, tflops)
                point = sweep_point(weights, dense, x, outs, args.group_size, index)
                rows.append({"model": model, "in_features": in_features, "out_features": out_features,
                             "tokens": num_tokens, "floor_us": floor_us,
                             "best_fraction_of_floor": floor_us / point["best_us"], **point})
                print(f"{model} {in_features}x{out_features} M={num_tokens}: floor {floor_us:.1f} us, cuBLAS "
                      f"{point['cublas_bf16_us']:.1f}, dense path {point['dense_path_us']:.1f}, best "
                      f"{point['best']} {point['best_us']:.1f}", flush=True)
            del weights, dense
            torch.cuda.empty_cache()
    payload = {"env": env_info(sys.argv), "copy_gbps": bandwidth, "bf16_tflops": tflops, "rows": rows}
    with open(args.output, "w") as handle:
        json.dump(payload, handle, indent=1)


if __name__ == "__main__":
    main()
