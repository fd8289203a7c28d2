"""EXPERIMENT: tc / tcs with every weight segment of a warp loaded before the PDL wait (quant_tc_all_kernel,
quant_tcs_all_kernel): products alone (bits against the dispatched kernel, us per call) and the steady decode step.
   PYTHONPATH=. python3 _run/allx.py   (env STREAMS/SEQS/OUT_JSON/PARTS)"""
import json, os, time
import torch
import kernels.quant_matmul as Q
from core.bench import gemv_bench as gb
from kernels.compiler import get_kernel

dev = torch.device("cuda", 0)
res = {}
orig_plan = Q._plan
MODE = {"v": ()}

def nseg_for(n):
    return next(s for s in (1, 2, 3, 4, 6, 8) if s >= n)

def plan(index, dt, bits, scale_f32, num_tokens, out_features, in_features, name, tile, splits, mode=0):
    p = orig_plan(index, dt, bits, scale_f32, num_tokens, out_features, in_features, name, tile, splits, mode)
    fn, grid, block, split_count, per_split = p
    if name == "tc" and tile == 1 and "tc" in MODE["v"]:
        per_warp = -(-(in_features // 128) // (block[0] // 32))
        if per_warp <= 8:
            fn = get_kernel(Q.SOURCE, f"quant_tc_all_kernel<{dt},{tile},{mode},{scale_f32},{nseg_for(per_warp)}>", index)
    if name == "tcs" and tile == 1 and "tcs" in MODE["v"] and per_split <= 8:
        fn = get_kernel(Q.SOURCE, f"quant_tcs_all_kernel<{dt},{tile},{mode},{scale_f32},{nseg_for(per_split)}>", index)
    return (fn, grid, block, split_count, per_split)

def use(*v):
    MODE["v"] = v; Q._plans.clear()
Q._plan = plan
parts = os.environ.get("PARTS", "A,B")
if "A" in parts:
    for k, n in [(2048, 2560), (2048, 2048), (2048, 22016), (11008, 2048)]:
        wbytes = n * k // 2 + 2 * n * (k // 128) * 2
        copies = max(1, min(128, -(-gb.ROTATE_BYTES // wbytes)))
        weights = [gb._random_weight(k, n, 4, 128, dev) for _ in range(copies)]
        for m in [1, 4, 8]:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            outs = [torch.empty(m, n, dtype=torch.bfloat16, device=dev) for _ in range(copies)]
            name = Q.pick_kernel(m, k, n)
            row = {}
            for label, v in (("base", ()), ("all", ("tc", "tcs")), ("base2", ())):
                use(*v)
                w = weights[0]
                ref = Q.quant_matmul(x, w["qweight"], w["scales"], w["zeros"], 4, 128, "zero", integer_zeros=True)
                row[label] = round(gb.time_graph(gb._quant_launches(Q.quant_matmul, weights, x, outs, 4, 128, name, None),
                                                 copies, 3, dev)[0], 2)
                row[label + "_equal"] = bool(torch.equal(ref, base_ref)) if label != "base" else True
                if label == "base":
                    base_ref = ref
            res[f"{k}x{n} m={m} {name}"] = row
            print(f"{k}x{n} m={m} {name}: {row}", flush=True)
        del weights

if "B" in parts:
    from core.config import EngineConfig
    from core.engine.llm_engine import LLMEngine
    from core.engine.sampling_params import SamplingParams
    streams = int(os.environ.get("STREAMS", "1"))
    engine = LLMEngine(EngineConfig(dummy_weights=True, shape="qwen2.5-3b", quantization="w4a16",
                                    max_model_len=1024, kv_cache_memory="4GiB", max_num_seqs=int(os.environ.get("SEQS", "1"))))
    runner = engine.step_runner

    def steady(steps=150):
        ids = [engine.add_request(list(range(1 + i, 257 + i)), SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
               for i in range(streams)]
        toks = []
        for _ in range(12):
            engine.step()
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize(); us = (time.perf_counter() - t) / steps * 1e6
        for r in ids:
            engine.abort(r)
        while engine.has_unfinished_requests():
            engine.step()
        return us

    for name, v in (("base", ()), ("tc_all", ("tc",)), ("tcs_all", ("tcs",)), ("both", ("tc", "tcs")), ("base_end", ())):
        use(*v)
        runner._graphs.clear(); torch.cuda.synchronize(); runner.capture()
        res[f"step {streams}x {name}"] = [round(steady(), 1), round(steady(), 1)]
        print(f"step {streams} streams {name}: {res[f'step {streams}x {name}']} us", flush=True)
json.dump(res, open(os.environ.get("OUT_JSON", "/tmp/allx.json"), "w"), indent=1)
