"""Steady decode step of the tree on PYTHONPATH, per attention variant (split: clusters off; clustered: the tree's
default), graphs recaptured per variant, plus the greedy tokens of stream 0 (to compare trees).
   PYTHONPATH=<tree> python3 _run/tree_step.py   (env STREAMS/VARIANTS/OUT_JSON/LABEL)"""
import json, os, time
import torch
import kernels.paged_attention as PA
from core.config import EngineConfig
from core.engine.llm_engine import LLMEngine
from core.engine.sampling_params import SamplingParams

streams = int(os.environ.get("STREAMS", "1"))
label = os.environ.get("LABEL", "tree")
engine = LLMEngine(EngineConfig(dummy_weights=True, shape="qwen2.5-3b", quantization="w4a16",
                                max_model_len=1024, kv_cache_memory="4GiB", max_num_seqs=streams))
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

def tokens():
    rid = engine.add_request(list(range(5, 300)), SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    out = []
    while engine.has_unfinished_requests():
        for o in engine.step()[0]:
            if o.request_id == rid and o.finished:
                out = list(o.outputs[0].token_ids)
    return out

res = {}
capable = getattr(PA, "_cluster_capable", None)
for name in os.environ.get("VARIANTS", "split").split(","):
    if capable is not None:
        PA._cluster_capable = capable if name.startswith("clustered") else (lambda index: False)
    runner._graphs.clear(); torch.cuda.synchronize(); runner.capture()
    res[f"{label} {streams}x {name}"] = {"us": [round(steady(), 1), round(steady(), 1)], "tokens": tokens()}
    print(f"{label} {streams} streams {name}: {res[f'{label} {streams}x {name}']['us']} us, tokens {res[f'{label} {streams}x {name}']['tokens'][:12]}", flush=True)
json.dump(res, open(os.environ.get("OUT_JSON", "/tmp/tree_step.json"), "w"), indent=1)
