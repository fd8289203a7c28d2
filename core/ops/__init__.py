"""Op dispatch: each op runs a CUDA kernel when one can serve the case, its torch reference otherwise.

This package is the engine's only way to the kernels (kernels/ holds launchers that take plain tensors and an
explicit kernel choice); the choice of kernel is made here, in one table per op family, described in
docs/KERNELS.md:
    W4/W3 products and their fused epilogues                            core/ops/quant_matmul_table.py
    paged decode paths, prefill tiles, graph thresholds                 core/ops/paged_attention_table.py
    the small ops: their one kernel wherever its check passes           each op's module

Public ops (each module also exports its `*_reference`):
    quant_matmul(x, packed)                                             core/ops/quant_matmul.py
    qkv_rotary_and_cache_write(x, packed, ...)                          core/ops/qkv_rotary.py
    gate_up_act_and_mul(x, packed, activation)                          core/ops/gate_up_activation.py
    rms_norm(x, weight, eps, weight_offset=0.0, residual=None)          core/ops/norm.py
    rotary_and_cache_write(q, k, v, cos, sin, k_cache, v_cache, slots)  core/ops/rotary.py
    write_kv_cache(k, v, k_cache, v_cache, slots)                       core/ops/rotary.py
    act_and_mul(gate, up, activation)                                   core/ops/activation.py
    paged_decode_attention(q, k_cache, v_cache, block_tables, ...)      core/ops/paged_attention.py
    paged_prefill_attention(q, k_cache, v_cache, ..., tiles, ...)       core/ops/paged_attention.py
The path each op takes is logged once per (op, reason) on the "deepinfer.ops" logger and summarized by
`dispatch.kernel_summary`; DEEPINFER_FORCE_REFERENCE=1 forces every op onto its reference (core/ops/dispatch.py).
"""
