#!/usr/bin/env bash
# CUDA-graph decode check on one GPU (about 4 minutes on an H200): the kernels the checks use are
# compiled in parallel first (CuPy's disk cache), then the gpu-marked tests of the decode graphs and
# the quantized engine, then scripts/graph_decode_check.py (Qwen2.5-3B body, W4A16 dummy weights,
# concurrency 1 and 32, with and without graphs, and inside max_vram 4GiB). Output under $OUT
# (default results/).
set -uo pipefail
OUT_DIR="${OUT:-results}"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1

timeout 60 python3 - <<'EOF' 2>&1 | tail -4
import time
from kernels.compiler import precompile
start = time.time()
jobs = []
for dt in (0, 1):  # float16 (tests), bfloat16 (the benchmark's auto dtype)
    jobs += [("quant_matmul.cu", f"quant_mma_kernel<{dt},4,{t},0>") for t in (1, 2, 4, 8)]
    jobs += [("quant_matmul.cu", f"quant_mma_ksplit_kernel<{dt},4,{t},0>") for t in (1, 2)]
    jobs += [("quant_matmul.cu", f"quant_gemv_kernel<{dt},4,{t},0>") for t in (1, 2, 4)]
    jobs += [("paged_attention.cu", f"paged_decode_kernel<{dt},{d},0>") for d in (32, 128)]
    jobs += [("paged_attention.cu", f"paged_reduce_kernel<{dt}>")]
    jobs += [("rope_cache.cu", f"rope_cache_kernel<{dt},0,{r}>") for r in (0, 1)]
records = precompile(jobs, 0, workers=16)
errors = [r for r in records if r["error"]]
print(f"precompiled {len(records)} kernels in {time.time() - start:.1f} s; errors: {errors[:2]}")
EOF

timeout 80 python3 -m pytest -q -s -rs -m gpu -p no:cacheprovider \
    tests/test_cuda_graph_runner.py tests/test_quantized_engine.py 2>&1 | tee "$OUT_DIR/gpu_tests.log" | tail -25

timeout 150 python3 scripts/graph_decode_check.py \
    --output "$OUT_DIR/decode_graphs_qwen2.5-3b-w4a16_h200.json" > "$OUT_DIR/graph_decode_check.log" 2>&1
echo "graph_decode_check exit $?"
grep -E "graph_decode_check|CUDA graphs|KV cache|quantized|Traceback|Error" "$OUT_DIR/graph_decode_check.log" | tail -24
tail -4 "$OUT_DIR/graph_decode_check.log"
