"""`deepinfer bench cpu`: a GGUF and its layered W4A16 conversion on the CPU, side by side with HF transformers.

One process, one thread count (torch.set_num_threads) for every subject:
  deepinfer <gguf>       the GGUF through the engine (its 4-bit projections packed for the CPU int4 product)
  deepinfer <converted>  the `deepinfer convert` output of the same file (the same codes), through the engine
  hf transformers        the same GGUF loaded by transformers (`gguf_file=`, dequantized to fp32), `model.generate`

Each run is two requests, greedy with EOS ignored, of seeded random ids (the same for every subject): a
`prompt_len`-token prompt then `output_len` tokens, and a `SHORT_PROMPT_TOKENS`-token prompt then `output_len`
tokens. Prefill is the long prompt's time to its first token; decode is the rate of the tokens after the first
((output_len - 1) / (last - first token)): `decode_tokens_per_s` after the short prompt (a chat's first turns),
`long_context_decode_tokens_per_s` after the long one. The engine runs with its
prefix cache off, so a repeat pays its prefill again.

The machine may be shared (CI's 2 cores serve several jobs): wall-clock rates then measure the neighbours as
much as the code. So each repeat runs the subjects in a rotated order (repeat r starts with subject r mod 3:
no subject always runs first, after the HF peer's allocations, or right after the other deepinfer subject), and
the engine subjects also report the process CPU time per decoded token (`decode_cpu_ms_per_token`,
time.process_time over every thread of the process, between the first and last token of the short request): what
the work costs, whatever share of the cores it got. `converted_decode_cpu_vs_gguf` compares the conversion with
its source on that figure. The load average before and after is in the payload, and `repeats` gives mean ± std.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

DECODE_TARGET = 2.0  # decode at least 2x HF's tok/s
SHORT_PROMPT_TOKENS = 16  # the short request's prompt, and the warm-up's


@dataclass(frozen=True)
class CpuWorkload:
    prompt_len: int = 2048
    output_len: int = 64
    threads: int = 2
    repeats: int = 1
    seed: int = 0


def prompt_ids(workload: CpuWorkload, vocab_size: int, repeat: int) -> list[int]:
    import torch

    generator = torch.Generator().manual_seed(workload.seed + repeat)
    return torch.randint(100, vocab_size, (workload.prompt_len,), generator=generator).tolist()


def _engine_run(llm, prompt: list[int], output_len: int) -> tuple[list[float], list[int], list[float]]:
    """(receive time of each output token minus the send time, the tokens, the process CPU time at each token
    minus that at the send) of one request through LLMEngine."""
    from deepinfer.core.engine.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    group = engine.make_request_group(prompt, params)
    times: list[float] = []
    cpu_times: list[float] = []
    tokens: list[int] = []
    sent, sent_cpu = time.perf_counter(), time.process_time()
    engine.add_request_group(group)
    while engine.has_unfinished_requests():
        outputs, _ = engine.step()
        now, now_cpu = time.perf_counter() - sent, time.process_time() - sent_cpu
        for output in outputs:
            produced = output.outputs[0].token_ids
            times.extend([now] * (len(produced) - len(tokens)))
            cpu_times.extend([now_cpu] * (len(produced) - len(tokens)))
            tokens = list(produced)
    return times, tokens, cpu_times


def _hf_run(model, prompt: list[int], output_len: int) -> tuple[list[float], list[int], list[float]]:
    """(token times, no tokens, no CPU times: the peer's clock is wall time only) of one model.generate."""
    from deepinfer.core.bench.hf_peer import generate_batch

    sent, step_times = generate_batch(model, [prompt], output_len, "cpu")
    return [t - sent for t in step_times], [], []


def _stat(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values) if values else None,
            "std": statistics.stdev(values) if len(values) > 1 else None, "runs": values}


def _decode_rates(runs: list[list[float]]) -> list[float]:
    return [(len(times) - 1) / (times[-1] - times[0]) for times in runs if len(times) > 1 and times[-1] > times[0]]


