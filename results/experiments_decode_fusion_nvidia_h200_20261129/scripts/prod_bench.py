"""The four one-token W4 products of a Qwen2.5-3B layer, dispatched kernel, back to back in a graph (us per call)."""
import json, os
import torch
import kernels.quant_matmul as q
from core.bench import gemv_bench as gb
dev = torch.device("cuda", 0)
recs = {}
for k, n in [(2048, 2560), (2048, 2048), (2048, 22016), (11008, 2048)]:
    wbytes = n * k // 2 + 2 * n * (k // 128) * 2
    copies = max(1, min(128, -(-gb.ROTATE_BYTES // wbytes)))
    weights = [gb._random_weight(k, n, 4, 128, dev) for _ in range(copies)]
    for m in [int(v) for v in os.environ.get("TOKENS", "1").split(",")]:
        x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
        outs = [torch.empty(m, n, dtype=torch.bfloat16, device=dev) for _ in range(copies)]
        name = q.pick_kernel(m, k, n)
        us = gb.time_graph(gb._quant_launches(q.quant_matmul, weights, x, outs, 4, 128, name, None), copies, 3, dev)[0]
        recs[f"{k}x{n} m={m} {name}"] = round(us, 2)
        print(f"{k}x{n} m={m} {name}: {us:.2f} us", flush=True)
json.dump(recs, open(os.environ.get("OUT_JSON", "/tmp/prod.json"), "w"), indent=1)
