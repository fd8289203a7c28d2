"""The W4A16/W3A16 and W8A16 product kernels against the fp32 product of the dequantized weight, each on its own cases
and with an explicit kernel choice; the dense path (dequantize bit-identical to the reference's); and the fused
epilogues against the unfused kernels they replace (the same bits) and the fp32 reference."""

from __future__ import annotations

import itertools

import torch

from deepinfer.core.ops.activation import act_and_mul_reference
from deepinfer.core.ops.rotary import apply_rotary_reference
from deepinfer.core.quant.packing import dequantize
from deepinfer.validate.compare import DTYPE_NAMES, REL_TOL, CheckResult, compare, guarded, poisoned
from deepinfer.validate.inputs import random_packed, rope_tables, tc_case_weight, w8_case_weight


def reference_product(x: torch.Tensor, packed) -> torch.Tensor:
    """x [M, K] times the reference dequantizer's fp32 weight, plus the bias: the fp32 product every kernel of a
    packed weight is held to."""
    ref = x.float() @ dequantize(packed, torch.float32).T
    return ref if packed.bias is None else ref + packed.bias.float()


def reference_act_and_mul(x: torch.Tensor, packed, inner: int, activation: str) -> torch.Tensor:
    """act(gate) * up [M, inner] of the fp32 reference product of a merged [gate | up] weight (2 inner rows)."""
    full = reference_product(x, packed)
    return act_and_mul_reference(full[:, :inner], full[:, inner:], activation)


def fused_gate_up_checks(op: str, case: str, out: torch.Tensor, product: torch.Tensor, x: torch.Tensor, packed,
                         inner: int, activation: str, dtype: torch.dtype) -> list[CheckResult]:
    """A fused gate/up epilogue's `out` [M, inner] against the same kernel's plain `product` [M, 2 inner] then
    act_and_mul (bit for bit), and against the fp32 reference."""
    from deepinfer.kernels.act_and_mul import act_and_mul

    want = act_and_mul(product[:, :inner], product[:, inner:], activation)
    same = torch.equal(out.view(torch.int16), want.view(torch.int16))
    return [CheckResult(op, f"{case} == unfused", same,
                        detail="" if same else "differs from the product then act_and_mul's bits"),
            compare(op, f"{case} vs fp32", out, reference_act_and_mul(x, packed, inner, activation),
                    2 * REL_TOL[dtype])]


def interleaved_gate_up_check(op: str, case: str, interleaved: torch.Tensor, plain: torch.Tensor, inner: int,
                              activation: str, exact: bool = True) -> CheckResult:
    """A gate/up product over the interleaved layout, `interleaved` [M, 2 inner] (gate and up in 8-column blocks),
    then the interleaved act_and_mul, against the same kernel's product over the plain layout, `plain` [M, 2 inner]
    ([gate | up]), then act_and_mul on its halves: the same bits (exact), or within the fp32 summation's error
    where the kernel's k split of a row depends on the row's tile (the batch kernel's stream-K runs)."""
    from deepinfer.kernels.act_and_mul import act_and_mul, act_and_mul_interleaved

    want = act_and_mul(plain[:, :inner], plain[:, inner:], activation)
    out = act_and_mul_interleaved(interleaved, activation, out=poisoned(want.shape, want.dtype, want.device))
    if not exact:
        return compare(op, f"{case} interleaved ~ plain", out, want, REL_TOL[want.dtype])
    same = torch.equal(out.view(torch.int16), want.view(torch.int16))
    return CheckResult(op, f"{case} interleaved == plain", same,
                       detail="" if same else "the interleaved layout's product and act_and_mul differ from the plain")


# (tokens, out_features, in_features, group size, kernel, tile, splits, fp32 scales, bias)
QUANT_CASES = (
    (1, 4096, 4096, 128, "gemv", 1, None, False, False),
    (1, 4096, 4096, 128, "ksplit", 1, None, False, True),
    (1, 1000, 11008, 128, "gemv", 1, None, True, False),  # N not a multiple of the 8 rows a CTA takes
    (3, 1536, 576, 32, "ksplit", 1, None, False, False),
    (16, 1000, 11008, 128, "ksplit", 2, None, True, False),
    (5, 4096, 14336, 32, "ksplit", 1, None, False, True),
    (9, 1000, 4096, 128, "ksplit", 2, None, False, False),
    (24, 2560, 2048, 128, "ksplit", 2, None, False, True),  # 17-32 tokens: two token tiles (grid.y)
    (32, 1000, 11008, 128, "ksplit", 2, None, True, False),
    (29, 1536, 576, 32, "ksplit", 2, None, False, False),
    (3, 1536, 576, 32, "gemv", 4, None, False, False),
    (2, 1000, 4096, 4096, "gemv", 2, None, False, True),
    (1, 4096, 4096, 128, "stream", 1, None, False, True),
    (3, 1536, 576, 32, "stream", 4, None, False, False),
    (2, 1000, 4096, 4096, "stream", 2, None, True, True),
    (1, 1000, 11008, 128, "stream", 1, None, False, False),
    (64, 4096, 4096, 128, "staged", 8, None, False, True),
    (33, 1000, 11008, 32, "staged", 8, None, False, False),
    (16, 1000, 4096, 128, "staged", 2, None, True, False),
    (5, 1536, 576, 64, "staged", 1, None, False, False),
    (100, 768, 2048, 64, "staged", 8, 3, False, True),
    (64, 768, 8192, 128, "staged", 8, 1, False, False),
    (24, 4096, 14336, 128, "staged", 4, None, False, True),
)


