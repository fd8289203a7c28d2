"""The small kernels (RMSNorm, gated activation, RoPE + KV-cache write, token bitmask) against their torch
references."""

from __future__ import annotations

import torch

from deepinfer.core.ops.activation import act_and_mul_reference
from deepinfer.core.ops.norm import rms_norm_reference
from deepinfer.core.ops.rotary import apply_rotary_reference, write_kv_cache_reference
from deepinfer.core.ops.token_bitmask import apply_token_bitmask_reference
from deepinfer.validate.compare import DTYPE_NAMES, REL_TOL, CheckResult, compare, guarded, poisoned
from deepinfer.validate.inputs import rope_tables


def check_rms_norm(device, dtypes=(torch.float16, torch.bfloat16)) -> list[CheckResult]:
    from deepinfer.kernels.rms_norm import rms_norm

    results = []
    for dtype in dtypes:
        for rows, hidden in ((5, 576), (64, 4096), (3, 5120)):
            for with_residual in (False, True):
                for offset in (0.0, 1.0):
                    case = f"{DTYPE_NAMES[dtype]} T={rows} hidden={hidden} residual={with_residual} offset={offset}"

                    def run(dtype=dtype, rows=rows, hidden=hidden, with_residual=with_residual, offset=offset,
                            case=case):
                        x = torch.randn(rows, hidden, dtype=dtype, device=device) * 3
                        residual = torch.randn_like(x) if with_residual else None
                        weight = torch.randn(hidden, dtype=dtype, device=device) * 0.5 + (0.0 if offset else 1.0)
                        out, summed = poisoned(x.shape, dtype, device), poisoned(x.shape, dtype, device)
                        out, summed = rms_norm(x, weight, 1e-6, offset, residual, out=out, residual_out=summed)
                        ref, ref_sum = rms_norm_reference(x, weight, 1e-6, offset, residual)
                        result = compare("rms_norm", case, out, ref, REL_TOL[dtype])
                        if with_residual and not torch.equal(summed, ref_sum):
                            result.ok, result.detail = False, "residual sum differs from x + residual"
                        return result

                    results += guarded("rms_norm", case, run)
    return results


def check_act_and_mul(device, dtypes=(torch.float16, torch.bfloat16)) -> list[CheckResult]:
    """Both variants: gate and up as tensors or halves of one product, and interleaved in 8-column blocks (the
    column order of a gate/up product over the interleaved fragment layout), which must also give the plain
    variant's bits."""
    from deepinfer.kernels.act_and_mul import act_and_mul, act_and_mul_interleaved
    from deepinfer.kernels.w4_fragment_gemm import gate_up_order

    results = []
    for dtype in dtypes:
        for activation in ("silu", "gelu_tanh"):
            for rows, inner, merged in ((5, 1536, False), (64, 11008, True)):
                case = f"{DTYPE_NAMES[dtype]} {activation} T={rows} I={inner}" + (" merged" if merged else "")

                def run(dtype=dtype, activation=activation, rows=rows, inner=inner, merged=merged, case=case):
                    if merged:
                        fused = torch.randn(rows, 2 * inner, dtype=dtype, device=device) * 3
                        gate, up = fused[:, :inner], fused[:, inner:]
                    else:
                        gate = torch.randn(rows, inner, dtype=dtype, device=device) * 3
                        up = torch.randn_like(gate)
                    out = act_and_mul(gate, up, activation, out=poisoned((rows, inner), dtype, device))
                    return compare("act_and_mul", case, out, act_and_mul_reference(gate, up, activation),
                                   REL_TOL[dtype])

                results += guarded("act_and_mul", case, run)
            for rows, inner in ((7, 1024), (64, 11008)):
                case = f"{DTYPE_NAMES[dtype]} {activation} T={rows} I={inner} interleaved"

                def run_interleaved(dtype=dtype, activation=activation, rows=rows, inner=inner, case=case):
                    gate_up = torch.randn(rows, 2 * inner, dtype=dtype, device=device) * 3  # [gate | up]
                    gate, up = gate_up[:, :inner], gate_up[:, inner:]
                    out = act_and_mul_interleaved(gate_up[:, gate_up_order(inner, device)].contiguous(), activation,
                                                  out=poisoned((rows, inner), dtype, device))
                    result = compare("act_and_mul", case, out, act_and_mul_reference(gate, up, activation),
                                     REL_TOL[dtype])
                    if result.ok and not torch.equal(out.view(torch.int16),
                                                     act_and_mul(gate, up, activation).view(torch.int16)):
                        result.ok, result.detail = False, "differs from the plain variant's bits on the halves"
                    return result

                results += guarded("act_and_mul", case, run_interleaved)
    return results



