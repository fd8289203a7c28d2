"""Sweep the W8A16 kernel's launches (kernels/w8_gemm.py) on the product shapes of Qwen2.5-3B and 7B (8-bit, G = 32 as
GGUF Q8_0, zero point 128, bf16 activations).

For each token count and shape, every candidate (row_warps, row_tiles, depth) of that count's token tiles, each at one
split or, where one split leaves fewer CTAs than the GPU has multiprocessors, at the fewest power-of-two splits that
fill it and at twice that; and the planned launch. Each point is a CUDA graph of launches over enough weight copies to leave the L2
(core/bench/gemv_bench.time_graph). Prints, per token count, the launch with the least summed time over the shapes
(the LAUNCHES entry it proposes, its splits the best on the shapes that split) and each shape's best against the
planned launch; writes every point as JSON.

    python3 scripts/tune_w8_gemm.py --tokens 16,32,48,64 --output w8_gemm_sweep.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from deepinfer.core.bench.env_info import env_info
from deepinfer.core.bench.gemv_bench import time_graph
from deepinfer.kernels import w8_gemm as w8
from deepinfer.kernels.compiler import precompile

SHAPES = ((2048, 2560), (2048, 2048), (2048, 22016), (11008, 2048),  # (K, N): 3B q/k/v, o, gate/up, down
          (3584, 4608), (3584, 3584), (3584, 37888), (18944, 3584))  # 7B
GROUP_SIZE = 32
ROTATE_BYTES = 256 * 2**20
# (row_warps, row_tiles, depth) by 8-token tiles: rows a CTA from 64 to 256, warps along K from 1 to 4
CANDIDATES = {2: ((4, 1, 2), (4, 2, 3), (8, 1, 3), (2, 4, 3)),
              4: ((4, 2, 3), (8, 1, 3), (8, 2, 3), (4, 1, 4)),
              8: ((8, 1, 3), (4, 1, 3), (8, 1, 4), (2, 1, 3))}


def weights(in_features: int, out_features: int, device) -> list[dict]:
    """Random 8-bit codes, fp16 scales, Q8_0's zero point, enough copies to leave the L2."""
    size = in_features * out_features
    copies = max(2, -(-ROTATE_BYTES // size))
    groups = in_features // GROUP_SIZE
    return [{"qweight": torch.randint(-2**31, 2**31 - 1, (out_features, in_features // 4), dtype=torch.int32,
                                      device=device),
             "scales": (torch.rand(out_features, groups, device=device) * 0.02 + 0.005).half(),
             "zeros": torch.full((out_features, groups), 128.0, device=device).half()} for _ in range(copies)]


def split_choices(num_tokens: int, in_features: int, out_features: int, launch: tuple[int, int, int], sms: int):
    row_warps, row_tiles, _ = launch
    tiles = w8.token_tiles(num_tokens)
    ctas = -(-out_features // (w8.ROWS_PER_TILE * row_warps * row_tiles)) * -(-num_tokens // (8 * tiles))
    if ctas >= sms:
        return (1,)
    fill = min(w8.MAX_SPLITS, 1 << math.ceil(math.log2(sms / ctas)))
    return tuple(sorted({fill, min(w8.MAX_SPLITS, 2 * fill)}))


def sweep_point(num_tokens: int, in_features: int, out_features: int, device, sms: int, repeats: int) -> list[dict]:
    """Every candidate launch of one token count and shape, and the planned one."""
    index = device.index
    copies = weights(in_features, out_features, device)
    x = torch.randn(num_tokens, in_features, device=device, dtype=torch.bfloat16)
    outs = [torch.empty(num_tokens, out_features, device=device, dtype=torch.bfloat16) for _ in copies]
    planned = w8.plan(num_tokens, in_features, out_features, index)
    launches = [(c, s) for c in CANDIDATES[w8.token_tiles(num_tokens)]
                for s in split_choices(num_tokens, in_features, out_features, c, sms)]
    planned_launch = ((planned.row_warps, planned.row_tiles, planned.depth), planned.splits)
    if planned_launch not in launches:
        launches.append(planned_launch)
    points = []
    for (row_warps, row_tiles, depth), splits in launches:
        def launch_all(row_warps=row_warps, row_tiles=row_tiles, depth=depth, splits=splits) -> None:
            for weight, out in zip(copies, outs):
                w8.w8_gemm(x, weight["qweight"], weight["scales"], weight["zeros"], GROUP_SIZE, "zero", True,
                           row_warps=row_warps, row_tiles=row_tiles, depth=depth, splits=splits, out=out)

        mean_us, std_us = time_graph(launch_all, len(copies), repeats, device)
        used = w8.plan(num_tokens, in_features, out_features, index, None, row_warps, splits, row_tiles, depth)
        points.append({"in_features": in_features, "out_features": out_features, "tokens": num_tokens,
                       "row_warps": row_warps, "row_tiles": row_tiles, "depth": used.depth, "splits": used.splits,
                       "planned": used == planned, "us_mean": round(mean_us, 3), "us_std": round(std_us, 3)})
    return points


def summarize(num_tokens: int, at: list[dict]) -> dict:
    """The (row_warps, row_tiles, depth) of the least summed time over the shapes (each at its best splits), the
    splits most often best among the shapes that split, and each shape's best against the planned launch."""
    by_launch: dict[tuple, dict] = {}
    for p in at:
        key = (p["row_warps"], p["row_tiles"], p["depth"])
        shape = (p["in_features"], p["out_features"])
        if shape not in by_launch.setdefault(key, {}) or p["us_mean"] < by_launch[key][shape]["us_mean"]:
            by_launch[key][shape] = p
    complete = [key for key in by_launch if len(by_launch[key]) == len(SHAPES)]
    best_key = min(complete, key=lambda k: sum(p["us_mean"] for p in by_launch[k].values()))
    split_votes: dict[int, int] = {}
    for p in by_launch[best_key].values():
        if p["splits"] > 1:
            split_votes[p["splits"]] = split_votes.get(p["splits"], 0) + 1
    splits = max(split_votes, key=split_votes.get) if split_votes else 1
    shapes = {}
    for in_features, out_features in SHAPES:
        mine = [p for p in at if (p["in_features"], p["out_features"]) == (in_features, out_features)]
        planned = next((p for p in mine if p["planned"]), None)
        shapes[f"{in_features}x{out_features}"] = {"best": min(mine, key=lambda p: p["us_mean"]),
                                                   "planned_us": planned and planned["us_mean"]}
    print(f"T={num_tokens} proposed Launch{(best_key[0], best_key[1], splits, best_key[2])} "
          f"sum {sum(p['us_mean'] for p in by_launch[best_key].values()):.1f}us | best/planned: "
          + " ".join(f"{v['best']['us_mean']:.1f}/{v['planned_us'] or float('nan'):.1f}" for v in shapes.values()),
          flush=True)
    return {"proposed": {"row_warps": best_key[0], "row_tiles": best_key[1], "splits": splits, "depth": best_key[2]},
            "shapes": shapes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="16,32,48,64")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    device = torch.device("cuda", 0)
    index = device.index
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    token_counts = [int(t) for t in args.tokens.split(",")]
    tiles = {w8.token_tiles(m) for m in token_counts}
    launches = {(tt, *c) for tt in tiles for c in CANDIDATES[tt]}
    launches |= {(tt, w8.LAUNCHES[tt].row_warps, w8.LAUNCHES[tt].row_tiles, w8.LAUNCHES[tt].depth) for tt in tiles}
    names = {f"w8_gemm_kernel<1,{tt},{rw},{rt},{depth},0,0>" for tt, rw, rt, depth in launches}
    failed = [rec for rec in precompile([(w8.SOURCE, name) for name in sorted(names)], index, 14) if rec["error"]]
    if failed:
        print(f"{len(failed)} candidates failed to compile: {failed[0]['kernel']}: {failed[0]['error'][:300]}")
        return 1

    points, summary = [], {}
    for num_tokens in token_counts:  # token counts outermost: each count's summary prints as soon as it is timed
        for in_features, out_features in SHAPES:
            points += sweep_point(num_tokens, in_features, out_features, device, sms, args.repeats)
            torch.cuda.empty_cache()
        summary[num_tokens] = summarize(num_tokens, [p for p in points if p["tokens"] == num_tokens])
        with open(args.output, "w") as fh:
            json.dump({"env": env_info(sys.argv), "group_size": GROUP_SIZE, "points": points, "summary": summary}, fh,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
