"""`deepinfer validate-kernels`: compile every registered kernel, check each against its torch reference
(quant_matmul_checks, attention_checks, small_op_checks), replay a CUDA graph of the kernels (graph_check), and
compare a tiny model's logits on the native and reference paths (model_check).

The report is JSON-ready: the environment, compile times and errors, one record per check, and a
summary; any failed check (or compile error) makes `passed` false.
"""

from __future__ import annotations

import time

import torch

from deepinfer.core.bench.env_info import env_info
from deepinfer.validate import attention_checks, quant_matmul_checks, small_op_checks
from deepinfer.validate.compare import CheckResult, guarded, summarize
from deepinfer.validate.graph_check import check_cuda_graph
from deepinfer.validate.model_check import check_tiny_model

CHECK_GROUPS = ("quant_matmul", "dequantize", "paged_decode_attention", "paged_prefill_attention", "rms_norm",
                "act_and_mul", "rope_cache_write", "quant_matmul_rope_cache", "quant_matmul_act_and_mul", "w4_fragment_gemm",
                "w8_gemm", "w4_fragment_batch", "token_bitmask", "cuda_graph", "end_to_end")


def _instantiations(groups: tuple[str, ...]) -> list[tuple[str, str]]:
    """(source, name) of the kernels the selected checks need: the registry's, plus every quant_matmul
    instantiation its launcher can ask for; the CUDA-graph and end-to-end checks use every op."""
    from deepinfer.kernels import quant_matmul, registry

    jobs = registry.all_instantiations() + [(quant_matmul.SOURCE, name) for name in quant_matmul.instantiations()]
    if not {"cuda_graph", "end_to_end"} & set(groups):
        sources = {registry.get(group).source for group in groups}
        jobs = [job for job in jobs if job[0] in sources]
    return list(dict.fromkeys(jobs))


def run_validation(device_index: int = 0, workers: int = 8, seed: int | None = None,
                   command: list[str] | None = None, only: tuple[str, ...] | None = None) -> dict:
    """Compile, check and summarize on cuda:<device_index>; returns the JSON-ready report.
    only: a subset of CHECK_GROUPS to run (default all)."""
    from deepinfer.kernels.compiler import precompile

    groups = tuple(only) if only else CHECK_GROUPS
    unknown = [group for group in groups if group not in CHECK_GROUPS]
    if unknown:
        raise ValueError(f"unknown check group(s) {', '.join(unknown)}; choose from {', '.join(CHECK_GROUPS)}")
    device = torch.device("cuda", device_index)
    torch.cuda.set_device(device)
    seed = int(time.time()) % 2**31 if seed is None else seed
    torch.manual_seed(seed)
    report = {"env": env_info(command), "seed": seed, "groups": list(groups)}

    start = time.perf_counter()
    compiled = precompile(_instantiations(groups), device_index, workers)
    report["compile"] = {"kernels": len(compiled), "wall_seconds": round(time.perf_counter() - start, 2),
                         "workers": workers, "records": compiled}
    results = [CheckResult("compile", rec["kernel"], False, detail=rec["error"]) for rec in compiled if rec["error"]]

    checks = {
        "quant_matmul": quant_matmul_checks.check_quant_matmul_all,
        "dequantize": quant_matmul_checks.check_dequantize,
        "quant_matmul_rope_cache": quant_matmul_checks.check_quant_matmul_rope_cache,
        "quant_matmul_act_and_mul": quant_matmul_checks.check_quant_matmul_act_and_mul,
        "w4_fragment_gemm": quant_matmul_checks.check_w4_fragment_gemm,
        "w8_gemm": quant_matmul_checks.check_w8_gemm,
        "w4_fragment_batch": quant_matmul_checks.check_w4_fragment_batch,
        "paged_decode_attention": attention_checks.check_paged_attention,
        "paged_prefill_attention": attention_checks.check_paged_prefill_attention,
        "rms_norm": small_op_checks.check_rms_norm, "act_and_mul": small_op_checks.check_act_and_mul,
        "rope_cache_write": small_op_checks.check_rope_cache_write,
        "token_bitmask": small_op_checks.check_token_bitmask,
    }
    for group in groups:
        if group in checks:
            results += checks[group](device)
    if "cuda_graph" in groups:
        results += guarded("cuda_graph", "capture + replay", lambda: check_cuda_graph(device))
    if "end_to_end" in groups:
        for dtype, bits, group, kv_quantization, tol in ((torch.float16, 4, 64, None, 5e-3),
                                                         (torch.bfloat16, 3, 64, "int8", 3e-2),
                                                         (torch.float16, 4, 64, "fp8", 3e-2)):
            results += guarded("end_to_end", f"tiny Llama {dtype} W{bits} {kv_quantization or 'same-dtype'} KV",
                               lambda dtype=dtype, bits=bits, group=group, kv_quantization=kv_quantization, tol=tol:
                               check_tiny_model(device, dtype, bits, group, kv_quantization, tol))

    report["results"] = [result.to_dict() for result in results]
    report["summary"] = summarize(results)
    report["passed"] = report["summary"]["failed"] == 0
    return report