def _cpu_ms_per_token(runs: list[list[float]]) -> list[float]:
    """Process CPU times at each token -> CPU milliseconds per token after the first, per run."""
    return [1000 * (cpu[-1] - cpu[0]) / (len(cpu) - 1) for cpu in runs if len(cpu) > 1]


def rotated(names: list[str], repeat: int) -> list[str]:
    """The subjects in repeat `repeat`'s order: the list rotated left by `repeat`."""
    shift = repeat % len(names)
    return names[shift:] + names[:shift]


def _summary(runs: list[list[float]], prompt_len: int, short_runs: list[list[float]] | None = None,
             short_cpu_runs: list[list[float]] | None = None) -> dict:
    """Token times of the long requests (and the short ones, with their CPU times) -> prefill and decode
    statistics."""
    prefill = [times[0] for times in runs]
    summary = {"prefill_s": _stat(prefill), "prefill_tokens_per_s": _stat([prompt_len / s for s in prefill]),
               "long_context_decode_tokens_per_s": _stat(_decode_rates(runs))}
    if short_runs is not None:
        summary["decode_tokens_per_s"] = _stat(_decode_rates(short_runs))
    cpu_ms = _cpu_ms_per_token(short_cpu_runs or [])
    if cpu_ms:  # the HF peer has no CPU clock
        summary["decode_cpu_ms_per_token"] = _stat(cpu_ms)
    return summary


def run_cpu_benchmark(gguf: Path, converted: Path, workload: CpuWorkload, say=print) -> dict:
    """Every subject `workload.repeats` times (interleaved, after one warm-up each) -> the JSON payload."""
    import torch

    from deepinfer import LLM
    from deepinfer.core.ops.quant_matmul_cpu import cpu_weights_mode

    torch.set_num_threads(workload.threads)
    load_before = os.getloadavg()
    engine_args = {"device": "cpu", "enable_prefix_caching": False,
                   "max_num_batched_tokens": max(2048, workload.prompt_len),
                   "max_model_len": workload.prompt_len + workload.output_len + 16}
    subjects = {}
    say(f"loading {gguf.name} and {converted.name} (deepinfer), {gguf.name} (HF transformers, fp32)")
    subjects["deepinfer_gguf"] = ("engine", LLM(str(gguf), **engine_args))
    subjects["deepinfer_converted"] = ("engine", LLM(str(converted), **engine_args))
    subjects["hf_transformers"] = ("hf", _load_hf(gguf))
    vocab_size = subjects["deepinfer_gguf"][1].engine.spec.vocab_size
    run_fns = {"engine": _engine_run, "hf": _hf_run}
    for name, (kind, model) in subjects.items():  # warm-up: allocator, thread pool, first-shape work
        run_fns[kind](model, prompt_ids(workload, vocab_size, -1)[:SHORT_PROMPT_TOKENS], 2)
    times: dict[str, list[list[float]]] = {name: [] for name in subjects}
    short_times: dict[str, list[list[float]]] = {name: [] for name in subjects}
    short_cpu_times: dict[str, list[list[float]]] = {name: [] for name in subjects}
    tokens: dict[str, list[int]] = {}
    for repeat in range(workload.repeats):
        prompt = prompt_ids(workload, vocab_size, repeat)
        for name in rotated(list(subjects), repeat):
            kind, model = subjects[name]
            say(f"run {repeat + 1}/{workload.repeats}: {name}")
            run_times, run_tokens, _ = run_fns[kind](model, prompt, workload.output_len)
            times[name].append(run_times)
            short, _, short_cpu = run_fns[kind](model, prompt[-SHORT_PROMPT_TOKENS:], workload.output_len)
            short_times[name].append(short)
            short_cpu_times[name].append(short_cpu)
            if run_tokens and repeat == 0:
                tokens[name] = run_tokens
    results = {name: _summary(runs, workload.prompt_len, short_times[name], short_cpu_times[name])
               for name, runs in times.items()}
    results["deepinfer_gguf"]["model"] = str(gguf)
    results["deepinfer_converted"]["model"] = str(converted)
    results["hf_transformers"].update({"model": str(gguf), "dtype": "float32", "loader": "transformers gguf_file="})

    def ratio(a: str, b: str, field: str, inverse: bool = False) -> float | None:
        x, y = results[a][field]["mean"], results[b][field]["mean"]
        if not x or not y:
            return None
        return y / x if inverse else x / y

    ratios = {
        "gguf_decode_vs_hf": ratio("deepinfer_gguf", "hf_transformers", "decode_tokens_per_s"),
        "converted_decode_vs_hf": ratio("deepinfer_converted", "hf_transformers", "decode_tokens_per_s"),
        "gguf_long_context_decode_vs_hf": ratio("deepinfer_gguf", "hf_transformers",
                                                "long_context_decode_tokens_per_s"),
        "converted_long_context_decode_vs_hf": ratio("deepinfer_converted", "hf_transformers",
                                                     "long_context_decode_tokens_per_s"),
        "gguf_prefill_speed_vs_hf": ratio("deepinfer_gguf", "hf_transformers", "prefill_s", inverse=True),
        "converted_prefill_speed_vs_hf": ratio("deepinfer_converted", "hf_transformers", "prefill_s", inverse=True),
        "converted_decode_vs_gguf": ratio("deepinfer_converted", "deepinfer_gguf", "decode_tokens_per_s"),
        # > 1: the conversion spends more CPU per decoded token than its source
        "converted_decode_cpu_vs_gguf": ratio("deepinfer_converted", "deepinfer_gguf", "decode_cpu_ms_per_token"),
        "converted_prefill_speed_vs_gguf": ratio("deepinfer_converted", "deepinfer_gguf", "prefill_s", inverse=True),
    }
    targets = {
        "decode_at_least_2x_hf": all(r is not None and r >= DECODE_TARGET
                                     for r in (ratios["gguf_decode_vs_hf"], ratios["converted_decode_vs_hf"])),
        "prefill_at_least_hf": all(r is not None and r >= 1.0 for r in (ratios["gguf_prefill_speed_vs_hf"],
                                                                         ratios["converted_prefill_speed_vs_hf"])),
    }
    return {
        "benchmark": "cpu",
        "workload": {"prompt_len": workload.prompt_len, "output_len": workload.output_len,
                     "repeats": workload.repeats, "seed": workload.seed},
        "threads": workload.threads,
        "cpu_count": os.cpu_count(),
        "cpu_weights": cpu_weights_mode(),
        "load_average_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
        "subjects": results,
        "ratios": ratios,
        "targets_met": targets,
        "greedy_tokens_equal": tokens.get("deepinfer_gguf") == tokens.get("deepinfer_converted"),
    }


