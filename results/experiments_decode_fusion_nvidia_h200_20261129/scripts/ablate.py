"""Where a one-stream steady decode step's time goes inside the PDL chain: the step time with parts of the
layer replaced by nothing (outputs become garbage; only timing matters), and with launch variants.
   PYTHONPATH=. python3 _run/ablate.py VARIANTS...   (prints and writes $OUT_JSON)"""
import json, os, sys, time
import torch
from core.config import EngineConfig
from core.engine.llm_engine import LLMEngine
from core.engine.sampling_params import SamplingParams
import core.models.layers as L
import core.attention.native_backend as NB
import kernels.quant_matmul as Q
import kernels.paged_attention as PA

engine = LLMEngine(EngineConfig(dummy_weights=True, shape=os.environ.get("SHAPE", "qwen2.5-3b"), quantization="w4a16",
                                max_model_len=1024, kv_cache_memory="4GiB", max_num_seqs=int(os.environ.get("SEQS", "1"))))
runner = engine.step_runner
streams = int(os.environ.get("STREAMS", "1"))

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

orig = {"rot": L.rotary_and_cache_write, "act": L.act_and_mul, "norm": L.rms_norm, "attn": NB.paged_decode_attention,
        "plan": Q._plan, "launch_pa": PA.launch}

def no_rope():
    L.rotary_and_cache_write = lambda q, k, *a, **kw: (q, k)
def no_act():
    L.act_and_mul = lambda gate, up, act: gate
def no_norm():
    L.rms_norm = lambda x, w, eps, off, residual=None: (x, x if residual is None else residual)
def no_attn():
    NB.paged_decode_attention = lambda *a, **kw: None
def no_reduce():  # split path: only the decode kernel (launch of the reduce dropped)
    def launch(fn, grid, block, args, index, **kw):
        if "paged_reduce" in getattr(fn, "name", "") or kw.get("shared_mem"):
            return
        return orig["launch_pa"](fn, grid, block, args, index, **kw)
    PA.launch = launch
def tc8():
    def plan(*a, **kw):
        p = orig["plan"](*a, **kw)
        if a[7] == "tc":
            p = (p[0], p[1], (256, 1, 1)) + p[3:]
        return p
    Q._plans.clear(); Q._plan = plan
def unfused():
    L.qkv_rotary_and_cache_write = lambda *a, **kw: None
orig["qkvrope"] = getattr(L, "qkv_rotary_and_cache_write", None)
def restore():
    if orig["qkvrope"] is not None:
        L.qkv_rotary_and_cache_write = orig["qkvrope"]
    L.rotary_and_cache_write, L.act_and_mul, L.rms_norm = orig["rot"], orig["act"], orig["norm"]
    NB.paged_decode_attention, Q._plan, PA.launch = orig["attn"], orig["plan"], orig["launch_pa"]
    Q._plans.clear()

VARIANTS = {"base": [], "no_rope": [no_rope], "no_act": [no_act], "no_norm": [no_norm], "no_attn": [no_attn],
            "no_reduce": [no_reduce], "no_small": [no_rope, no_act, no_norm, no_attn], "tc8": [tc8], "unfused": [unfused]}
names = sys.argv[1:] or list(VARIANTS)
res = {}
for name in names:
    restore()
    for patch in VARIANTS[name]:
        patch()
    runner._graphs.clear(); torch.cuda.synchronize(); runner.capture()
    res[name] = [round(steady(), 1), round(steady(), 1)]
    print(f"{name}: {res[name]} us/step", flush=True)
restore(); runner._graphs.clear(); runner.capture()
res["base_end"] = [round(steady(), 1)]
print("base_end", res["base_end"], flush=True)
json.dump(res, open(os.environ.get("OUT_JSON", "/tmp/ablate.json"), "w"), indent=1)