# The tc kernel (W4 only): (tokens, out_features, in_features, group size, tile, zeros, fp32 scales, bias), zeros
# "int" (zero mode, whole zero points: group sums scaled once when G % 128 == 0), "frac" (zero mode, fractional
# zero points) or "min" (GGUF-style offsets): the last two dequantize weights before the product.
TC_CASES = (
    (1, 2560, 2048, 128, 1, "int", False, False),
    (1, 2048, 11008, 128, 1, "int", False, True),
    (1, 22016, 2048, 128, 1, "int", False, False),
    (1, 2048, 2048, 128, 1, "frac", False, False),
    (1, 2048, 2048, 128, 1, "min", True, True),
    (3, 1024, 4096, 32, 1, "int", False, False),  # G = 32: weights dequantized first
    (2, 512, 1024, 64, 1, "min", False, False),
    (1, 512, 1024, 256, 1, "int", True, False),
    (4, 512, 11008, 11008, 1, "int", False, True),  # per-channel
    (1, 16, 128, 128, 1, "int", False, False),  # one tile, one segment
    (8, 2048, 2048, 128, 1, "int", False, False),
    (12, 2560, 2048, 128, 2, "int", False, True),
    (16, 2048, 11008, 128, 2, "min", False, False),
    (24, 2048, 2048, 128, 4, "int", False, False),
    (32, 22016, 2048, 128, 4, "int", False, True),
    (29, 1024, 4096, 32, 4, "frac", True, False),
    (40, 2048, 2048, 128, 4, "int", False, False),  # two token tiles along grid.y
)
# The tcs kernel (tc's pairs, staged activations, split-K): the same fields.
TCS_CASES = (
    (9, 2560, 2048, 128, 2, "int", False, True),
    (16, 22016, 2048, 128, 2, "int", False, False),
    (24, 2048, 11008, 128, 4, "int", False, False),
    (32, 2048, 2048, 128, 4, "int", True, True),
    (32, 992, 4096, 32, 4, "frac", False, False),  # N not a multiple of 128: idle warps
    (20, 512, 1024, 64, 4, "min", False, True),
    (5, 16, 128, 128, 1, "int", False, False),
    (40, 2048, 2048, 128, 4, "int", False, False),  # two token tiles along grid.y
    (12, 512, 11008, 11008, 2, "int", False, False),  # per-channel
    (1, 22016, 2048, 128, 1, "int", False, True),  # up to 8 tokens on few row tiles: two K-splits
    (6, 2560, 2048, 64, 1, "min", True, False),
)
TC_KERNEL_CASES = {"tc": TC_CASES, "tcs": TCS_CASES}


def check_quant_tc(device, dtypes=(torch.float16, torch.bfloat16), kernel: str = "tc",
                   cases=TC_CASES) -> list[CheckResult]:
    """The tc or tcs kernel on its cases against the fp32 reference product, in both activation dtypes."""
    from deepinfer.kernels.quant_matmul import quant_matmul

    results = []
    for m, n, k, g, tile, zeros_kind, f32_scales, with_bias in cases:
        for dtype in dtypes:
            case = (f"{DTYPE_NAMES[dtype]} W4 {zeros_kind}-zeros M={m} N={n} K={k} G={g} {kernel}/{tile}"
                    + (" fp32-scales" if f32_scales else "") + (" bias" if with_bias else ""))

            def run(m=m, n=n, k=k, g=g, tile=tile, zeros_kind=zeros_kind, f32_scales=f32_scales,
                    with_bias=with_bias, dtype=dtype, case=case, kernel=kernel):
                packed = tc_case_weight(n, k, g, zeros_kind, f32_scales, dtype if with_bias else None, device)
                zero_mode = packed.zero_mode
                x = torch.randn(m, k, device=device, dtype=dtype)
                out = poisoned((m, n), dtype, device)
                quant_matmul(x, packed.qweight, packed.scales, packed.zeros, 4, g, zero_mode, packed.bias,
                             kernel=kernel, tile=tile, out=out, integer_zeros=packed.integer_zeros)
                ref = reference_product(x, packed)
                return compare("quant_matmul", case, out, ref, REL_TOL[dtype])

            results += guarded("quant_matmul", case, run)
    return results


def check_quant_matmul(device, dtypes=(torch.float16, torch.bfloat16), cases=QUANT_CASES) -> list[CheckResult]:
    from deepinfer.kernels.quant_matmul import quant_matmul

    results = []
    for index, (m, n, k, g, kernel, tile, splits, f32_scales, with_bias) in enumerate(cases):
        for dtype in dtypes:
            for bits in (4, 3):
                zero_mode = "zero" if (index + bits) % 2 else "min"
                case = (f"{DTYPE_NAMES[dtype]} W{bits} {zero_mode} M={m} N={n} K={k} G={g} {kernel}/{tile}"
                        + (f" splits={splits}" if splits else "") + (" fp32-scales" if f32_scales else "")
                        + (" bias" if with_bias else ""))

                def run(m=m, n=n, k=k, g=g, kernel=kernel, tile=tile, splits=splits, f32_scales=f32_scales,
                        with_bias=with_bias, dtype=dtype, bits=bits, zero_mode=zero_mode, case=case):
                    packed = random_packed(n, k, g, bits, zero_mode, torch.float32 if f32_scales else torch.float16,
                                           device, bias_dtype=dtype if with_bias else None)
                    x = torch.randn(m, k, device=device, dtype=dtype)
                    out = poisoned((m, n), dtype, device)
                    quant_matmul(x, packed.qweight, packed.scales, packed.zeros, bits, g, zero_mode, packed.bias,
                                 kernel=kernel, tile=tile, splits=splits, out=out)
                    ref = reference_product(x, packed)
                    return compare("quant_matmul", case, out, ref, REL_TOL[dtype])

                results += guarded("quant_matmul", case, run)
    for dtype in dtypes:  # act-order permutation and bias through core.ops dispatch
        case = f"{DTYPE_NAMES[dtype]} W4 act-order via core.ops M=5 N=640 K=1024 G=128"

        def run_dispatch(dtype=dtype, case=case):
            from deepinfer.core.ops.quant_matmul import quant_matmul as op_quant_matmul

            packed = random_packed(640, 1024, 128, 4, "zero", torch.float16, device, act_order=True, bias_dtype=dtype)
            x = torch.randn(5, 1024, device=device, dtype=dtype)
            ref = reference_product(x, packed)
            return compare("quant_matmul", case, op_quant_matmul(x, packed), ref, REL_TOL[dtype])

        results += guarded("quant_matmul", case, run_dispatch)
    return results


