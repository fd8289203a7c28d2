"""The op registry: every kernel-backed op, its source and the template instantiations compiled ahead.

The op names are the ones core/ops logs its choices under (core/ops/dispatch.py) and `deepinfer validate-kernels`
groups its checks by; the launchers and their capability checks live beside each kernel (kernels/<op>.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.kernels import (
    act_and_mul,
    dequantize,
    paged_attention,
    quant_matmul,
    rms_norm,
    rope_cache,
    token_bitmask,
    w4_fragment_batch,
    w4_fragment_gemm,
    w4_gemm,
    w8_gemm,
)


@dataclass(frozen=True)
class KernelOp:
    name: str
    source: str  # kernels/<source>
    summary: str
    instantiations: tuple[str, ...]  # the template instantiations common models use (compiled ahead)


def _names(template: str, **axes: tuple) -> tuple[str, ...]:
    """Every combination of the axes: _names("k<{a},{b}>", a=(0, 1), b=(4,)) -> ("k<0,4>", "k<1,4>")."""
    names = [template]
    for axis, values in axes.items():
        names = [name.replace("{" + axis + "}", str(value)) for name in names for value in values]
    return tuple(names)


_DT = (0, 1)  # float16, bfloat16
# paged_decode_kernel's trailing template arguments on the split, combined and clustered paths
_ATTENTION_PATHS = ("", f",{paged_attention.COMBINED_WARPS}",
                    f",{paged_attention.COMBINED_WARPS},{paged_attention.CLUSTER_CTAS}")


_OPS = (
    KernelOp("quant_matmul", quant_matmul.SOURCE,
             "W4A16/W3A16 matmul: tensor-core GEMVs tc / tcs (W4), CUDA-core GEMVs gemv / stream, mma.sync "
             "K-split (ksplit) and 128-row staged tiles (staged)",
             _names("quant_tc_gemv_kernel<{dt},{tile},{mode},{f32}>", dt=_DT, tile=(1, 2, 4), mode=(0, 1), f32=(0, 1))
             + _names("quant_tcs_kernel<{dt},{tile},{mode},{f32}>", dt=_DT, tile=(1, 2, 4), mode=(0, 1), f32=(0, 1))
             + _names("quant_mma_staged_kernel<{dt},{bits},{tile},{f32}>", dt=_DT, bits=(4, 3), tile=(1, 2, 4, 8),
                      f32=(0, 1))
             + _names("quant_mma_ksplit_kernel<{dt},{bits},{tile},{f32}>", dt=_DT, bits=(4, 3), tile=(1, 2), f32=(0, 1))
             + _names("quant_gemv_kernel<{dt},{bits},{tile},{f32}>", dt=_DT, bits=(4, 3), tile=(1, 2, 4), f32=(0, 1))
             + _names("quant_stream_kernel<{dt},{bits},{tile},{f32}>", dt=_DT, bits=(4, 3), tile=(1, 2, 4), f32=(0, 1))),
    KernelOp("quant_matmul_rope_cache", quant_matmul.SOURCE,
             "the merged q/k/v W4 product (tc, up to 8 tokens) with RoPE on q/k and the KV-cache write fused into "
             "its epilogue (fp16/bf16, int8 and e4m3 KV)",
             _names("quant_tc_rope_kernel<{dt},{mode},{f32},{kv}>", dt=_DT, mode=(0, 1), f32=(0, 1), kv=(0, 1, 2))),
    KernelOp("quant_matmul_act_and_mul", quant_matmul.SOURCE,
             "the merged gate/up W4 product (tcs, up to 32 tokens) with SiLU / GeLU-tanh gate times up fused into "
             "its epilogue; K splits meet in a thread-block cluster on SM90+",
             _names("quant_tcs_act_kernel<{dt},{tile},{mode},{f32},{act}{splits}>", dt=_DT, tile=(1, 2, 4),
                    mode=(0, 1), f32=(0, 1), act=(0, 1), splits=("", ",1"))),  # K splits: global memory, a cluster
    KernelOp("w4_gemm", w4_gemm.SOURCE,
             "W4A16 GEMM on tensor cores reading the packed weight: wgmma with the weights unpacked in registers "
             "(SM90), mma.sync (SM80+); products of 9-128 tokens (core/ops/quant_matmul_table.py says which)",
             w4_gemm.instantiations()),
    KernelOp("w4_fragment_gemm", w4_fragment_gemm.SOURCE,
             "W4A16 product over the load-time fragment layout: one 16-byte load a lane serves four mma.sync steps, "
             "LOP3 magic-number unpacking, exact integer zeros, cp.async stages, split-K (SM80+); shapes of 1-32 "
             "tokens, fp32 group sums; an epilogue with SiLU / GeLU-tanh gate times up over an interleaved gate/up "
             "layout",
             w4_fragment_gemm.instantiations()),
    KernelOp("w8_gemm", w8_gemm.SOURCE,
             "W8A16 product on tensor cores (mma.sync, SM80+) reading the 8-bit packed weight (GGUF Q8_0, RTN 8-bit), "
             "dequantized in registers with the reference's fp32 arithmetic; 16 rows a CTA of 8 warps splitting K; "
             "1-64 tokens; on SM90 from 17 tokens wgmma with those weights as A from registers (128 rows a CTA)",
             w8_gemm.instantiations()),
    KernelOp("w4_fragment_batch", w4_fragment_batch.SOURCE,
             "W4A16 product of 33-128 tokens over the same fragment layout: 8 warps of 128 x 64-token tiles, a "
             "4-slot cp.async ring across tiles, fp32 group sums, stream-K over persistent CTAs with a fix-up in "
             "k order (SM80+)",
             w4_fragment_batch.instantiations()),
    KernelOp("dequantize", dequantize.SOURCE,
             "W4/W3/W8 packed weight -> dense fp16/bf16 [N, K] (many-token products then run on cuBLAS)",
             _names("dequantize_kernel<{dt},{bits},{mode},{f32}>", dt=_DT, bits=(4, 3, 8), mode=(0, 1), f32=(0, 1))),
    KernelOp("paged_decode_attention", paged_attention.SOURCE,
             "paged GQA decode attention over the block table: split-K + reduce, or one 8-warp CTA a sequence "
             "and KV head (many sequences, bounds up to 1024), or a cluster of 4 such CTAs (few sequences, SM90+); "
             "fp16/bf16/int8 KV",
             _names("paged_decode_kernel<{dt},{d},{kvq},{pipe}{path}>", dt=_DT, d=(64, 128, 256), kvq=(0, 1, 2),
                    pipe=(0, 1), path=_ATTENTION_PATHS)
             + _names("paged_decode_heads_n_kernel<{dt},{d},{kvq},{warps}>", dt=_DT, d=paged_attention.HEADS_N_HEAD_DIMS,
                      kvq=(0, 1, 2), warps=(1, paged_attention.COMBINED_WARPS))
             + _names("paged_decode_heads_n_kernel<{dt},{d},{kvq},{warps},{cluster}>", dt=_DT,
                      d=paged_attention.HEADS_N_HEAD_DIMS, kvq=(0, 1, 2), warps=(paged_attention.COMBINED_WARPS,),
                      cluster=(paged_attention.CLUSTER_CTAS,))
             + _names("paged_reduce_kernel<{dt}>", dt=_DT)),
    KernelOp("paged_prefill_attention", paged_attention.SOURCE,
             "paged GQA attention of prefill tiles (consecutive tokens of one sequence, each with its causal "
             "prefix): one 4-warp CTA a tile, KV head and key split, K/V tiles staged in shared memory once for "
             "all its tokens, splits combined by a reduce; fp16/bf16/int8/e4m3 KV (codes staged, "
             "converted once a CTA)",
             _names("paged_prefill_kernel<{dt},{d}>", dt=_DT, d=paged_attention.PREFILL_HEAD_DIMS)
             + _names("paged_prefill_kernel<{dt},{d},{kvq}>", dt=_DT, d=paged_attention.PREFILL_HEAD_DIMS,
                      kvq=(1, 2))
             + _names("paged_prefill_reduce_kernel<{dt}>", dt=_DT)),
    KernelOp("rms_norm", rms_norm.SOURCE, "RMSNorm (+ fused residual add, Gemma 1+w offset)",
             _names("rms_norm_kernel<{dt},{res},{offset}>", dt=_DT, res=(0, 1), offset=(0, 1))),
    KernelOp("rope_cache_write", rope_cache.SOURCE, "RoPE on q/k + paged KV-cache write (fp16/bf16/int8)",
             _names("rope_cache_kernel<{dt},{kvq},{rope}>", dt=_DT, kvq=(0, 1, 2), rope=(0, 1))),
    KernelOp("act_and_mul", act_and_mul.SOURCE, "SiLU / GeLU-tanh gate times up ([gate | up] or 8-column blocks)",
             _names("act_and_mul_kernel<{dt},{act},{interleaved}>", dt=_DT, act=(0, 1), interleaved=(0, 1))),
    KernelOp("token_bitmask", token_bitmask.SOURCE,
             "structured outputs' token bitmask applied in place to the constrained rows of fp32 logits",
             (token_bitmask.KERNEL,)),
)
OPS: dict[str, KernelOp] = {op.name: op for op in _OPS}


def get(name: str) -> KernelOp:
    return OPS[name]


def all_instantiations() -> list[tuple[str, str]]:
    """(source, name expression) of every registered instantiation."""
    return [(op.source, name) for op in _OPS for name in op.instantiations]
