"""Each CUDA kernel against its torch reference, on fresh random inputs at several shapes.

Every check poisons the kernel's output with NaN (int8 caches with -128, a code the kernel never
writes) before the launch, so an element the kernel fails to write fails the check. Metrics are
computed in float64: relative error ||out - ref|| / ||ref||, cosine similarity, max abs error.
Used by `deepinfer validate-kernels` and by tests/test_kernels_gpu.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

from deepinfer.core.ops.activation import act_and_mul_reference
from deepinfer.core.ops.norm import rms_norm_reference
from deepinfer.core.ops.paged_attention import paged_decode_attention_reference
from deepinfer.core.ops.rotary import apply_rotary_reference, write_kv_cache_reference
from deepinfer.core.quant.packing import dequantize, pack_weight

# relative-error bounds per activation dtype; cosine must be >= 1 - rel_tol**2
REL_TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass
class CheckResult:
    op: str
    case: str
    ok: bool
    rel_err: float | None = None
    cosine: float | None = None
    max_abs: float | None = None
    rel_tol: float | None = None
    detail: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def compare(op: str, case: str, out: torch.Tensor, ref: torch.Tensor, rel_tol: float) -> CheckResult:
    out64, ref64 = out.detach().double(), ref.detach().double()
    bad = int((~torch.isfinite(out64)).sum())
    if bad:
        return CheckResult(op, case, False, rel_tol=rel_tol, detail=f"{bad} non-finite outputs (unwritten?)")
    diff = out64 - ref64
    ref_norm = float(ref64.norm())
    rel = float(diff.norm()) / max(ref_norm, 1e-30)
    cosine = float((out64 * ref64).sum()) / max(float(out64.norm()) * ref_norm, 1e-30)
    max_abs = float(diff.abs().max()) if diff.numel() else 0.0
    ok = rel <= rel_tol and cosine >= 1.0 - rel_tol**2
    return CheckResult(op, case, ok, rel, cosine, max_abs, rel_tol)


def guarded(op: str, case: str, fn: Callable[[], CheckResult | list[CheckResult]]) -> list[CheckResult]:
    """Run one check; an exception becomes a failed result instead of ending the run."""
    try:
        result = fn()
    except Exception as err:  # noqa: BLE001 - every failure is reported, the run goes on
        return [CheckResult(op, case, False, detail=f"{type(err).__name__}: {err}")]
    return result if isinstance(result, list) else [result]


def _nan(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


# ---- quantized matmul ----------------------------------------------------------------------------

def random_packed(out_features: int, in_features: int, group_size: int, bits: int, zero_mode: str,
                  scale_dtype: torch.dtype, device, act_order: bool = False, bias_dtype: torch.dtype | None = None):
    """A PackedWeight with uniform random codes, positive scales, integer ("zero") or float ("min") zeros."""
    groups = in_features // group_size
    codes = torch.randint(0, 2**bits, (out_features, in_features), device=device)
    scales = (torch.rand(out_features, groups, device=device) * 0.02 + 0.005).to(scale_dtype)
    if zero_mode == "zero":
        zeros = torch.randint(0, 2**bits, (out_features, groups), device=device).to(scale_dtype)
    else:
        zeros = (-(2 ** (bits - 1)) * scales.float() * (0.5 + torch.rand_like(scales.float()))).to(scale_dtype)
    perm = torch.randperm(in_features, device=device) if act_order else None
    bias = torch.randn(out_features, device=device).to(bias_dtype) if bias_dtype is not None else None
    return pack_weight(codes, scales, zeros, bits, zero_mode, input_perm=perm, bias=bias)


# (tokens, out_features, in_features, group size, kernel, tile, splits, fp32 scales, bias)
QUANT_CASES = (
    (1, 4096, 4096, 128, "gemv", 1, None, False, False),
    (1, 4096, 4096, 128, "mma", 1, None, False, True),
    (1, 4096, 4096, 128, "ksplit", 1, None, False, True),
    (3, 1536, 576, 32, "ksplit", 1, None, False, False),
    (16, 1000, 11008, 128, "ksplit", 2, None, True, False),
    (5, 4096, 14336, 32, "ksplit", 1, None, False, True),
    (9, 1000, 4096, 128, "ksplit", 2, None, False, False),
    (24, 2560, 2048, 128, "ksplit", 2, None, False, True),  # 17-32 tokens: two token tiles (grid.y)
    (32, 1000, 11008, 128, "ksplit", 2, None, True, False),
    (29, 1536, 576, 32, "ksplit", 2, None, False, False),
    (3, 1536, 576, 32, "gemv", 4, None, False, False),
    (3, 1536, 576, 64, "mma", 1, None, True, False),
    (2, 1000, 4096, 4096, "gemv", 2, None, False, True),
    (16, 1000, 11008, 128, "mma", 2, None, False, False),
    (64, 768, 2048, 64, "mma", 8, 1, False, True),
    (300, 512, 1024, 128, "mma", 8, None, False, False),
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
    # split GEMV: splits = K-parts per row pair (None: its plan's); N not a multiple of its 16..2 rows per CTA
    (1, 4096, 4096, 128, "split", 1, None, False, True),
    (1, 2560, 2048, 64, "split", 1, None, False, False),
    (2, 22016, 4096, 128, "split", 2, None, False, True),
    (1, 1000, 11008, 128, "split", 1, None, True, False),
    (4, 1000, 11008, 32, "split", 4, 8, False, True),
    (3, 1536, 576, 32, "split", 4, None, False, False),
    (3, 1001, 576, 64, "split", 1, 8, True, True),  # more K-parts than chunks: idle warps
    (2, 2560, 576, 64, "split", 2, 2, False, False),
    (1, 999, 11008, 64, "split", 1, 2, False, True),
    (3, 37, 4096, 128, "split", 2, 4, True, False),
    (2, 1000, 4096, 4096, "split", 2, 1, False, True),
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


def tc_case_weight(out_features: int, in_features: int, group_size: int, zeros_kind: str, f32_scales: bool,
                   bias_dtype: torch.dtype | None, device):
    """A random W4 PackedWeight with the zero points a tc case names ("int", "frac" or "min"; see TC_CASES)."""
    zero_mode = "min" if zeros_kind == "min" else "zero"
    packed = random_packed(out_features, in_features, group_size, 4, zero_mode,
                           torch.float32 if f32_scales else torch.float16, device, bias_dtype=bias_dtype)
    if zeros_kind == "frac":
        packed = replace(packed, zeros=(packed.zeros.float() + 0.37).to(packed.zeros.dtype))
    assert packed.integer_zeros == (zeros_kind == "int"), "the case's zero points are not what it says"
    return packed


def check_quant_tc(device, dtypes=(torch.float16, torch.bfloat16), kernel: str = "tc",
                   cases=TC_CASES) -> list[CheckResult]:
    """The tc or tcs kernel on its cases against the fp32 reference product, in both activation dtypes."""
    from deepinfer.kernels.quant_matmul import quant_matmul

    results = []
    for m, n, k, g, tile, zeros_kind, f32_scales, with_bias in cases:
        for dtype in dtypes:
            case = (f"{_DTYPE_NAMES[dtype]} W4 {zeros_kind}-zeros M={m} N={n} K={k} G={g} {kernel}/{tile}"
                    + (" fp32-scales" if f32_scales else "") + (" bias" if with_bias else ""))

            def run(m=m, n=n, k=k, g=g, tile=tile, zeros_kind=zeros_kind, f32_scales=f32_scales,
                    with_bias=with_bias, dtype=dtype, case=case, kernel=kernel):
                packed = tc_case_weight(n, k, g, zeros_kind, f32_scales, dtype if with_bias else None, device)
                zero_mode = packed.zero_mode
                x = torch.randn(m, k, device=device, dtype=dtype)
                out = _nan((m, n), dtype, device)
                quant_matmul(x, packed.qweight, packed.scales, packed.zeros, 4, g, zero_mode, packed.bias,
                             kernel=kernel, tile=tile, out=out, integer_zeros=packed.integer_zeros)
                ref = x.float() @ dequantize(packed, torch.float32).T
                if packed.bias is not None:
                    ref = ref + packed.bias.float()
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
                case = (f"{_DTYPE_NAMES[dtype]} W{bits} {zero_mode} M={m} N={n} K={k} G={g} {kernel}/{tile}"
                        + (f" splits={splits}" if splits else "") + (" fp32-scales" if f32_scales else "")
                        + (" bias" if with_bias else ""))

                def run(m=m, n=n, k=k, g=g, kernel=kernel, tile=tile, splits=splits, f32_scales=f32_scales,
                        with_bias=with_bias, dtype=dtype, bits=bits, zero_mode=zero_mode, case=case):
                    packed = random_packed(n, k, g, bits, zero_mode, torch.float32 if f32_scales else torch.float16,
                                           device, bias_dtype=dtype if with_bias else None)
                    x = torch.randn(m, k, device=device, dtype=dtype)
                    out = _nan((m, n), dtype, device)
                    quant_matmul(x, packed.qweight, packed.scales, packed.zeros, bits, g, zero_mode, packed.bias,
                                 kernel=kernel, tile=tile, splits=splits, out=out)
                    ref = x.float() @ dequantize(packed, torch.float32).T
                    if packed.bias is not None:
                        ref = ref + packed.bias.float()
                    return compare("quant_matmul", case, out, ref, REL_TOL[dtype])

                results += guarded("quant_matmul", case, run)
    for dtype in dtypes:  # act-order permutation and bias through core.ops dispatch
        case = f"{_DTYPE_NAMES[dtype]} W4 act-order via core.ops M=5 N=640 K=1024 G=128"

        def run_dispatch(dtype=dtype, case=case):
            from deepinfer.core.ops.quant_matmul import quant_matmul as op_quant_matmul

            packed = random_packed(640, 1024, 128, 4, "zero", torch.float16, device, act_order=True, bias_dtype=dtype)
            x = torch.randn(5, 1024, device=device, dtype=dtype)
            ref = x.float() @ dequantize(packed, torch.float32).T + packed.bias.float()
            return compare("quant_matmul", case, op_quant_matmul(x, packed), ref, REL_TOL[dtype])

        results += guarded("quant_matmul", case, run_dispatch)
    return results


def check_quant_matmul_all(device, dtypes=(torch.float16, torch.bfloat16)) -> list[CheckResult]:
    """Every quantized-matmul kernel's cases: QUANT_CASES, then the tc and tcs kernels' own."""
    results = check_quant_matmul(device, dtypes)
    for kernel, cases in TC_KERNEL_CASES.items():
        results += check_quant_tc(device, dtypes, kernel, cases)
    return results


# ---- dequantize (the dense path of many-token products) -------------------------------------------

def check_dequantize(device, dtypes=(torch.float16, torch.bfloat16)) -> list[CheckResult]:
    """The kernel's dense weight must equal the reference's bit for bit (same fp32 operations, one
    rounding to the dtype), and core.ops.quant_matmul's dense path must match the reference product."""
    from deepinfer.kernels.dequantize import dequantize as dequantize_kernel

    results = []
    for dtype in dtypes:
        for bits in (4, 3):
            for zero_mode, scale_dtype, group_size in (("zero", torch.float16, 128), ("min", torch.float32, 32),
                                                       ("zero", torch.float16, 2048)):
                case = f"{_DTYPE_NAMES[dtype]} W{bits} {zero_mode} N=1000 K=2048 G={group_size} scales {scale_dtype}"

                def run(dtype=dtype, bits=bits, zero_mode=zero_mode, scale_dtype=scale_dtype, group_size=group_size,
                        case=case):
                    packed = random_packed(1000, 2048, group_size, bits, zero_mode, scale_dtype, device)
                    out = _nan((1000, 2048), dtype, device)
                    dequantize_kernel(packed.qweight, packed.scales, packed.zeros, bits, group_size, zero_mode, dtype,
                                      out=out)
                    ref = dequantize(packed, dtype)
                    result = compare("dequantize", case, out, ref, REL_TOL[dtype])
                    result.ok = bool(torch.equal(out, ref))
                    if not result.ok:
                        result.detail = "not bit-identical to core.quant.packing.dequantize"
                    return result

                results += guarded("dequantize", case, run)
        case = f"{_DTYPE_NAMES[dtype]} W4 act-order dense path via core.ops M=100 N=640 K=1024 G=128"

        def run_dense(dtype=dtype, case=case):
            from deepinfer.core.ops.quant_matmul import quant_matmul as op_quant_matmul
            from deepinfer.core.ops.quant_matmul import uses_dense

            packed = random_packed(640, 1024, 128, 4, "zero", torch.float16, device, act_order=True, bias_dtype=dtype)
            assert uses_dense(100, 1024, 640)
            x = torch.randn(100, 1024, device=device, dtype=dtype)
            ref = x.float() @ dequantize(packed, torch.float32).T + packed.bias.float()
            return compare("dequantize", case, op_quant_matmul(x, packed), ref, REL_TOL[dtype])

        results += guarded("dequantize", case, run_dense)
    return results


