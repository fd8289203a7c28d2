"""A 2048-token chunk at context 0 and at context 2048 (a 4096-token prompt, budget 2048): step times graphed
(prefill tiles) against eager (SDPA), same engine."""
import json, sys, time, random, torch
from core.config import EngineConfig
from core.engine.llm_engine import LLMEngine
from core.engine.sampling_params import SamplingParams

engine = LLMEngine(EngineConfig(dummy_weights=True, shape="qwen2.5-3b", quantization="w4a16", max_model_len=8192,
                                kv_cache_memory="8GiB", max_num_seqs=8))
runner = engine.step_runner
rng = random.Random(1)
def one(limit):
    runner.attention_work_limit = limit
    engine.add_request([rng.randrange(1, 150000) for _ in range(4096)], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        torch.cuda.synchronize(); t = time.perf_counter(); engine.step(); torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1000)
    return times
limit = runner.attention_work_limit
res = {}
for label, lim in (("graphed", limit), ("eager", 0)) * 3:
    res.setdefault(label, []).append(one(lim))
for k, v in res.items():
    print(k, [[round(x, 2) for x in r] for r in v])
json.dump(res, open(sys.argv[1], "w"), indent=1)
