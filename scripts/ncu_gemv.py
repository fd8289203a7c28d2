"""Launch each one-token W4A16 kernel once per (dtype, kernel, shape), for Nsight Compute to profile:

    ncu --clock-control none --section WarpStateStats ... -k regex:quant_ python3 scripts/ncu_gemv.py

Shapes are Qwen2.5-3B's merged decode products (in x out): qkv, o, gate_up, down. Weights are random
codes (zero mode, group 128); every launch reads a fresh copy, so nothing is served from L2.
"""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="2048x2560,2048x2048,2048x22016,11008x2048")
    parser.add_argument("--kernels", default="tc,gemv,stream,ksplit")
    parser.add_argument("--dtypes", default="bfloat16,float16")
    args = parser.parse_args()

    import torch

    from deepinfer.kernels.quant_matmul import quant_matmul

    device = torch.device("cuda")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for shape in args.shapes.split(","):
            in_features, out_features = (int(v) for v in shape.split("x"))
            groups = in_features // 128
            x = torch.randn(1, in_features, dtype=dtype, device=device)
            for kernel in args.kernels.split(","):
                qweight = torch.randint(-2**31, 2**31 - 1, (out_features, in_features // 8), dtype=torch.int32,
                                        device=device)
                scales = (torch.rand(out_features, groups, device=device) * 0.02).half()
                zeros = torch.full((out_features, groups), 8.0, device=device).half()
                quant_matmul(x, qweight, scales, zeros, 4, 128, "zero", kernel=kernel, integer_zeros=True)
                torch.cuda.synchronize()
                print(f"{dtype_name} {shape} {kernel}", flush=True)


if __name__ == "__main__":
    main()