# ---- paged decode attention -----------------------------------------------------------------------

# (dtype, int8 KV, heads, kv heads, head_dim, block size, context lengths, window, softcap, tokens/split, bound).
# bound: the max_seq_len passed (None: the longest context); a bound past every context is the CUDA-graph case,
# whose block tables are as wide as the bound. Bounds up to COMBINED_MAX_SEQ_LEN (1024) without tokens/split run on
# the combined path (one CTA of 8 warps a sequence) and the clustered path (a cluster of such CTAs), forced whatever
# the batch's CTA count (by default the combined path needs 64, the clustered one fewer), the rest on the split
# path (one-warp CTAs, then the reduce).
ATTENTION_CASES = (
    # split path: bounds past 1024, or an explicit tokens/split
    (torch.float16, False, 32, 8, 128, 16, (1, 17, 300, 5000), None, None, None, None),
    (torch.bfloat16, False, 32, 8, 128, 16, (1, 17, 300, 5000), 256, 50.0, None, None),
    (torch.float16, True, 9, 3, 64, 16, (5, 700, 2049), None, None, None, None),
    (torch.bfloat16, True, 16, 2, 256, 32, (3, 129, 1500), 100, 50.0, None, None),
    (torch.bfloat16, False, 16, 2, 128, 16, (1, 300, 2048), None, None, None, None),
    (torch.float16, False, 32, 8, 128, 16, (1, 17, 300, 2000), None, None, 1 << 20, None),  # one split
    (torch.float16, False, 16, 2, 128, 16, (1, 17, 300), None, None, 32, 1024),  # short contexts, reduce
    # combined path: contexts 1 and 15-17 leave most warps idle, 1024 gives each warp 8 tiles
    (torch.float16, False, 16, 2, 128, 16, (1, 15, 16, 17, 300, 1024), None, None, None, None),  # GQA 8
    (torch.bfloat16, False, 16, 2, 128, 16, (300, 1, 77), None, None, None, 1024),
    (torch.bfloat16, True, 16, 2, 128, 16, (1, 15, 16, 17, 300, 1024), None, None, None, None),
    (torch.float16, False, 8, 8, 64, 8, (1, 15, 16, 17, 300), None, None, None, 1024),  # GQA 1
    (torch.float16, True, 9, 3, 64, 128, (5, 700, 1000), 256, None, None, None),  # window from mid-tile
    (torch.bfloat16, True, 16, 2, 256, 32, (3, 129, 1000), 100, 50.0, None, 1024),
    (torch.float16, False, 8, 2, 256, 16, (1, 17, 300), None, 30.0, None, None),
    (torch.float16, False, 40, 2, 128, 8, (33, 1000), None, None, None, None),  # GQA 20: a partial head tile
    (torch.bfloat16, False, 32, 1, 128, 64, (1, 300, 999), 64, None, None, 1024),  # GQA 32: two head tiles
    (torch.bfloat16, False, 4, 4, 96, 64, (65, 129), None, None, None, None),
    (torch.float16, False, 16, 2, 128, 16, tuple(range(1, 1025, 33)), None, None, None, 1024),  # 32 sequences
)


