"""Where torch's reservation goes under --max-vram 4GiB (Qwen2.5-3B W4A16 dummy, max_num_seqs 8).
argv[1]: "cap" (as committed) or "nocap" (cap_torch_memory a no-op). Prints memory per capture and on OOM
the segments by pool."""

import logging
import random
import sys
import traceback

import torch

from core import SamplingParams
from core.config import EngineConfig
from core.engine import cuda_graphs, llm_engine

logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s: %(message)s")
GiB = 1024**3
if sys.argv[1] == "nocap":
    llm_engine.cap_torch_memory = lambda max_vram, device: None


def mem(tag):
    print(f"  {tag}: allocated {torch.cuda.memory_allocated() / GiB:.3f} reserved {torch.cuda.memory_reserved() / GiB:.3f}"
          f" peak-reserved {torch.cuda.max_memory_reserved() / GiB:.3f}", flush=True)


def segments():
    pools = {}
    for seg in torch.cuda.memory_snapshot():
        key = (seg["segment_type"], str(seg.get("segment_pool_id")))
        total, used, count = pools.get(key, (0, 0, 0))
        pools[key] = (total + seg["total_size"], used + seg["allocated_size"], count + 1)
    for key, (total, used, count) in sorted(pools.items()):
        print(f"  pool {key}: {count} segments, {total / GiB:.3f} GiB, allocated {used / GiB:.3f}", flush=True)


original = cuda_graphs.PaddedStepRunner._capture_one


def traced(self, tokens, bound, pool, stream):
    graph = original(self, tokens, bound, pool, stream)
    mem(f"after capture {tokens}x{bound}")
    return graph


cuda_graphs.PaddedStepRunner._capture_one = traced
try:
    engine = llm_engine.LLMEngine(EngineConfig(dummy_weights=True, shape="qwen2.5-3b", quantization="w4a16",
                                               max_vram="4GiB", max_num_seqs=8, max_model_len=4096))
except torch.OutOfMemoryError:
    traceback.print_exc(limit=-8)
    mem("at OOM")
    segments()
    sys.exit(1)
mem("engine ready")
segments()
rng = random.Random(0)
for concurrency in (1, 8):
    ids = [engine.add_request([rng.randrange(1000, 40000) for _ in range(256)],
                              SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
           for _ in range(concurrency)]
    while engine.has_unfinished_requests():
        engine.step()
    mem(f"after {concurrency} requests")
segments()
