"""Where a prefill step's time goes: 256-token (c1 TTFT) and 8x256 (2048-token) steps; products alone."""
import json, sys, time, random
import torch
from torch.profiler import ProfilerActivity, profile
from core.config import EngineConfig
from core.engine.llm_engine import LLMEngine
from core.engine.sampling_params import SamplingParams
from core.quant.quant_linear import QuantLinear
from core.ops.quant_matmul import quant_matmul
import torch.nn.functional as F

engine = LLMEngine(EngineConfig(dummy_weights=True, shape="qwen2.5-3b", quantization="w4a16", max_model_len=4096,
                                kv_cache_memory="8GiB", max_num_seqs=64))
rng = random.Random(0)
def prompt(n): return [rng.randrange(1, 150000) for _ in range(n)]
def step_ms():
    torch.cuda.synchronize(); t = time.perf_counter(); engine.step(); torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1000
def drain():
    while engine.has_unfinished_requests(): engine.step()
out = {}
def kernels(prof, n=14):
    return [(e.count, round(e.device_time_total, 1), e.key[:90]) for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:n]]
for label, nreq in (("p256", 1), ("p2048", 8)):
    for _ in range(3):
        for _ in range(nreq): engine.add_request(prompt(256), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        t = step_ms(); drain()
    times = []
    for _ in range(5):
        for _ in range(nreq): engine.add_request(prompt(256), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        times.append(step_ms()); drain()
    for _ in range(nreq): engine.add_request(prompt(256), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step_ms()
    drain()
    out[label] = {"wall_ms": times, "kernels": kernels(prof)}
    print(label, [round(x, 2) for x in times]); [print("   ", k) for k in out[label]["kernels"]]

# products alone: each distinct QuantLinear shape, dequant+cuBLAS (as served) vs dense bf16 F.linear
shapes = {}
for m in engine.model.modules():
    if isinstance(m, QuantLinear):
        p = m.packed; shapes.setdefault((p.in_features, p.out_features), [p, 0]); shapes[(p.in_features, p.out_features)][1] += 1
def bench(fn, n=20):
    fn(); torch.cuda.synchronize(); a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n): fn()
    b.record(); torch.cuda.synchronize(); return a.elapsed_time(b) / n * 1000
from kernels import registry
deq = registry.get("dequantize")
prod = {}
for (k, n), (p, count) in shapes.items():
    for M in (256, 2048):
        x = torch.randn(M, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        served = bench(lambda: quant_matmul(x, p))
        dq = bench(lambda: deq.launch(p.qweight, p.scales, p.zeros, p.bits, p.group_size, p.zero_mode, x.dtype))
        dense = bench(lambda: F.linear(x, w))
        tf = 2 * M * k * n / dense / 1e6
        prod[f"{k}x{n}@{M}"] = dict(count=count, served_us=served, dequant_us=dq, dense_us=dense, dense_tflops=tf)
        print(f"{k}x{n} M={M} x{count}: served {served:.1f} dequant {dq:.1f} dense {dense:.1f} us ({tf:.0f} TFLOPS)")
out["products"] = prod
json.dump(out, open(sys.argv[1], "w"), indent=1)
