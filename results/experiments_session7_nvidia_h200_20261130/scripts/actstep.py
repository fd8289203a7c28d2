"""Steady decode step with the gate/up activation fused (on) and with the two ops (off), same engine, graphs
recaptured per variant; and the products alone.   PYTHONPATH=. python3 _run/actstep.py  (env STREAMS/SEQS/OUT_JSON/PARTS)"""
import json, os, time
import torch
import core.models.layers as L

res = {}
dev = torch.device("cuda", 0)
parts = os.environ.get("PARTS", "A,B")
if "A" in parts:
    import kernels.quant_matmul as Q
    from kernels.act_and_mul import act_and_mul
    from core.bench import gemv_bench as gb
    k, n = 2048, 22016
    wbytes = n * k // 2 + 2 * n * (k // 128) * 2
    copies = max(1, min(128, -(-gb.ROTATE_BYTES // wbytes)))
    weights = [gb._random_weight(k, n, 4, 128, dev) for _ in range(copies)]
    for m in (1, 8, 32):
        x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
        outs = [torch.empty(m, n, dtype=torch.bfloat16, device=dev) for _ in range(copies)]
        plain = gb.time_graph(gb._quant_launches(Q.quant_matmul, weights, x, outs, 4, 128, "tcs", None), copies, 3, dev)[0]
        def two():
            for w, o in zip(weights, outs):
                Q.quant_matmul(x, w["qweight"], w["scales"], w["zeros"], 4, 128, "zero", out=o, integer_zeros=True)
                act_and_mul(o[:, :n // 2], o[:, n // 2:], "silu")
        def fused():
            for w in weights:
                Q.quant_matmul_act_and_mul(x, w["qweight"], w["scales"], w["zeros"], None, 128, "zero", True, "silu")
        row = {"tcs": round(plain, 2), "tcs+act_and_mul": round(gb.time_graph(two, copies, 3, dev)[0], 2),
               "fused": round(gb.time_graph(fused, copies, 3, dev)[0], 2)}
        res[f"{k}x{n} m={m}"] = row
        print(f"{k}x{n} m={m}: {row}", flush=True)
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

    fused_op = L.gate_up_act_and_mul
    for name in ("on", "off", "on_again", "off_again"):
        L.gate_up_act_and_mul = fused_op if name.startswith("on") else (lambda *a, **k: None)
        runner._graphs.clear(); torch.cuda.synchronize(); runner.capture()
        res[f"step {streams}x {name}"] = [round(steady(), 1), round(steady(), 1)]
        print(f"step {streams} streams {name}: {res[f'step {streams}x {name}']} us", flush=True)
json.dump(res, open(os.environ.get("OUT_JSON", "/tmp/actstep.json"), "w"), indent=1)