def check_rope_cache_write(device, dtypes=(torch.float16, torch.bfloat16)) -> list[CheckResult]:
    from deepinfer.kernels.rope_cache import rope_and_cache_write

    results = []
    num_tokens, num_blocks, block_size = 11, 20, 16
    for dtype in dtypes:
        for int8 in (False, True, "fp8"):
            for heads, kv_heads, head_dim, rope in ((32, 8, 128, True), (9, 3, 64, True), (8, 4, 256, True),
                                                    (32, 8, 128, False)):
                case = (f"{DTYPE_NAMES[dtype]} {'fp8' if int8 == 'fp8' else 'int8' if int8 else 'same-dtype'} KV H={heads}/{kv_heads} "
                        f"D={head_dim} " + ("rope+write" if rope else "write only"))

                def run(dtype=dtype, int8=int8, heads=heads, kv_heads=kv_heads, head_dim=head_dim, rope=rope,
                        case=case):
                    query = torch.randn(num_tokens, heads, head_dim, dtype=dtype, device=device)
                    key = torch.randn(num_tokens, kv_heads, head_dim, dtype=dtype, device=device)
                    value = torch.randn_like(key)
                    cos, sin = rope_tables(num_tokens, head_dim, dtype, device)
                    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
                    shape = (num_blocks, kv_heads, block_size, head_dim)
                    if int8 == "fp8":  # 0x7F, the NaN code the kernels never write; scales per KV head
                        caches = [torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
                                  for _ in range(4)]
                        scales = [torch.rand(kv_heads, device=device) + 0.05] * 2
                        scales += scales
                    elif int8:
                        caches = [torch.full(shape, -128, dtype=torch.int8, device=device) for _ in range(4)]
                        scales = [poisoned(shape[:3], torch.float16, device) for _ in range(4)]
                    else:
                        caches = [poisoned(shape, dtype, device) for _ in range(4)]
                        scales = [None] * 4
                    q_out, k_out = poisoned(query.shape, dtype, device), poisoned(key.shape, dtype, device)
                    rope_and_cache_write(query if rope else None, key, value, cos if rope else None,
                                         sin if rope else None, caches[0], caches[1], slots, scales[0], scales[1],
                                         query_out=q_out, key_out=k_out)
                    ref_q, ref_k = query, key
                    if rope:
                        ref_q, ref_k = apply_rotary_reference(query, cos, sin), apply_rotary_reference(key, cos, sin)
                    write_kv_cache_reference(ref_k, value, caches[2], caches[3], slots, scales[2], scales[3])
                    checks = []
                    if rope:
                        checks.append(compare("rope_cache_write", case + " q", q_out, ref_q, REL_TOL[dtype]))
                        checks.append(compare("rope_cache_write", case + " k", k_out, ref_k, REL_TOL[dtype]))
                    blocks, offsets = slots // block_size, slots % block_size
                    for name, got, want, got_s, want_s in (("k cache", caches[0], caches[2], scales[0], scales[2]),
                                                           ("v cache", caches[1], caches[3], scales[1], scales[3])):
                        got_rows, want_rows = got[blocks, :, offsets].float(), want[blocks, :, offsets].float()
                        if int8 is True:  # e4m3 codes compare as they are (the same fixed scales)
                            got_rows = got_rows * got_s[blocks, :, offsets].float().unsqueeze(-1)
                            want_rows = want_rows * want_s[blocks, :, offsets].float().unsqueeze(-1)
                        result = compare("rope_cache_write", f"{case} {name}", got_rows, want_rows, REL_TOL[dtype])
                        untouched = got.clone()
                        untouched[blocks, :, offsets] = want[blocks, :, offsets]
                        same = torch.equal(untouched.view(torch.uint8), want.view(torch.uint8))
                        if not same:
                            result.ok, result.detail = False, "slots outside slot_mapping were written"
                        checks.append(result)
                    return checks

                results += guarded("rope_cache_write", case, run)
    return results




def check_token_bitmask(device) -> list[CheckResult]:
    """Structured outputs' mask on fp32 logits, in place: bit-equal to the reference on a copy, rows not listed
    untouched. Vocabularies of Qwen2.5 (151936), SmolLM2 (49152) and one whose last mask word is partly padding."""
    from deepinfer.kernels.token_bitmask import apply_token_bitmask_

    results = []
    for num_rows, masked, vocab in ((5, (3, 0), 70), (32, tuple(range(32)), 151936), (64, (1, 7, 30, 63), 49152)):
        case = f"N={num_rows} C={len(masked)} V={vocab}"

        def run(num_rows=num_rows, masked=masked, vocab=vocab, case=case):
            logits = torch.randn(num_rows, vocab, dtype=torch.float32, device=device)
            words = (vocab + 31) // 32
            bitmask = torch.randint(-2**31, 2**31 - 1, (len(masked), words), dtype=torch.int32, device=device)
            bitmask[0] = 0  # a row with nothing allowed but what the grammar ends with is common: all -inf here
            rows = torch.tensor(masked, dtype=torch.int32, device=device)
            expected = logits.clone()
            apply_token_bitmask_reference(expected, rows, bitmask)
            apply_token_bitmask_(logits, rows, bitmask)
            ok = torch.equal(logits, expected)
            return CheckResult("token_bitmask", case, ok, detail=None if ok else
                               f"{int((logits != expected).sum())} logits differ from the reference")

        results += guarded("token_bitmask", case, run)
    return results