def random_paged_kv(seq_lens, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                    int8: bool, device, spare_blocks: int = 7, table_blocks: int = 0):
    """Caches with random contents and block tables that scatter each sequence over shuffled blocks.
    table_blocks: the least width of the tables (a CUDA graph's are as wide as its bound)."""
    needed = [-(-length // block_size) for length in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    order = torch.randperm(num_blocks).tolist()
    max_blocks = max(max(needed) + 2, table_blocks)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    start = 0
    for row, count in enumerate(needed):
        tables[row, :count] = torch.tensor(order[start:start + count], dtype=torch.int32)
        start += count
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    if int8:
        caches = [torch.randint(-127, 128, shape, dtype=torch.int8, device=device) for _ in range(2)]
        scales = [(torch.rand(shape[:3], device=device) * 0.015 + 0.005).half() for _ in range(2)]
    else:
        caches = [torch.randn(shape, dtype=dtype, device=device) for _ in range(2)]
        scales = [None, None]
    return caches[0], caches[1], scales[0], scales[1], tables.to(device)


def check_paged_attention(device, cases=ATTENTION_CASES) -> list[CheckResult]:
    """Each case on its paths, forced: the split path, or (bounds up to 1024 without tokens/split) the combined
    path and, on SM90+, the clustered path."""
    from deepinfer.kernels.launch import clusters_available
    from deepinfer.kernels.paged_attention import combined_path, paged_decode_attention

    one_split_paths = ("combined", "clustered") if clusters_available(device.index) else ("combined",)
    results = []
    for dtype, int8, heads, kv_heads, head_dim, block_size, lengths, window, softcap, per_split, bound in cases:
        bound = bound or max(lengths)
        paths = one_split_paths if combined_path(bound, per_split) else ("split",)
        for path, pipelined in ((p, pipe) for p in paths for pipe in ((True, False) if head_dim <= 128 else (True,))):
            context = (f"ctx={list(lengths)}" if len(lengths) <= 8
                       else f"{len(lengths)} ctx {min(lengths)}..{max(lengths)}")
            case = (f"{path} {_DTYPE_NAMES[dtype]} {'int8' if int8 else 'same-dtype'} KV H={heads}/{kv_heads} "
                    f"D={head_dim} bs={block_size} {context} bound={bound}" + (f" window={window}" if window else "")
                    + (f" softcap={softcap}" if softcap else "") + (f" tokens/split={per_split}" if per_split else "")
                    + ("" if pipelined else " in-step loads"))

            def run(dtype=dtype, int8=int8, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                    block_size=block_size, lengths=lengths, window=window, softcap=softcap, per_split=per_split,
                    bound=bound, pipelined=pipelined, case=case, path=path):
                k_cache, v_cache, k_scales, v_scales, tables = random_paged_kv(
                    lengths, kv_heads, head_dim, block_size, dtype, int8, device,
                    table_blocks=-(-bound // block_size))
                seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
                query = torch.randn(len(lengths), heads, head_dim, dtype=dtype, device=device)
                scale = head_dim**-0.5
                out = _nan(query.shape, dtype, device)
                paged_decode_attention(query, k_cache, v_cache, tables, seq_lens, bound, scale, window,
                                       softcap, k_scales, v_scales, out=out, tokens_per_split=per_split,
                                       pipelined=pipelined, combined=path == "combined",
                                       clustered=path == "clustered")
                ref = paged_decode_attention_reference(query.float(), k_cache, v_cache, tables, seq_lens, scale,
                                                       window, softcap, k_scales, v_scales, max(lengths))
                return compare("paged_decode_attention", case, out, ref, REL_TOL[dtype])

            results += guarded("paged_decode_attention", case, run)
    return results


# Prefill tiles: (dtype, heads, kv heads, head_dim, block_size, chunks (start, tokens) one per sequence, window,
# softcap). Each chunk's tokens go into tiles of prefill_tile_tokens; a decode-like row before them and unused
# (count 0) tiles after them must stay untouched.
PREFILL_CASES = (
    (torch.bfloat16, 16, 2, 128, 16, ((0, 256), (0, 37), (100, 300)), None, None),  # Qwen2.5-3B: G = 8
    (torch.float16, 28, 4, 128, 16, ((0, 100), (1000, 64)), None, None),  # Qwen2.5-7B: G = 7, 14 rows a warp
    (torch.float16, 9, 3, 64, 16, ((0, 90), (5, 3)), None, None),  # SmolLM2: G = 3, D = 64
    (torch.bfloat16, 32, 32, 128, 32, ((0, 200), (7, 1)), None, None),  # MHA: 128 tokens a tile; a one-token tile
    (torch.bfloat16, 32, 8, 128, 16, ((0, 130), (17, 40)), 64, None),  # a window inside the tile's contexts
    (torch.float16, 8, 4, 64, 8, ((0, 50), (3, 20)), 32, 50.0),  # Gemma 2: window, softcap, 8-token blocks
    (torch.bfloat16, 16, 1, 64, 64, ((0, 77),), None, None),  # G = 16: one token a warp
    (torch.float16, 16, 2, 128, 16, ((2000, 2048),), None, None),  # a 2048-token chunk after 2000 cached tokens
    # few tiles over long contexts: key splits and their reduce
    (torch.bfloat16, 16, 2, 128, 16, ((3000, 16), (40, 3)), None, None),
    (torch.float16, 32, 8, 128, 16, ((1500, 40),), 700, None),  # splits before the window are empty
    (torch.float16, 8, 4, 64, 8, ((1000, 20),), 32, 50.0),
    (torch.bfloat16, 9, 3, 64, 32, ((5000, 30),), None, None),
)


def check_paged_prefill_attention(device, cases=PREFILL_CASES) -> list[CheckResult]:
    from deepinfer.core.ops.paged_attention import paged_prefill_attention_reference
    from deepinfer.kernels.paged_attention import paged_prefill_attention, prefill_tile_tokens

    results = []
    for dtype, heads, kv_heads, head_dim, block_size, chunks, window, softcap in cases:
        case = (f"{_DTYPE_NAMES[dtype]} H={heads}/{kv_heads} D={head_dim} bs={block_size} chunks(start, n)="
                f"{list(chunks)}" + (f" window={window}" if window else "") + (f" softcap={softcap}" if softcap else ""))

        def run(dtype=dtype, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                chunks=chunks, window=window, softcap=softcap, case=case):
            lengths = [start + n for start, n in chunks]
            k_cache, v_cache, _, _, tables = random_paged_kv(lengths, kv_heads, head_dim, block_size, dtype, False,
                                                             device)
            tile_tokens = prefill_tile_tokens(heads, kv_heads)
            # row 0: a decode of sequence 0 that no tile covers; then each chunk's tokens
            rows_seq, rows_len, tiles = [0], [lengths[0]], []
            for seq, (start, n) in enumerate(chunks):
                first = len(rows_seq)
                rows_seq += [seq] * n
                rows_len += list(range(start + 1, start + n + 1))
                tiles += [(first + k, min(tile_tokens, n - k)) for k in range(0, n, tile_tokens)]
            tiles += [(0, 0)] * 3
            token_tables = tables[torch.tensor(rows_seq, device=device)]
            seq_lens = torch.tensor(rows_len, dtype=torch.int32, device=device)
            tile_table = torch.tensor(tiles, dtype=torch.int32, device=device)
            query = torch.randn(len(rows_seq), heads, head_dim, dtype=dtype, device=device)
            out = _nan(query.shape, dtype, device)
            scale = head_dim**-0.5
            bound = next(b for b in (1024, 4096, 16384) if b >= max(lengths))  # as a CUDA graph's context bound
            paged_prefill_attention(query, k_cache, v_cache, token_tables, seq_lens, tile_table, bound, scale,
                                    window, softcap, out=out)
            ref = paged_prefill_attention_reference(query.float(), k_cache, v_cache, token_tables, seq_lens,
                                                    tile_table, scale, window, softcap)
            if not torch.isnan(out[0]).all():
                return CheckResult("paged_prefill_attention", case, False, detail="wrote a row outside the tiles")
            return compare("paged_prefill_attention", case, out[1:], ref[1:], REL_TOL[dtype])

        results += guarded("paged_prefill_attention", case, run)
    return results


# ---- small fused ops -------------------------------------------------------------------------------

def check_rms_norm(device, dtypes=(torch.float16, torch.bfloat16)) -> list[CheckResult]:
    from deepinfer.kernels.rms_norm import rms_norm

    results = []
    for dtype in dtypes:
        for rows, hidden in ((5, 576), (64, 4096), (3, 5120)):
            for with_residual in (False, True):
                for offset in (0.0, 1.0):
                    case = f"{_DTYPE_NAMES[dtype]} T={rows} hidden={hidden} residual={with_residual} offset={offset}"

                    def run(dtype=dtype, rows=rows, hidden=hidden, with_residual=with_residual, offset=offset,
                            case=case):
                        x = torch.randn(rows, hidden, dtype=dtype, device=device) * 3
                        residual = torch.randn_like(x) if with_residual else None
                        weight = torch.randn(hidden, dtype=dtype, device=device) * 0.5 + (0.0 if offset else 1.0)
                        out, summed = _nan(x.shape, dtype, device), _nan(x.shape, dtype, device)
                        out, summed = rms_norm(x, weight, 1e-6, offset, residual, out=out, residual_out=summed)
                        ref, ref_sum = rms_norm_reference(x, weight, 1e-6, offset, residual)
                        result = compare("rms_norm", case, out, ref, REL_TOL[dtype])
                        if with_residual and not torch.equal(summed, ref_sum):
                            result.ok, result.detail = False, "residual sum differs from x + residual"
                        return result

                    results += guarded("rms_norm", case, run)
    return results


def check_act_and_mul(device, dtypes=(torch.float16, torch.bfloat16)) -> list[CheckResult]:
    from deepinfer.kernels.act_and_mul import act_and_mul

    results = []
    for dtype in dtypes:
        for activation in ("silu", "gelu_tanh"):
            for rows, inner, merged in ((5, 1536, False), (64, 11008, True)):
                case = f"{_DTYPE_NAMES[dtype]} {activation} T={rows} I={inner}" + (" merged" if merged else "")

                def run(dtype=dtype, activation=activation, rows=rows, inner=inner, merged=merged, case=case):
                    if merged:
                        fused = torch.randn(rows, 2 * inner, dtype=dtype, device=device) * 3
                        gate, up = fused[:, :inner], fused[:, inner:]
                    else:
                        gate = torch.randn(rows, inner, dtype=dtype, device=device) * 3
                        up = torch.randn_like(gate)
                    out = act_and_mul(gate, up, activation, out=_nan((rows, inner), dtype, device))
                    return compare("act_and_mul", case, out, act_and_mul_reference(gate, up, activation),
                                   REL_TOL[dtype])

                results += guarded("act_and_mul", case, run)
    return results


def _rope_tables(num_tokens: int, head_dim: int, dtype: torch.dtype, device):
    positions = torch.randint(0, 4096, (num_tokens,), device=device).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = positions[:, None] * inv_freq[None, :]  # [T, D/2]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def check_rope_cache_write(device, dtypes=(torch.float16, torch.bfloat16)) -> list[CheckResult]:
    from deepinfer.kernels.rope_cache import rope_and_cache_write

    results = []
    num_tokens, num_blocks, block_size = 11, 20, 16
    for dtype in dtypes:
        for int8 in (False, True):
            for heads, kv_heads, head_dim, rope in ((32, 8, 128, True), (9, 3, 64, True), (8, 4, 256, True),
                                                    (32, 8, 128, False)):
                case = (f"{_DTYPE_NAMES[dtype]} {'int8' if int8 else 'same-dtype'} KV H={heads}/{kv_heads} "
                        f"D={head_dim} " + ("rope+write" if rope else "write only"))

                def run(dtype=dtype, int8=int8, heads=heads, kv_heads=kv_heads, head_dim=head_dim, rope=rope,
                        case=case):
                    query = torch.randn(num_tokens, heads, head_dim, dtype=dtype, device=device)
                    key = torch.randn(num_tokens, kv_heads, head_dim, dtype=dtype, device=device)
                    value = torch.randn_like(key)
                    cos, sin = _rope_tables(num_tokens, head_dim, dtype, device)
                    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
                    shape = (num_blocks, kv_heads, block_size, head_dim)
                    if int8:
                        caches = [torch.full(shape, -128, dtype=torch.int8, device=device) for _ in range(4)]
                        scales = [_nan(shape[:3], torch.float16, device) for _ in range(4)]
                    else:
                        caches = [_nan(shape, dtype, device) for _ in range(4)]
                        scales = [None] * 4
                    q_out, k_out = _nan(query.shape, dtype, device), _nan(key.shape, dtype, device)
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
                        if int8:
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


# The merged q/k/v product with RoPE and the cache write in its epilogue: (tokens, q heads, KV heads, head_dim,
# in_features, group size, zeros, bias), zeros as in TC_CASES.
QKV_ROPE_CASES = (
    (1, 16, 2, 128, 2048, 128, "int", True),  # Qwen2.5-3B
    (8, 16, 2, 128, 2048, 128, "int", True),
    (3, 32, 8, 128, 4096, 128, "int", False),  # Llama-3-8B
    (5, 8, 4, 64, 1024, 64, "min", False),
    (2, 12, 4, 256, 2048, 128, "frac", True),
)


def check_quant_matmul_rope_cache(device, dtypes=(torch.float16, torch.bfloat16)) -> list[CheckResult]:
    """quant_matmul_rope_cache against the unfused kernels it replaces (tc product, then rope_cache_kernel): the
    rotated q and k, the v columns and the cache rows must be the same bits, and no other cache row written;
    and against the fp32 reference product rotated in fp32 within the usual tolerance."""
    from deepinfer.kernels.quant_matmul import (
        qkv_rope_takes,
        qkv_rope_unsupported_reason,
        quant_matmul,
        quant_matmul_rope_cache,
    )
    from deepinfer.kernels.rope_cache import rope_and_cache_write

    results = []
    num_blocks, block_size = 24, 16
    for m, heads, kv_heads, head_dim, k, g, zeros_kind, with_bias in QKV_ROPE_CASES:
        for dtype in dtypes:
            case = (f"{_DTYPE_NAMES[dtype]} M={m} H={heads}/{kv_heads} D={head_dim} K={k} G={g} {zeros_kind}-zeros"
                    + (" bias" if with_bias else ""))

            def run(m=m, heads=heads, kv_heads=kv_heads, head_dim=head_dim, k=k, g=g, zeros_kind=zeros_kind,
                    with_bias=with_bias, dtype=dtype, case=case):
                n = (heads + 2 * kv_heads) * head_dim
                packed = tc_case_weight(n, k, g, zeros_kind, False, dtype if with_bias else None, device)
                zero_mode = packed.zero_mode
                x = torch.randn(m, k, device=device, dtype=dtype)
                cos, sin = _rope_tables(m, head_dim, dtype, device)
                shape = (num_blocks, kv_heads, block_size, head_dim)
                caches = [_nan(shape, dtype, device) for _ in range(4)]
                reason = qkv_rope_unsupported_reason(packed.qweight, 4, g, k, heads, kv_heads, head_dim, caches[0],
                                                     dtype)
                assert reason is None and qkv_rope_takes(m, k, n), f"not a case the engine sends here: {reason}"
                slots = torch.randperm(num_blocks * block_size, device=device)[:m]
                if m > 2:
                    slots[m // 2] = -1  # a padding row: no cache write
                args = (packed.qweight, packed.scales, packed.zeros)
                query, key, value = quant_matmul_rope_cache(
                    x, *args, packed.bias, g, zero_mode, packed.integer_zeros, heads, kv_heads, head_dim, cos, sin,
                    caches[0], caches[1], slots)
                qkv = quant_matmul(x, *args, 4, g, zero_mode, packed.bias, kernel="tc", tile=1,
                                   integer_zeros=packed.integer_zeros)
                q_sizes = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
                q_raw, k_raw, v_raw = (part.reshape(m, -1, head_dim) for part in qkv.split(q_sizes, dim=-1))
                ref_q, ref_k = rope_and_cache_write(q_raw, k_raw, v_raw, cos, sin, caches[2], caches[3], slots)
                checks = []
                for name, got, want in (("q", query, ref_q), ("k", key, ref_k), ("v", value, v_raw),
                                        ("k cache", caches[0], caches[2]), ("v cache", caches[1], caches[3])):
                    same = torch.equal(got.contiguous().view(torch.int16), want.contiguous().view(torch.int16))
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
    (12, 11008, 2048, 128, "int", False, False, "silu"),  # two token tiles a CTA
    (32, 11008, 2048, 128, "frac", True, False, "gelu_tanh"),  # four token tiles, one split
    (2, 14336, 4096, 128, "int", False, False, "silu"),  # Llama-3-8B
    (5, 1504, 512, 64, "min", False, True, "gelu_tanh"),  # I not a multiple of 64: idle warps in the last CTA
    (4, 2048, 512, 512, "int", False, False, "silu"),  # per-channel
)


def check_quant_matmul_act_and_mul(device, dtypes=(torch.float16, torch.bfloat16)) -> list[CheckResult]:
    """quant_matmul_act_and_mul against the unfused kernels it replaces (the tcs product, then act_and_mul_kernel):
    the same bits; and against the fp32 reference product's act(gate) * up within the usual tolerance."""
    from deepinfer.kernels.act_and_mul import act_and_mul
    from deepinfer.kernels.quant_matmul import (
        gate_up_act_takes,
        gate_up_act_unsupported_reason,
        quant_matmul,
        quant_matmul_act_and_mul,
    )

    results = []
    for m, inner, k, g, zeros_kind, f32_scales, with_bias, activation in GATE_UP_ACT_CASES:
        for dtype in dtypes:
            case = (f"{_DTYPE_NAMES[dtype]} {activation} M={m} I={inner} K={k} G={g} {zeros_kind}-zeros"
                    + (" fp32-scales" if f32_scales else "") + (" bias" if with_bias else ""))

            def run(m=m, inner=inner, k=k, g=g, zeros_kind=zeros_kind, f32_scales=f32_scales, with_bias=with_bias,
                    activation=activation, dtype=dtype, case=case):
                packed = tc_case_weight(2 * inner, k, g, zeros_kind, f32_scales, dtype if with_bias else None,
                                        device)
                zero_mode = packed.zero_mode
                reason = gate_up_act_unsupported_reason(packed.qweight, 4, g, k, activation)
                assert reason is None and gate_up_act_takes(m, k, 2 * inner), f"not a case the engine sends here: {reason}"
                x = torch.randn(m, k, device=device, dtype=dtype)
                args = (packed.qweight, packed.scales, packed.zeros)
                out = quant_matmul_act_and_mul(x, *args, packed.bias, g, zero_mode, packed.integer_zeros, activation)
                gate_up = quant_matmul(x, *args, 4, g, zero_mode, packed.bias, integer_zeros=packed.integer_zeros)
                want = act_and_mul(gate_up[:, :inner], gate_up[:, inner:], activation)
                # the default (K splits in a cluster where the device has them) and splits through global memory
                global_splits = quant_matmul_act_and_mul(x, *args, packed.bias, g, zero_mode, packed.integer_zeros,
                                                         activation, cluster_splits=False)
                checks = []
                for name, got in (("", out), (" global split-K", global_splits)):
                    same = torch.equal(got.view(torch.int16), want.view(torch.int16))
                    checks.append(CheckResult("quant_matmul_act_and_mul", f"{case}{name} == unfused", same,
                                              detail="" if same else "differs from the unfused kernels' bits"))
                full = x.float() @ dequantize(packed, torch.float32).T
                if packed.bias is not None:
                    full = full + packed.bias.float()
                ref = act_and_mul_reference(full[:, :inner], full[:, inner:], activation)
                checks.append(compare("quant_matmul_act_and_mul", f"{case} vs fp32", out, ref, 2 * REL_TOL[dtype]))
                return checks

            results += guarded("quant_matmul_act_and_mul", case, run)
    return results


def summarize(results: list[CheckResult]) -> dict:
    failed = [r for r in results if not r.ok]
    worst = max((r.rel_err for r in results if r.rel_err is not None and not math.isnan(r.rel_err)), default=None)
    return {"checks": len(results), "failed": len(failed), "worst_rel_err": worst}
