"""How often the default model answers short factual questions right, and whether it loops, at given
sampling settings (the check behind the default model's shipped sampling defaults).

    python scripts/measure_default_sampling.py                      # the shipped defaults
    python scripts/measure_default_sampling.py --temperature 0.7 --top-p 0.9   # other settings
    DEEPINFER_CPU_WEIGHTS=dense python scripts/measure_default_sampling.py      # another CPU layout

A right answer contains the expected keyword (case-insensitive); a loop is an 8-token span that
occurs three times within the first 200 tokens of an answer to an open prompt. Prints JSON objects
as it goes: the settings; the rate and the wrong answers; the loops.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from default_model_questions import FACTUAL_QUESTIONS, OPEN_PROMPTS, has_loop, is_right


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, kind in (("--temperature", float), ("--top-p", float), ("--top-k", int), ("--min-p", float),
                       ("--repetition-penalty", float), ("--presence-penalty", float), ("--frequency-penalty", float)):
        parser.add_argument(flag, type=kind, default=None, help="default: the model's")
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated sampling seeds")
    parser.add_argument("--open-seeds", default="0", help="seeds of the open prompts")
    parser.add_argument("--max-tokens", type=int, default=48, help="per factual answer")
    args = parser.parse_args()

    from dataclasses import replace

    from deepinfer import LLM, SamplingParams

    llm = LLM(device="cpu", max_num_seqs=64)
    given = {k: v for k, v in vars(args).items()
             if k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                      "frequency_penalty") and v is not None}
    base = SamplingParams(**given)
    resolved = base.with_defaults(llm.sampling_defaults)
    from deepinfer.core.ops.quant_matmul_cpu import cpu_weights_mode

    print(json.dumps({"settings": {k: getattr(resolved, k) for k in given} | {
        k: llm.sampling_defaults.values[k] for k in llm.sampling_defaults.values if k not in given},
        "cpu_weights": cpu_weights_mode()}), flush=True)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    start = time.perf_counter()
    conversations = [[{"role": "user", "content": q}] for q, _ in FACTUAL_QUESTIONS for _ in seeds]
    params = [replace(base, seed=s, max_tokens=args.max_tokens) for _ in FACTUAL_QUESTIONS for s in seeds]
    answers = [o.outputs[0].text for o in llm.chat(conversations, params)] if conversations else []
    keys = [k for _, k in FACTUAL_QUESTIONS for _ in seeds]
    wrong = [{"question": c[0]["content"], "answer": a} for c, a, k in zip(conversations, answers, keys)
             if not is_right(a, k)]
    if answers:
        print(json.dumps({"right": len(answers) - len(wrong), "asked": len(answers),
                          "rate": 1 - len(wrong) / len(answers), "seconds": round(time.perf_counter() - start, 1),
                          "wrong": wrong}, indent=1), flush=True)
    open_seeds = [int(s) for s in args.open_seeds.split(",") if s]
    open_conversations = [[{"role": "user", "content": p}] for p in OPEN_PROMPTS for _ in open_seeds]
    if open_conversations:
        open_params = [replace(base, seed=s, max_tokens=200) for _ in OPEN_PROMPTS for s in open_seeds]
        outputs = llm.chat(open_conversations, open_params)
        loops = [{"prompt": c[0]["content"], "answer": o.outputs[0].text}
                 for c, o in zip(open_conversations, outputs) if has_loop(o.outputs[0].token_ids)]
        print(json.dumps({"loops": len(loops), "open_answers": len(open_conversations),
                          "tokens": [len(o.outputs[0].token_ids) for o in outputs],
                          "seconds": round(time.perf_counter() - start, 1), "loop_answers": loops}, indent=1),
              flush=True)


if __name__ == "__main__":
    main()