def check_quant_matmul_all(device, dtypes=(torch.float16, torch.bfloat16)) -> list[CheckResult]:
    """Every quantized-matmul kernel's cases: QUANT_CASES, then the tc and tcs kernels' own."""
    results = check_quant_matmul(device, dtypes)
    for kernel, cases in TC_KERNEL_CASES.items():
        results += check_quant_tc(device, dtypes, kernel, cases)
    return results


# The few-token kernel over the fragment layout (integer zeros, fp16 scales): (tokens, out_features, in_features,
# group size, K splits or None for the plan's, bias). N and K off the tiles, every group size, one group a row.
FRAGMENT_CASES = (
    (1, 2560, 2048, 128, None, False),
    (8, 1000, 2048, 32, None, True),
    (13, 2048, 11008, 128, None, False),
    (16, 200, 1344, 64, 3, True),
    (24, 22016, 2048, 128, None, False),
    (32, 2560, 4160, 4160, 5, True),  # one group a row, K = 16.25 stages
    (29, 40, 160, 32, None, False),   # a partial row tile, K not a multiple of an atom
    (100, 3584, 3584, 256, 2, True),  # 32-token tiles along grid.y
)


# The 33-128-token kernel over the same layout: (tokens, out_features, in_features, group size, persistent CTAs or
# None for the plan's, bias). Odd token counts across its 64-token blocks, G = 128 and one group a row at both
# dtypes' plans, G = 32 / 64, N and K off the tiles, CTA counts that cut tiles into parts (stream-K's fix-up) and
# one CTA for every tile.
FRAGMENT_BATCH_CASES = (
    (33, 2560, 2048, 128, None, False),
    (47, 22016, 2048, 128, None, True),
    (64, 2048, 11008, 128, None, False),
    (65, 1000, 2048, 128, 7, True),    # a partial row block, 7 CTAs: parts of tiles meet in the partials
    (97, 3584, 18944, 128, None, False),
    (127, 2560, 4160, 4160, None, True),  # one group a row, K = 16.25 stages
    (128, 37888, 3584, 128, None, False),
    (45, 200, 1344, 64, 3, True),     # G = 64, K not a multiple of a stage
    (81, 1000, 2048, 32, None, False),  # G = 32
    (113, 40, 160, 32, 1, False),      # a partial row tile, K not a multiple of an atom, one CTA
    (71, 3584, 3584, 256, 131, True),  # G = 256, more CTAs than tiles
)


# The fused gate/up activation over the interleaved layout: (tokens, inner features, in_features, group size,
# activation); each launch shape's token range, K splits from the plan.
# (tokens, inner features, in_features, group size, activation) of the batch kernel over a gate/up weight's layouts
FRAGMENT_BATCH_GATE_UP_CASES = (
    (40, 1024, 2048, 128, "silu"),
    (96, 11008, 2048, 128, "gelu_tanh"),  # Qwen2.5-3B's gate/up
    (128, 1000, 3584, 64, "silu"),
)
FRAGMENT_GATE_UP_CASES = (
    (1, 11008, 2048, 128, "silu"),
    (16, 1000, 2048, 64, "gelu_tanh"),
    (29, 5504, 3584, 128, "silu"),
    (100, 1024, 4096, 32, "silu"),
)


