"""`deepinfer validate-kernels`: compile every registered kernel, check each against its torch
reference (core/bench/kernel_checks.py), replay a CUDA graph of the kernels, and compare a tiny
model's logits on the native and reference paths (core/bench/model_validation.py).

The report is JSON-ready: the environment, compile times and errors, one record per check, and a
summary; any failed check (or compile error) makes `passed` false.
"""

from __future__ import annotations

import time

import torch

from deepinfer.core.bench import kernel_checks
from deepinfer.core.bench.env_info import env_info
from deepinfer.core.bench.kernel_checks import CheckResult, guarded
from deepinfer.core.bench.model_validation import check_tiny_model


def check_cuda_graph(device) -> CheckResult:
    """Capture quant_matmul -> rms_norm, and decode attention on both paths (4 sequences: split; 16: combined,
    kernels/paged_attention.py), through core.ops; replay on new inputs written into the captured buffers; the
    replay must equal an eager run bit for bit."""
    from deepinfer.core.ops.norm import rms_norm
    from deepinfer.core.ops.paged_attention import paged_decode_attention
    from deepinfer.core.ops.quant_matmul import quant_matmul

    dtype = torch.float16
    packed = kernel_checks.random_packed(4096, 4096, 128, 4, "zero", torch.float16, device)
    norm_weight = torch.randn(4096, dtype=dtype, device=device)
    lengths = (1000, 517, 64, 1024)
    k_cache, v_cache, _, _, tables = kernel_checks.random_paged_kv(lengths, 8, 128, 16, dtype, False, device)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    x = torch.randn(4, 4096, dtype=dtype, device=device)
    query = torch.randn(4, 32, 128, dtype=dtype, device=device)
    many_lengths = (1000, 517, 64, 1024, 1, 300, 17, 999) * 2  # 16 sequences x 8 KV heads: the combined path
    many = kernel_checks.random_paged_kv(many_lengths, 8, 128, 16, dtype, False, device)
    many_seq_lens = torch.tensor(many_lengths, dtype=torch.int32, device=device)
    many_query = torch.randn(16, 32, 128, dtype=dtype, device=device)

    def step() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        normed, _ = rms_norm(quant_matmul(x, packed), norm_weight, 1e-6)
        attended = paged_decode_attention(query, k_cache, v_cache, tables, seq_lens, 128**-0.5, max_seq_len=1024)
        attended_many = paged_decode_attention(many_query, many[0], many[1], many[4], many_seq_lens, 128**-0.5,
                                               max_seq_len=1024)
        return normed, attended, attended_many

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        step()  # compile, load and allocate everything outside the capture
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    x.copy_(torch.randn_like(x))
    query.copy_(torch.randn_like(query))
    many_query.copy_(torch.randn_like(many_query))
    graph.replay()
    torch.cuda.synchronize(device)
    eager = step()
    same = all(torch.equal(a, b) for a, b in zip(captured, eager))
    case = ("capture quant_matmul (dispatch's kernel)+rms_norm, paged attention (split and combined); "
            "replay on new inputs")
    result = kernel_checks.compare("cuda_graph", case, torch.cat([captured[1], captured[2]]),
                                   torch.cat([eager[1], eager[2]]), kernel_checks.REL_TOL[dtype])
    result.ok = result.ok and same
    result.detail = "replay equals eager bit for bit" if same else "replay differs from eager"
    return result


def check_split_cuda_graph(device) -> list[CheckResult]:
    """Capture the split GEMV (kernels.quant_matmul, kernel="split") at 1, 2 and 4 tokens on shapes whose
    plans take 1, 4 and 8 K-parts; replay on new activations written into the captured buffer: each output
    must equal an eager run bit for bit and match the reference product. (K-parts as planned on 132 SMs.)"""
    from deepinfer.kernels.quant_matmul import quant_matmul

    results = []
    for dtype, bits, zero_mode, out_features, in_features, group_size in (
            (torch.float16, 4, "zero", 22016, 4096, 128), (torch.bfloat16, 3, "min", 4096, 4096, 64),
            (torch.float16, 3, "zero", 1000, 11008, 128)):
        case = f"{kernel_checks._DTYPE_NAMES[dtype]} W{bits} {zero_mode} N={out_features} K={in_features} split, 1/2/4 tokens"

        def run(dtype=dtype, bits=bits, zero_mode=zero_mode, out_features=out_features, in_features=in_features,
                group_size=group_size, case=case) -> CheckResult:
            packed = kernel_checks.random_packed(out_features, in_features, group_size, bits, zero_mode,
                                                 torch.float16, device, bias_dtype=dtype)
            xs = [torch.randn(m, in_features, dtype=dtype, device=device) for m in (1, 2, 4)]

            def step() -> list[torch.Tensor]:
                return [quant_matmul(x, packed.qweight, packed.scales, packed.zeros, bits, group_size, zero_mode,
                                     packed.bias, kernel="split") for x in xs]

            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                step()  # compile and load outside the capture
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = step()
            for x in xs:
                x.copy_(torch.randn_like(x))
            graph.replay()
            torch.cuda.synchronize(device)
            eager = step()
            dense = kernel_checks.dequantize(packed, torch.float32)
            ref = torch.cat([x.float() @ dense.T + packed.bias.float() for x in xs])
            result = kernel_checks.compare("cuda_graph", case, torch.cat(captured), ref, kernel_checks.REL_TOL[dtype])
            same = all(torch.equal(a, b) for a, b in zip(captured, eager))
            result.ok = result.ok and same
            result.detail = "replay equals eager bit for bit" if same else "replay differs from eager"
            return result

        results += guarded("cuda_graph", case, run)
    return results


CHECK_GROUPS = ("quant_matmul", "dequantize", "paged_decode_attention", "paged_prefill_attention", "rms_norm",
                "act_and_mul", "rope_cache_write", "quant_matmul_rope_cache", "quant_matmul_act_and_mul", "cuda_graph",
                "end_to_end")


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
        "quant_matmul": kernel_checks.check_quant_matmul_all, "paged_decode_attention": kernel_checks.check_paged_attention,
        "paged_prefill_attention": kernel_checks.check_paged_prefill_attention,
        "rms_norm": kernel_checks.check_rms_norm, "act_and_mul": kernel_checks.check_act_and_mul,
        "rope_cache_write": kernel_checks.check_rope_cache_write, "dequantize": kernel_checks.check_dequantize,
        "quant_matmul_rope_cache": kernel_checks.check_quant_matmul_rope_cache,
        "quant_matmul_act_and_mul": kernel_checks.check_quant_matmul_act_and_mul,
    }
    for group in groups:
        if group in checks:
            results += checks[group](device)
    if "cuda_graph" in groups:
        results += guarded("cuda_graph", "capture + replay", lambda: check_cuda_graph(device))
        results += check_split_cuda_graph(device)
    if "end_to_end" in groups:
        for dtype, bits, group, int8_kv, tol in ((torch.float16, 4, 64, False, 5e-3),
                                                 (torch.bfloat16, 3, 64, True, 3e-2)):
            results += guarded("end_to_end", f"tiny Llama {dtype} W{bits}",
                               lambda dtype=dtype, bits=bits, group=group, int8_kv=int8_kv, tol=tol:
                               check_tiny_model(device, dtype, bits, group, int8_kv, tol))

    report["results"] = [result.to_dict() for result in results]
    report["summary"] = kernel_checks.summarize(results)
    report["passed"] = report["summary"]["failed"] == 0
    return report
