"""EXPERIMENT: (A) the one-token products with weights hot in L2 against rotated copies; (B) the steady decode
step with an L2 prefetch kernel launched at chosen points of each layer.
   PYTHONPATH=. python3 _run/l2pf.py   (env STREAMS/SEQS/OUT_JSON/PARTS)"""
import json, os, sys, time
import numpy as np
import torch
import kernels.quant_matmul as q
from core.bench import gemv_bench as gb
from kernels.compiler import get_kernel
from kernels.launch import launch, i32, i64, ptr

dev = torch.device("cuda", 0)
res = {}
parts = os.environ.get("PARTS", "A,B")
if "A" in parts:
    for k, n in [(2048, 2560), (2048, 2048), (2048, 22016), (11008, 2048)]:
        wbytes = n * k // 2 + 2 * n * (k // 128) * 2
        copies = max(1, min(128, -(-gb.ROTATE_BYTES // wbytes)))
        weights = [gb._random_weight(k, n, 4, 128, dev) for _ in range(copies)]
        for m in [1, 8, 32]:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            outs = [torch.empty(m, n, dtype=torch.bfloat16, device=dev) for _ in range(copies)]
            name = q.pick_kernel(m, k, n)
            cold = gb.time_graph(gb._quant_launches(q.quant_matmul, weights, x, outs, 4, 128, name, None), copies, 3, dev)[0]
            hot = gb.time_graph(gb._quant_launches(q.quant_matmul, weights[:1] * copies, x, outs, 4, 128, name, None), copies, 3, dev)[0]
            res[f"{k}x{n} m={m} {name}"] = {"cold_us": round(cold, 2), "hot_us": round(hot, 2)}
            print(f"{k}x{n} m={m} {name}: cold {cold:.2f} hot {hot:.2f} us", flush=True)
        del weights

if "B" in parts:
    from core.config import EngineConfig
    from core.engine.llm_engine import LLMEngine
    from core.engine.sampling_params import SamplingParams
    import core.models.layers as L

    seqs = int(os.environ.get("SEQS", "1"))
    streams = int(os.environ.get("STREAMS", "1"))
    engine = LLMEngine(EngineConfig(dummy_weights=True, shape="qwen2.5-3b", quantization="w4a16",
                                    max_model_len=1024, kv_cache_memory="4GiB", max_num_seqs=seqs))
    runner = engine.step_runner
    layers = list(engine.model.model.layers)
    idx = dev.index

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

    def ranges(mod):
        p = mod.packed
        return [(t.data_ptr(), t.numel() * t.element_size()) for t in (p.qweight, p.scales, p.zeros)]

    kern = get_kernel("l2_prefetch.cu", "l2_prefetch_kernel", idx)
    CFG = {"grid": 8, "chunk": 32768}

    def prefetch(rs):
        rs = (rs + [(0, 0)] * 4)[:4] if len(rs) <= 4 else None
        args = []
        for p_, n_ in rs:
            args += [np.uint64(p_), i64(n_)]
        launch(kern, (CFG["grid"], 1, 1), (128, 1, 1), tuple(args) + (i32(CFG["chunk"]),), idx)

    def merged(rs_lists):  # several modules' ranges, concatenated into <=4 spans where contiguous is not assumed
        out = []
        for rs in rs_lists:
            out += rs
        return out

    orig_fwd = L.DecoderLayer.forward
    orig_mlp = L.GatedMLP.forward
    orig_attn = L.Attention.forward
    plan = {"where": None}

    def layer_fwd(self, hidden, residual, *a):
        w = plan["where"]
        i = self.self_attn.layer_idx
        if w == "layer_start":  # this layer's o, gate_up, down
            rs = merged([ranges(self.self_attn.o_proj), ranges(self.mlp.gate_up_proj), ranges(self.mlp.down_proj)])
            prefetch(rs[:4]); prefetch(rs[4:8]); prefetch(rs[8:])
        elif w == "layer_start_mlp":  # gate_up + down only
            rs = merged([ranges(self.mlp.gate_up_proj), ranges(self.mlp.down_proj)])
            prefetch(rs[:3]); prefetch(rs[3:])
        elif w == "layer_start_big":  # only the two qweights (no scales/zeros), one launch
            prefetch([ranges(self.self_attn.o_proj)[0], ranges(self.mlp.gate_up_proj)[0], ranges(self.mlp.down_proj)[0],
                      ranges(self.mlp.gate_up_proj)[1]])
        return orig_fwd(self, hidden, residual, *a)

    def attn_fwd(self, x, *a):
        w = plan["where"]
        if w == "after_norm_qkv":  # launched right after input norm, before qkv: o+gate_up+down qweights
            prefetch([ranges(self.o_proj)[0], ranges(L_mlp[self.layer_idx].gate_up_proj)[0],
                      ranges(L_mlp[self.layer_idx].down_proj)[0], ranges(L_mlp[self.layer_idx].gate_up_proj)[1]])
        return orig_attn(self, x, *a)

    L_mlp = [l.mlp for l in layers]

    def mlp_fwd(self, x):
        w = plan["where"]
        if w == "mlp_start_down":  # before gate_up: down's weights
            prefetch(ranges(self.down_proj))
        return orig_mlp(self, x)

    L.DecoderLayer.forward, L.Attention.forward, L.GatedMLP.forward = layer_fwd, attn_fwd, mlp_fwd
    variants = [("base", None, 8, 32768), ("layer_start", "layer_start", 8, 32768), ("layer_start_g32", "layer_start", 32, 32768),
                ("layer_start_c8k", "layer_start", 32, 8192), ("layer_start_c128k", "layer_start", 8, 131072),
                ("layer_start_mlp", "layer_start_mlp", 8, 32768), ("layer_start_big", "layer_start_big", 8, 32768),
                ("after_norm_qkv", "after_norm_qkv", 8, 32768), ("mlp_start_down", "mlp_start_down", 8, 32768),
                ("base_end", None, 8, 32768)]
    only = os.environ.get("VARIANTS")
    for name, where, grid, chunk in variants:
        if only and name not in only.split(","):
            continue
        plan["where"] = where; CFG["grid"] = grid; CFG["chunk"] = chunk
        runner._graphs.clear(); torch.cuda.synchronize(); runner.capture()
        res[f"step {streams}x {name}"] = [round(steady(), 1), round(steady(), 1)]
        print(f"step {streams} streams {name}: {res[f'step {streams}x {name}']} us", flush=True)
json.dump(res, open(os.environ.get("OUT_JSON", "/tmp/l2pf.json"), "w"), indent=1)