def check_w4_fragment_gemm(device, dtypes=(torch.float16, torch.bfloat16)) -> list[CheckResult]:
    """The fragment kernel on its cases against the fp32 product of the reference dequantizer's weight; on a gate/up
    weight the fused epilogue and the product over the interleaved layout then the interleaved act_and_mul, each
    against the plain layout's product then act_and_mul (the same bits)."""
    from deepinfer.kernels import w4_fragment_gemm as fragment

    results = []
    for m, n, k, g, splits, with_bias in FRAGMENT_CASES:
        for dtype in dtypes:
            case = (f"{DTYPE_NAMES[dtype]} W4 int-zeros M={m} N={n} K={k} G={g}"
                    + (f" splits={splits}" if splits else "") + (" bias" if with_bias else ""))

            def run(m=m, n=n, k=k, g=g, splits=splits, with_bias=with_bias, dtype=dtype, case=case):
                packed = random_packed(n, k, g, 4, "zero", torch.float16, device,
                                       bias_dtype=dtype if with_bias else None)
                weight = fragment.fragment_layout(packed.qweight, packed.scales, packed.zeros, g, n, k, dtype)
                x = torch.randn(m, k, device=device, dtype=dtype)
                out = poisoned((m, n), dtype, device)
                fragment.w4_fragment_gemm(x, weight, packed.bias, splits=splits, out=out)
                ref = reference_product(x, packed)
                return compare("w4_fragment_gemm", case, out, ref, REL_TOL[dtype])

            results += guarded("w4_fragment_gemm", case, run)
    for m, inner, k, g, activation in FRAGMENT_GATE_UP_CASES:
        for dtype in dtypes:
            case = f"{DTYPE_NAMES[dtype]} W4 int-zeros gate/up + {activation} M={m} I={inner} K={k} G={g}"

            def run_fused(m=m, inner=inner, k=k, g=g, activation=activation, dtype=dtype, case=case):
                packed = random_packed(2 * inner, k, g, 4, "zero", torch.float16, device, bias_dtype=dtype)
                plain = fragment.fragment_layout(packed.qweight, packed.scales, packed.zeros, g, 2 * inner, k, dtype)
                fused = fragment.gate_up_layout(packed.qweight, packed.scales, packed.zeros, g, k, dtype)
                x = torch.randn(m, k, device=device, dtype=dtype)
                out = poisoned((m, inner), dtype, device)
                order = fragment.gate_up_order(inner, device)
                fragment.w4_fragment_gemm_act_and_mul(x, fused, activation, packed.bias[order], out=out)
                product = fragment.w4_fragment_gemm(x, plain, packed.bias)
                interleaved = fragment.w4_fragment_gemm(x, fused, packed.bias[order])
                return [*fused_gate_up_checks("w4_fragment_gemm", case, out, product, x, packed, inner, activation,
                                              dtype),
                        interleaved_gate_up_check("w4_fragment_gemm", case, interleaved, product, inner, activation)]

            results += guarded("w4_fragment_gemm", case, run_fused)
    return results


def check_w4_fragment_batch(device, dtypes=(torch.float16, torch.bfloat16)) -> list[CheckResult]:
    """The 33-128-token kernel over the fragment layout on its cases, on both tensor-core paths the GPU has (mma.sync;
    wgmma on SM90), against the fp32 product of the reference dequantizer's weight; over a gate/up weight's
    interleaved layout then the interleaved act_and_mul, against the plain layout then act_and_mul (the same bits on
    CTAs that take whole tiles) and the fp32 reference."""
    from deepinfer.kernels import w4_fragment_batch as batch
    from deepinfer.kernels import w4_fragment_gemm as fragment
    from deepinfer.kernels.act_and_mul import act_and_mul_interleaved
    from deepinfer.kernels.w4_gemm import wgmma_available

    configs = batch.CONFIGS if wgmma_available(device.index or 0) else (batch.CONFIG,)
    results = []
    for config in configs:  # mma.sync first: a fault of the wgmma path ends the checks after it
        for (m, n, k, g, ctas, with_bias), dtype in itertools.product(FRAGMENT_BATCH_CASES, dtypes):
            case = (f"{DTYPE_NAMES[dtype]} W4 int-zeros M={m} N={n} K={k} G={g} {config.label}"
                    + (f" ctas={ctas}" if ctas else "") + (" bias" if with_bias else ""))

            def run(m=m, n=n, k=k, g=g, ctas=ctas, with_bias=with_bias, dtype=dtype, case=case, config=config):
                packed = random_packed(n, k, g, 4, "zero", torch.float16, device,
                                       bias_dtype=dtype if with_bias else None)
                weight = fragment.fragment_layout(packed.qweight, packed.scales, packed.zeros, g, n, k, dtype)
                x = torch.randn(m, k, device=device, dtype=dtype)
                out = poisoned((m, n), dtype, device)
                batch.w4_fragment_batch(x, weight, packed.bias, config=config, ctas=ctas, out=out)
                ref = reference_product(x, packed)
                return compare("w4_fragment_batch", case, out, ref, REL_TOL[dtype])

            results += guarded("w4_fragment_batch", case, run)
    for (m, inner, k, g, activation), dtype in itertools.product(FRAGMENT_BATCH_GATE_UP_CASES, dtypes):
        case = f"{DTYPE_NAMES[dtype]} W4 int-zeros gate/up + {activation} M={m} I={inner} K={k} G={g}"

        def run_gate_up(m=m, inner=inner, k=k, g=g, activation=activation, dtype=dtype, case=case):
            packed = random_packed(2 * inner, k, g, 4, "zero", torch.float16, device, bias_dtype=dtype)
            plain = fragment.fragment_layout(packed.qweight, packed.scales, packed.zeros, g, 2 * inner, k, dtype)
            interleaved = fragment.gate_up_layout(packed.qweight, packed.scales, packed.zeros, g, k, dtype)
            bias = packed.bias[fragment.gate_up_order(inner, device)]
            x = torch.randn(m, k, device=device, dtype=dtype)
            config, _ = batch.plan(m, 2 * inner, k, device.index or 0)
            whole_tiles = batch.iterations(m, 2 * inner, k, config) // -(-k // config.bk)  # a CTA a tile
            checks = []
            for ctas, exact in ((whole_tiles, True), (None, False)):
                product = batch.w4_fragment_batch(x, plain, packed.bias, ctas=ctas)
                checks.append(interleaved_gate_up_check(
                    "w4_fragment_batch", case + (" whole tiles" if exact else " planned"),
                    batch.w4_fragment_batch(x, interleaved, bias, ctas=ctas), product, inner, activation, exact))
            out = act_and_mul_interleaved(batch.w4_fragment_batch(x, interleaved, bias), activation)
            checks.append(compare("w4_fragment_batch", f"{case} interleaved vs fp32", out,
                                  reference_act_and_mul(x, packed, inner, activation), 2 * REL_TOL[dtype]))
            return checks

        results += guarded("w4_fragment_batch", case, run_gate_up)
    return results


# ---- dequantize (the dense path of many-token products) -------------------------------------------

