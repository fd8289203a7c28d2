#!/usr/bin/env bash
# Everything docs/RESULTS.md reports from one GPU machine, in one call (about 9 minutes on an H200),
# output under $OUT (default results/):
#   1. the gpu-marked tests (HF parity on CUDA in fp32/bf16/fp16, every kernel against its reference,
#      CUDA graphs, the quantized engine, the sampler, async scheduling) -> gpu_tests_<gpu>.log, whose
#      first line is the environment (GPU, driver, versions, commit) as the JSON files record it
#   2. deepinfer validate-kernels      -> kernel_validation_<gpu>.json
#   3. scripts/gpu_bench.sh            -> its default set: concurrency with the HF peer, the 4 GiB
#                                         budget, long-prompt jitter, concurrency with DEEPINFER_PDL=0
#   4. scripts/profile_graph_steps.py  -> GPU time per replayed step (1 and 32 tokens), its kernels,
#                                         and the steady decode step of 1 and 32 streams
# It needs the package installed (pip install -e '.[gpu]'). A copy of the tree without .git cannot
# name its commit: pass it, e.g.
#   DEEPINFER_GIT_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_final.sh
set -uo pipefail
OUT_DIR="${OUT:-results}"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 COLUMNS=200
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 | tr 'A-Z' 'a-z' | tr -cs 'a-z0-9' '_' | sed 's/^_//; s/_$//')
GPU=${GPU:-gpu}
TESTS_LOG="$OUT_DIR/gpu_tests_${GPU}.log"

echo "[$(date +%H:%M:%S)] gpu tests"
GPU_TESTS=(python3 -m pytest -q -rs -m gpu -p no:cacheprovider
    tests/test_hf_parity.py tests/test_kernels_gpu.py tests/test_cuda_graph_runner.py
    tests/test_quantized_engine.py tests/test_sampler.py tests/test_async_scheduling.py)
python3 -c "import json, sys; from deepinfer.core.bench.env_info import env_info; print(json.dumps(env_info(sys.argv[1:])))" \
    "${GPU_TESTS[@]}" > "$TESTS_LOG" 2>&1
timeout 200 "${GPU_TESTS[@]}" >> "$TESTS_LOG" 2>&1
echo "gpu tests exit $?"; tail -15 "$TESTS_LOG"

echo "[$(date +%H:%M:%S)] validate-kernels"
timeout 150 python3 -m deepinfer validate-kernels --workers 12 --no-show-passed \
    --output "$OUT_DIR/kernel_validation_${GPU}.json" > "$OUT_DIR/validate.log" 2>&1
echo "validate-kernels exit $?"; tail -12 "$OUT_DIR/validate.log"

echo "[$(date +%H:%M:%S)] benchmarks"
OUT="$OUT_DIR" bash scripts/gpu_bench.sh > /dev/null 2>&1
echo "gpu_bench exit $?"; grep -E "exit|failed|all sections" "$OUT_DIR/gpu_bench.log" | tail -8

echo "[$(date +%H:%M:%S)] profile"
timeout 150 python3 scripts/profile_graph_steps.py --buckets 1,32 --streams 1,32 --out "$OUT_DIR" > /dev/null 2>&1
echo "profile exit $?"; grep -h "^---" "$OUT_DIR"/profile_graph_steps_*.txt
