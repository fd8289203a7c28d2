"""Steady decode step with the clustered attention path (auto) and without (the split path), same engine, graphs
recaptured per variant.   PYTHONPATH=. python3 _run/clstep.py  (env STREAMS/SEQS/OUT_JSON)"""
import json, os, time
import torch
import kernels.paged_attention as PA
from core.config import EngineConfig
from core.engine.llm_engine import LLMEngine
from core.engine.sampling_params import SamplingParams

res = {}
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
    outs = {}
    for r in ids:
        engine.abort(r)
    while engine.has_unfinished_requests():
        engine.step()
    return us

capable = PA._cluster_capable
for name in ("clustered", "split", "clustered_again", "split_again"):
    PA._cluster_capable = capable if name.startswith("clustered") else (lambda index: False)
    runner._graphs.clear(); torch.cuda.synchronize(); runner.capture()
    res[f"step {streams}x {name}"] = [round(steady(), 1), round(steady(), 1)]
    print(f"step {streams} streams {name}: {res[f'step {streams}x {name}']} us", flush=True)
json.dump(res, open(os.environ.get("OUT_JSON", "/tmp/clstep.json"), "w"), indent=1)
