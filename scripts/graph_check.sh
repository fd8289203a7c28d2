#!/usr/bin/env bash
# CUDA-graph decode check on one GPU (about 2 minutes on an H200): the gpu-marked tests of the
# decode graphs and the quantized engine, then scripts/graph_decode_check.py (Qwen2.5-3B body, W4A16 dummy weights,
# concurrency 1 and 32, with and without graphs, and inside max_vram 4GiB). Output under $OUT
# (default results/).
set -uo pipefail
OUT_DIR="${OUT:-results}"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1

timeout 80 python3 -m pytest -q -s -rs -m gpu -p no:cacheprovider \
    tests/test_cuda_graph_runner.py tests/test_quantized_engine.py 2>&1 | tee "$OUT_DIR/gpu_tests.log" | tail -25

timeout 150 python3 scripts/graph_decode_check.py \
    --output "$OUT_DIR/decode_graphs_qwen2.5-3b-w4a16_h200.json" > "$OUT_DIR/graph_decode_check.log" 2>&1
echo "graph_decode_check exit $?"
grep -E "graph_decode_check|CUDA graphs|KV cache|quantized|Traceback|Error" "$OUT_DIR/graph_decode_check.log" | tail -24
tail -4 "$OUT_DIR/graph_decode_check.log"
