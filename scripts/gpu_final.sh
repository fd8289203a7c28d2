#!/usr/bin/env bash
# Everything the GPU must show, in one device call (about 9 minutes on an H200), output under $OUT
# (default results/):
#   1. the gpu-marked tests (HF parity on CUDA in fp32/bf16/fp16, kernels, CUDA graphs, quantized engine)
#   2. deepinfer validate-kernels  -> kernel_validation_<gpu>.json
#   3. scripts/gpu_bench.sh        -> the issue #7 benchmark JSONs (concurrency + HF peer, 4 GiB, jitter,
#                                     concurrency with DEEPINFER_PDL=0)
#   4. scripts/profile_graph_steps.py -> GPU time per replayed step (1 and 32 tokens) and its kernels
# A copy of the tree without .git cannot name its commit: pass it, e.g.
#   DEEPINFER_GIT_COMMIT=$(git rev-parse HEAD) bash scripts/gpu_final.sh
set -uo pipefail
OUT_DIR="${OUT:-results}"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 COLUMNS=200

echo "[$(date +%H:%M:%S)] gpu tests"
timeout 200 python3 -m pytest -q -rs -m gpu -p no:cacheprovider \
    tests/test_hf_parity.py tests/test_kernels_gpu.py tests/test_cuda_graph_runner.py \
    tests/test_quantized_engine.py tests/test_sampler.py tests/test_async_scheduling.py > "$OUT_DIR/gpu_tests.log" 2>&1
echo "gpu tests exit $?"; tail -15 "$OUT_DIR/gpu_tests.log"

echo "[$(date +%H:%M:%S)] validate-kernels"
timeout 150 python3 -m deepinfer validate-kernels --workers 12 --no-show-passed \
    --output "$OUT_DIR/kernel_validation_nvidia_h200.json" > "$OUT_DIR/validate.log" 2>&1
echo "validate-kernels exit $?"; tail -12 "$OUT_DIR/validate.log"

echo "[$(date +%H:%M:%S)] benchmarks"
OUT="$OUT_DIR" bash scripts/gpu_bench.sh > /dev/null 2>&1
echo "gpu_bench exit $?"; grep -E "exit|failed|all sections" "$OUT_DIR/gpu_bench.log" | tail -8

echo "[$(date +%H:%M:%S)] profile"
timeout 150 python3 scripts/profile_graph_steps.py --buckets 1,32 --streams 1,32 --out "$OUT_DIR" > /dev/null 2>&1
echo "profile exit $?"; grep -h "^---" "$OUT_DIR"/profile_graph_steps_*.txt