def check_dequantize(device, dtypes=(torch.float16, torch.bfloat16)) -> list[CheckResult]:
    """The kernel's dense weight must equal the reference's bit for bit (same fp32 operations, one
    rounding to the dtype), and core.ops.quant_matmul's dense path must match the reference product."""
    from deepinfer.kernels.dequantize import dequantize as dequantize_kernel

    results = []
    for dtype in dtypes:
        for bits in (4, 3, 8):
            for zero_mode, scale_dtype, group_size in (("zero", torch.float16, 128), ("min", torch.float32, 32),
                                                       ("zero", torch.float16, 2048)):
                case = f"{DTYPE_NAMES[dtype]} W{bits} {zero_mode} N=1000 K=2048 G={group_size} scales {scale_dtype}"

                def run(dtype=dtype, bits=bits, zero_mode=zero_mode, scale_dtype=scale_dtype, group_size=group_size,
                        case=case):
                    packed = random_packed(1000, 2048, group_size, bits, zero_mode, scale_dtype, device)
                    out = poisoned((1000, 2048), dtype, device)
                    dequantize_kernel(packed.qweight, packed.scales, packed.zeros, bits, group_size, zero_mode, dtype,
                                      out=out)
                    ref = dequantize(packed, dtype)
                    result = compare("dequantize", case, out, ref, REL_TOL[dtype])
                    result.ok = bool(torch.equal(out, ref))
                    if not result.ok:
                        result.detail = "not bit-identical to core.quant.packing.dequantize"
                    return result

                results += guarded("dequantize", case, run)
        case = f"{DTYPE_NAMES[dtype]} W4 act-order dense path via core.ops M=100 N=640 K=1024 G=128"

        def run_dense(dtype=dtype, case=case):
            from deepinfer.core.ops.quant_matmul import quant_matmul as op_quant_matmul
            from deepinfer.core.ops.quant_matmul_table import ProductShape, product_row

            packed = random_packed(640, 1024, 128, 4, "zero", torch.float16, device, act_order=True, bias_dtype=dtype)
            assert product_row(ProductShape(100, 1024, 640, 4, 128)).kernel == "dense"
            x = torch.randn(100, 1024, device=device, dtype=dtype)
            ref = reference_product(x, packed)
            return compare("dequantize", case, op_quant_matmul(x, packed), ref, REL_TOL[dtype])

        results += guarded("dequantize", case, run_dense)
    return results



# The merged q/k/v product with RoPE and the cache write in its epilogue: (tokens, q heads, KV heads, head_dim,
# in_features, group size, zeros, bias), zeros as in TC_CASES.
QKV_ROPE_CASES = (
    (1, 16, 2, 128, 2048, 128, "int", True),  # Qwen2.5-3B
    (8, 16, 2, 128, 2048, 128, "int", True),
    (3, 32, 8, 128, 4096, 128, "int", False),  # Llama-3-8B
    (5, 8, 4, 64, 1024, 64, "min", False),
    (2, 12, 4, 256, 2048, 128, "frac", True),
)


def qkv_rope_caches(storage: str, shape: tuple, dtype: torch.dtype, device) -> tuple[list, list]:
    """Four poisoned caches [NB, KVH, BS, D] (fused k, v; unfused k, v) in `storage` and their scales: an int8
    cache's per-token ones poisoned too, an e4m3 cache's per-head ones [KVH] (set by the caller) shared by both
    paths."""
    if storage == "fp8":  # 0x7F: the NaN code the kernels never write
        caches = [torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
                  for _ in range(4)]
        scales = [torch.ones(shape[1], device=device) for _ in range(2)]
        return caches, scales + scales
    if storage == "int8":  # -128: the code the kernels never write
        return ([torch.full(shape, -128, dtype=torch.int8, device=device) for _ in range(4)],
                [poisoned(shape[:3], torch.float16, device) for _ in range(4)])
    return [poisoned(shape, dtype, device) for _ in range(4)], [None] * 4


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))