def _load_hf(gguf: Path):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return model.eval()


def cpu_tables(payload: dict) -> list:
    from rich.table import Table

    from deepinfer.core.bench.report import format_mean_std

    workload = payload["workload"]
    table = Table(title=f"CPU, {payload['threads']} threads: {workload['prompt_len']}-token prompt (prefill), "
                        f"{workload['output_len']} greedy tokens after a {SHORT_PROMPT_TOKENS}-token prompt and "
                        f"after the long one")
    for column in ("subject", "prefill s", "prefill tok/s", "decode tok/s", "decode vs HF", "decode CPU ms/tok",
                   f"decode at {workload['prompt_len']}"):
        table.add_column(column, justify="left" if column == "subject" else "right")
    hf_decode = payload["subjects"]["hf_transformers"]["decode_tokens_per_s"]["mean"]
    for name, result in payload["subjects"].items():
        decode = result["decode_tokens_per_s"]["mean"]
        versus = f"{decode / hf_decode:.2f}x" if decode and hf_decode else "-"
        table.add_row(name, format_mean_std(result["prefill_s"], 2), format_mean_std(result["prefill_tokens_per_s"]),
                      format_mean_std(result["decode_tokens_per_s"]), versus,
                      format_mean_std(result.get("decode_cpu_ms_per_token")),
                      format_mean_std(result["long_context_decode_tokens_per_s"]))
    return [table]
