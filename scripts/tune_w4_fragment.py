"""Sweep the fragment kernels' launch shapes on Qwen2.5-3B's and 7B's products (W4, group 128, bf16).

For each (shape, token count): every FragmentConfig that holds the tokens in one CTA row (kernels/w4_fragment_gemm.py
CONFIGS) at K splits 1, 2, 4, 8, 16 (at most half the stages) and at the plan's split, each a CUDA graph of launches
over enough weight copies to leave the L2 (core/bench/gemv_bench.time_graph); the floor is the packed bytes over the
copy bandwidth measured in the same run. `plan`'s choices come from this sweep.

With --batch, the 33-128-token kernel instead (kernels/w4_fragment_batch.py): each wide wgmma launch shape (SM90) at
the CTA count its plan gives.

    python3 scripts/tune_w4_fragment.py --tokens 1,8,16,32 --output results/w4_fragment_sweep_nvidia_h200.json
    python3 scripts/tune_w4_fragment.py --batch --tokens 48,64,96,128 --output batch_sweep.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from deepinfer.core.bench.env_info import env_info
from deepinfer.core.bench.gemv_bench import copy_bandwidth, time_graph
from deepinfer.kernels import w4_fragment_batch as batch
from deepinfer.kernels import w4_fragment_gemm as fragment

SHAPES = {"qwen2.5-3b": [(2048, 2560), (2048, 2048), (2048, 22016), (11008, 2048)],  # (K, N): qkv, o, gate_up, down
          "qwen2.5-7b": [(3584, 4608), (3584, 3584), (3584, 37888), (18944, 3584)]}
ROTATE_BYTES = 256 * 2**20


def random_fragments(out_features: int, in_features: int, group_size: int, device) -> fragment.FragmentWeight:
    groups = in_features // group_size
    qweight = torch.randint(-2**31, 2**31 - 1, (out_features, in_features // 8), dtype=torch.int32, device=device)
    scales = (torch.rand(out_features, groups, device=device) * 0.02 + 0.005).half()
    zeros = torch.randint(0, 16, (out_features, groups), device=device).half()
    return fragment.fragment_layout(qweight, scales, zeros, group_size, out_features, in_features, torch.bfloat16)


def sweep_point(weights, x, outs, device_index) -> dict:
    num_tokens, in_features = x.shape
    times = {}
    planned, planned_splits = fragment.plan(num_tokens, weights[0].out_features, in_features, device_index)
    for config in fragment.CONFIGS:
        if config.tokens < min(num_tokens, 32) or config.tokens >= 2 * max(num_tokens, 8):
            continue
        num_kb = -(-in_features // config.bk)
        for splits in sorted({1, 2, 4, 8, 16, planned_splits}):
            if splits > max(1, num_kb // 2):
                continue

            def launch_all(config=config, splits=splits):
                for i, w in enumerate(weights):
                    fragment.w4_fragment_gemm(x, w, config=config, splits=splits, out=outs[i % 2])

            times[f"{config.label}/splits={splits}"] = time_graph(launch_all, len(weights), 3, x.device)[0]
    best = min(times, key=times.get)
    return {"us": times, "best": best, "best_us": times[best], "plan": f"{planned.label}/splits={planned_splits}",
            "plan_us": times.get(f"{planned.label}/splits={planned_splits}")}


# The batch kernel's wide SM90 shapes, 64- and 48-token blocks: the ones its plan chooses between.
BATCH_CONFIGS = (batch.WIDE_WGMMA_CONFIG, batch.WIDE_48_WGMMA_CONFIG)


def batch_sweep_point(weights, x, outs, device_index) -> dict:
    num_tokens, in_features = x.shape
    out_features = weights[0].out_features
    times = {}
    planned = batch.plan(num_tokens, out_features, in_features, device_index)[0]
    for config in BATCH_CONFIGS:
        ctas = batch.plan(num_tokens, out_features, in_features, device_index, config)[1]

        def launch_all(config=config, ctas=ctas):
            for i, w in enumerate(weights):
                batch.w4_fragment_batch(x, w, config=config, ctas=ctas, out=outs[i % 2])

        times[config.label] = time_graph(launch_all, len(weights), 3, x.device)[0]
    best = min(times, key=times.get)
    return {"us": times, "best": best, "best_us": times[best], "plan": planned.label,
            "plan_us": times[planned.label]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,8,16,32")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--output", default="results/w4_fragment_sweep.json")
    parser.add_argument("--batch", action="store_true", help="the 33-128-token kernel's shapes (SM90)")
    parser.add_argument("--shapes", help="KxN,... (default: the Qwen2.5-3B and 7B products)")
    args = parser.parse_args()
    device = torch.device("cuda")
    index = torch.cuda.current_device()
    bandwidth = copy_bandwidth(device)["gbps_mean"]
    rows = []
    models = SHAPES
    if args.shapes:
        models = {"shapes": [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]}
    for model, shapes in models.items():
        for in_features, out_features in shapes:
            packed_bytes = out_features * in_features // 2 + out_features * (in_features // args.group_size) * 4
            copies = max(2, min(32, ROTATE_BYTES // packed_bytes))
            weights = [random_fragments(out_features, in_features, args.group_size, device) for _ in range(copies)]
            for num_tokens in (int(t) for t in args.tokens.split(",")):
                x = torch.randn(num_tokens, in_features, device=device, dtype=torch.bfloat16)
                outs = [torch.empty(num_tokens, out_features, device=device, dtype=torch.bfloat16) for _ in range(2)]
                floor_us = (packed_bytes + x.nbytes + outs[0].nbytes) / (bandwidth * 1e3)
                point = (batch_sweep_point if args.batch else sweep_point)(weights, x, outs, index)
                rows.append({"model": model, "in_features": in_features, "out_features": out_features,
                             "tokens": num_tokens, "floor_us": floor_us,
                             "best_fraction_of_floor": floor_us / point["best_us"], **point})
                if args.batch:
                    times = " ".join(f"{label.removeprefix('batch<2,')[:-1]} {us:.1f} ({100 * floor_us / us:.0f}%)"
                                     for label, us in point["us"].items())
                    print(f"{in_features}x{out_features} M={num_tokens} floor {floor_us:.1f}: {times}", flush=True)
                else:
                    print(f"{model} {in_features}x{out_features} M={num_tokens}: floor {floor_us:.1f} us, plan "
                          f"{point['plan']} {point['plan_us'] or float('nan'):.1f}, best {point['best']} "
                          f"{point['best_us']:.1f}", flush=True)
            del weights
            torch.cuda.empty_cache()
    payload = {"env": env_info(sys.argv), "copy_gbps": bandwidth, "rows": rows}
    with open(args.output, "w") as handle:
        json.dump(payload, handle, indent=1)


if __name__ == "__main__":
    main()