def check_quant_matmul_rope_cache(device, dtypes=(torch.float16, torch.bfloat16)) -> list[CheckResult]:
    """quant_matmul_rope_cache against the unfused kernels it replaces (tc product, then rope_cache_kernel): the
    rotated q and k, the v columns and the cache rows (codes and scales of an int8 or e4m3 cache) must be the same
    bits, and no other cache row written; and against the fp32 reference product rotated in fp32 within the usual
    tolerance."""
    from deepinfer.core.ops.quant_matmul_table import QKV_ROPE, ProductShape, epilogue_serves
    from deepinfer.kernels.quant_matmul import (
        qkv_rope_unsupported_reason,
        quant_matmul,
        quant_matmul_rope_cache,
    )
    from deepinfer.kernels.rope_cache import rope_and_cache_write

    results = []
    num_blocks, block_size = 24, 16
    for m, heads, kv_heads, head_dim, k, g, zeros_kind, with_bias in QKV_ROPE_CASES:
        for dtype, storage in itertools.product(dtypes, ("same-dtype", "int8", "fp8")):
            case = (f"{DTYPE_NAMES[dtype]} {storage} KV M={m} H={heads}/{kv_heads} D={head_dim} K={k} G={g} "
                    f"{zeros_kind}-zeros" + (" bias" if with_bias else ""))

            def run(m=m, heads=heads, kv_heads=kv_heads, head_dim=head_dim, k=k, g=g, zeros_kind=zeros_kind,
                    with_bias=with_bias, dtype=dtype, storage=storage, case=case):
                n = (heads + 2 * kv_heads) * head_dim
                packed = tc_case_weight(n, k, g, zeros_kind, False, dtype if with_bias else None, device)
                zero_mode = packed.zero_mode
                x = torch.randn(m, k, device=device, dtype=dtype)
                cos, sin = rope_tables(m, head_dim, dtype, device)
                caches, scales = qkv_rope_caches(storage, (num_blocks, kv_heads, block_size, head_dim), dtype,
                                                  device)
                reason = qkv_rope_unsupported_reason(4, g, k, n, heads, kv_heads, head_dim, caches[0].dtype, block_size,
                                                     dtype)
                served = epilogue_serves(QKV_ROPE, ProductShape(m, k, n, 4, g))
                assert reason is None and served, f"not a case the engine sends here: {reason}"
                slots = torch.randperm(num_blocks * block_size, device=device)[:m]
                if m > 2:
                    slots[m // 2] = -1  # a padding row: no cache write
                args = (packed.qweight, packed.scales, packed.zeros)
                qkv = quant_matmul(x, *args, 4, g, zero_mode, packed.bias, kernel="tc", tile=1,
                                   integer_zeros=packed.integer_zeros)
                q_sizes = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
                q_raw, k_raw, v_raw = (part.reshape(m, -1, head_dim) for part in qkv.split(q_sizes, dim=-1))
                if storage == "fp8":  # 0.5-2x a head's amax / 448: some codes saturate, small ones are subnormal
                    for scale, part in zip(scales[:2], (k_raw, v_raw)):
                        amax = part.float().abs().amax(dim=(0, 2))  # [KVH]
                        scale.copy_(amax / 448 * (0.5 + 1.5 * torch.rand(kv_heads, device=device)))
                query, key, value = quant_matmul_rope_cache(
                    x, *args, packed.bias, g, zero_mode, packed.integer_zeros, heads, kv_heads, head_dim, cos, sin,
                    caches[0], caches[1], slots, scales[0], scales[1])
                ref_q, ref_k = rope_and_cache_write(q_raw, k_raw, v_raw, cos, sin, caches[2], caches[3], slots,
                                                    scales[2], scales[3])
                compared = [("q", query, ref_q), ("k", key, ref_k), ("v", value, v_raw),
                            ("k cache", caches[0], caches[2]), ("v cache", caches[1], caches[3])]
                if storage == "int8":
                    compared += [("k scales", scales[0], scales[2]), ("v scales", scales[1], scales[3])]
                checks = []
                for name, got, want in compared:
                    same = same_bits(got, want)
                    checks.append(CheckResult("quant_matmul_rope_cache", f"{case} {name} == unfused", same,
                                              detail="" if same else "differs from the unfused kernels' bits"))
                full = x.float() @ dequantize(packed, torch.float32).T
                if packed.bias is not None:
                    full = full + packed.bias.float()
                fq, fk, _ = (part.reshape(m, -1, head_dim) for part in full.split(q_sizes, dim=-1))
                checks.append(compare("quant_matmul_rope_cache", f"{case} q vs fp32",
                                      query, apply_rotary_reference(fq, cos.float(), sin.float()), REL_TOL[dtype]))
                checks.append(compare("quant_matmul_rope_cache", f"{case} k vs fp32",
                                      key, apply_rotary_reference(fk, cos.float(), sin.float()), REL_TOL[dtype]))
                return checks

            results += guarded("quant_matmul_rope_cache", case, run)
    return results


# The merged gate/up product with the activation in its epilogue: (tokens, inner I, in_features, group size, zeros,
# fp32 scales, bias, activation), zeros as in TC_CASES; the weight is [2I, K].
GATE_UP_ACT_CASES = (
    (1, 11008, 2048, 128, "int", False, False, "silu"),  # Qwen2.5-3B at one token: two K-splits
    (8, 11008, 2048, 128, "int", False, True, "silu"),
    (12, 2048, 512, 128, "int", False, False, "silu"),  # two token tiles a CTA (from 9 tokens larger products
    (16, 2048, 512, 128, "frac", True, False, "gelu_tanh"),  # go to the fragment kernel): the most tokens it serves
    (2, 8192, 2048, 128, "int", False, False, "silu"),  # long wide rows (7B-size MLPs go to the fragment kernel)
    (5, 1504, 512, 64, "min", False, True, "gelu_tanh"),  # I not a multiple of 64: idle warps in the last CTA
    (4, 2048, 512, 512, "int", False, False, "silu"),  # per-channel
)


def check_quant_matmul_act_and_mul(device, dtypes=(torch.float16, torch.bfloat16)) -> list[CheckResult]:
    """quant_matmul_act_and_mul against the unfused kernels it replaces (the tcs product, then act_and_mul_kernel):
    the same bits; and against the fp32 reference product's act(gate) * up within the usual tolerance."""
    from deepinfer.core.ops.quant_matmul_table import GATE_UP_ACT, ProductShape, epilogue_serves
    from deepinfer.kernels.act_and_mul import act_and_mul
    from deepinfer.kernels.quant_matmul import (
        gate_up_act_unsupported_reason,
        quant_matmul,
        quant_matmul_act_and_mul,
    )

    results = []
    for m, inner, k, g, zeros_kind, f32_scales, with_bias, activation in GATE_UP_ACT_CASES:
        for dtype in dtypes:
            case = (f"{DTYPE_NAMES[dtype]} {activation} M={m} I={inner} K={k} G={g} {zeros_kind}-zeros"
                    + (" fp32-scales" if f32_scales else "") + (" bias" if with_bias else ""))

            def run(m=m, inner=inner, k=k, g=g, zeros_kind=zeros_kind, f32_scales=f32_scales, with_bias=with_bias,
                    activation=activation, dtype=dtype, case=case):
                packed = tc_case_weight(2 * inner, k, g, zeros_kind, f32_scales, dtype if with_bias else None,
                                        device)
                zero_mode = packed.zero_mode
                reason = gate_up_act_unsupported_reason(4, g, k, 2 * inner, activation)
                served = epilogue_serves(GATE_UP_ACT, ProductShape(m, k, 2 * inner, 4, g))
                assert reason is None and served, f"not a case the engine sends here: {reason}"
                x = torch.randn(m, k, device=device, dtype=dtype)
                args = (packed.qweight, packed.scales, packed.zeros)
                out = quant_matmul_act_and_mul(x, *args, packed.bias, g, zero_mode, packed.integer_zeros, activation)
                gate_up = quant_matmul(x, *args, 4, g, zero_mode, packed.bias, kernel="tcs",
                                       integer_zeros=packed.integer_zeros)
                want = act_and_mul(gate_up[:, :inner], gate_up[:, inner:], activation)
                # the default (K splits in a cluster where the device has them) and splits through global memory
                global_splits = quant_matmul_act_and_mul(x, *args, packed.bias, g, zero_mode, packed.integer_zeros,
                                                         activation, cluster_splits=False)
                checks = []
                for name, got in (("", out), (" global split-K", global_splits)):
                    same = torch.equal(got.view(torch.int16), want.view(torch.int16))
                    checks.append(CheckResult("quant_matmul_act_and_mul", f"{case}{name} == unfused", same,
                                              detail="" if same else "differs from the unfused kernels' bits"))
                ref = reference_act_and_mul(x, packed, inner, activation)
                checks.append(compare("quant_matmul_act_and_mul", f"{case} vs fp32", out, ref, 2 * REL_TOL[dtype]))
                return checks

            results += guarded("quant_matmul_act_and_mul", case, run)
    return results



# The W8 product (kernels/w8_gemm.py): (tokens, out_features, in_features, group size, zeros, fp32 scales, bias, launch
# overrides (tiles, row_warps, splits) or None for the planned launch), zeros "q8_0" (GGUF Q8_0 as re-packed: zero point
# 128, fp16 scales, G = 32), "int" (round-to-nearest asymmetric: whole zero points), "frac" (zero points that are not
# whole numbers) or "min". One token to 64, more through grid.y, N off the CTAs' row tiles, K off the 64-code segments
# (K = 576, SmolLM2's hidden size); each row-tile count, K splits over a cluster (SM90+) up to 8, a split of fewer
# segments than the others.
W8_CASES = (
    (1, 2048, 2048, 32, "q8_0", False, False, None),
    (1, 11008, 2048, 128, "int", False, True, None),
    (1, 2048, 11008, 128, "int", False, True, (None, 1, 8)),
    (3, 1000, 4096, 32, "q8_0", False, False, None),
    (8, 2048, 11008, 128, "int", True, False, None),
    (9, 2560, 2048, 32, "q8_0", False, True, None),
    (16, 1536, 576, 64, "frac", False, False, None),
    (24, 22016, 2048, 32, "q8_0", False, False, None),
    (32, 2048, 2048, 128, "min", True, True, None),
    (48, 1000, 2048, 2048, "int", False, False, None),  # one group a row
    (64, 4096, 4096, 32, "q8_0", False, True, None),
    (64, 2048, 2048, 32, "q8_0", False, False, (None, 8, 8)),
    (33, 1000, 576, 64, "frac", False, True, (None, 2, 3)),  # 9 segments in splits of 4, 4 and 1
    (7, 2560, 2048, 128, "min", True, False, (None, 4, 1)),
    (100, 2048, 2048, 32, "q8_0", False, False, None),  # two CTA columns of 64 tokens
    (5, 40, 160, 32, "min", False, False, (8, None, None)),  # a partial row tile, K = 2.5 segments, a wide tile
    (5, 40, 160, 32, "min", False, False, (8, 8, 2)),
)

# Its wgmma path (SM90): (tokens, out_features, in_features, group size, zeros, fp32 scales, bias, (tokens a CTA,
# splits) or None for the planned launch). Every token block (16, 32, 48, 64) full and partly filled, two and three
# blocks of 64 along grid.y, N off the 128-row CTAs, K off the 64-k stages (576; 160 = 2.5 stages), splits of 1 to 8
# with a last split of fewer stages, one group a row, every zero kind and fp32 scales.
W8_WGMMA_CASES = (
    (16, 2048, 2048, 32, "q8_0", False, False, (16, None)),
    (17, 2560, 2048, 32, "q8_0", False, True, None),
    (32, 22016, 2048, 32, "q8_0", False, False, None),
    (40, 2048, 11008, 128, "int", False, True, None),
    (48, 1000, 4096, 32, "q8_0", True, False, None),
    (64, 2048, 2048, 32, "q8_0", False, True, None),
    (64, 3584, 18944, 128, "int", False, False, None),
    (55, 1536, 576, 64, "frac", False, True, None),
    (33, 2048, 2048, 128, "min", True, True, (64, 3)),  # 32 stages in splits of 11, 11 and 10
    (24, 1000, 2048, 2048, "int", False, False, (32, 8)),  # one group a row
    (100, 2048, 2048, 32, "q8_0", False, False, None),
    (150, 640, 1024, 32, "min", False, True, (64, 2)),
    (21, 40, 160, 32, "min", False, False, None),  # a partial warpgroup, K = 2.5 stages
    (9, 40, 160, 32, "frac", False, True, (16, 2)),
)


def check_w8_gemm(device, dtypes=(torch.float16, torch.bfloat16)) -> list[CheckResult]:
    """The W8 kernel (w8_gemm_kernel, and on SM90 w8_wgmma_kernel) on its cases against the fp32 product of the
    reference dequantizer's weight, and through core.ops' dispatch (an act-order permutation on the activation
    side)."""
    from deepinfer.kernels import w8_gemm as w8
    from deepinfer.kernels.w4_gemm import wgmma_available

    results = []
    for m, n, k, g, zeros_kind, f32_scales, with_bias, overrides in W8_CASES:
        tiles, row_warps, splits = overrides or (None, None, None)
        for dtype in dtypes:
            launch = w8.plan(m, k, n, device.index, tiles, row_warps, splits)
            case = (f"{DTYPE_NAMES[dtype]} W8 {zeros_kind}-zeros M={m} N={n} K={k} G={g} "
                    f"tiles={launch.tiles} row_warps={launch.row_warps} splits={launch.splits}"
                    + (" fp32-scales" if f32_scales else "") + (" bias" if with_bias else ""))

            def run(m=m, n=n, k=k, g=g, zeros_kind=zeros_kind, f32_scales=f32_scales, with_bias=with_bias,
                    tiles=tiles, row_warps=row_warps, splits=splits, dtype=dtype, case=case):
                packed = w8_case_weight(n, k, g, zeros_kind, f32_scales, dtype if with_bias else None, device)
                x = torch.randn(m, k, device=device, dtype=dtype)
                out = poisoned((m, n), dtype, device)
                w8.w8_gemm(x, packed.qweight, packed.scales, packed.zeros, g, packed.zero_mode, packed.integer_zeros,
                           packed.bias, tiles=tiles, row_warps=row_warps, splits=splits, out=out, wgmma=False)
                checks = [compare("w8_gemm", case, out, reference_product(x, packed), REL_TOL[dtype])]
                # the split sums meet in a fixed order: a second launch gives the same bits
                again = w8.w8_gemm(x, packed.qweight, packed.scales, packed.zeros, g, packed.zero_mode,
                                   packed.integer_zeros, packed.bias, tiles=tiles, row_warps=row_warps, splits=splits,
                                   wgmma=False)
                same = torch.equal(again.view(torch.int16), out.view(torch.int16))
                checks.append(CheckResult("w8_gemm", f"{case} deterministic", same,
                                          detail="" if same else "a second launch gave other bits"))
                return checks

            results += guarded("w8_gemm", case, run)
    if wgmma_available(device.index or 0):
        results += _check_w8_wgmma(device, dtypes)
    for dtype in dtypes:
        for m in (7, 40):  # w8_gemm_kernel; w8_wgmma_kernel on SM90 (the dense row elsewhere)
            case = f"{DTYPE_NAMES[dtype]} W8 act-order via core.ops M={m} N=640 K=1024 G=32"

            def run_dispatch(dtype=dtype, case=case, m=m):
                from deepinfer.core.ops.quant_matmul import quant_matmul as op_quant_matmul
                from deepinfer.core.ops.quant_matmul_table import ProductShape, product_row

                packed = random_packed(640, 1024, 32, 8, "zero", torch.float16, device, act_order=True,
                                       bias_dtype=dtype)
                assert product_row(ProductShape(m, 1024, 640, 8, 32)).kernel == "w8_gemm"
                x = torch.randn(m, 1024, device=device, dtype=dtype)
                return compare("w8_gemm", case, op_quant_matmul(x, packed), reference_product(x, packed),
                               REL_TOL[dtype])

            results += guarded("w8_gemm", case, run_dispatch)
    return results


def _check_w8_wgmma(device, dtypes) -> list[CheckResult]:
    """The wgmma path on its cases: the same reference and tolerance as w8_gemm_kernel (the A operand is the
    reference's dequantized weight bit for bit, the sums fp32), and the same bits on a second launch."""
    from deepinfer.kernels import w8_gemm as w8

    results = []
    for m, n, k, g, zeros_kind, f32_scales, with_bias, overrides in W8_WGMMA_CASES:
        tokens, splits = overrides or (None, None)
        for dtype in dtypes:
            launch = w8.wgmma_plan(m, k, n, device.index, tokens, splits)
            case = (f"{DTYPE_NAMES[dtype]} W8 wgmma {zeros_kind}-zeros M={m} N={n} K={k} G={g} "
                    f"tokens={launch.tokens} splits={launch.splits}"
                    + (" fp32-scales" if f32_scales else "") + (" bias" if with_bias else ""))

            def run(m=m, n=n, k=k, g=g, zeros_kind=zeros_kind, f32_scales=f32_scales, with_bias=with_bias,
                    tokens=tokens, splits=splits, dtype=dtype, case=case):
                packed = w8_case_weight(n, k, g, zeros_kind, f32_scales, dtype if with_bias else None, device)
                x = torch.randn(m, k, device=device, dtype=dtype)
                out = poisoned((m, n), dtype, device)
                w8.w8_gemm(x, packed.qweight, packed.scales, packed.zeros, g, packed.zero_mode, packed.integer_zeros,
                           packed.bias, splits=splits, out=out, wgmma=True, tokens=tokens)
                checks = [compare("w8_gemm", case, out, reference_product(x, packed), REL_TOL[dtype])]
                again = w8.w8_gemm(x, packed.qweight, packed.scales, packed.zeros, g, packed.zero_mode,
                                   packed.integer_zeros, packed.bias, splits=splits, wgmma=True, tokens=tokens)
                same = torch.equal(again.view(torch.int16), out.view(torch.int16))
                checks.append(CheckResult("w8_gemm", f"{case} deterministic", same,
                                          detail="" if same else "a second launch gave other bits"))
                return checks

            results += guarded("w8_gemm", case, run)
    return results
