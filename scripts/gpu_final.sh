#!/usr/bin/env bash
# Everything docs/RESULTS.md and docs/KERNELS.md report from one GPU machine, in three parts of under
# 10 minutes each on an H200, output under $OUT (default results/):
#   bash scripts/gpu_final.sh checks    1. the gpu-marked tests (HF parity on CUDA in fp32/bf16/fp16, every
#                                          kernel against its reference, the W4 GEMM, CUDA graphs, the
#                                          quantized engine, the sampler, async scheduling, structured
#                                          outputs, the benchmarks and chat on a tiny model)
#                                          -> gpu_tests_<gpu>.log, whose first line is the environment (GPU,
#                                          driver, versions, commit) as the JSON files record it
#                                       2. deepinfer validate-kernels -> kernel_validation_<gpu>.json
#   bash scripts/gpu_final.sh kernels   3. scripts/tune_w4_gemm.py -> w4_gemm_sweep_<gpu>.json (the W4 GEMM's
#                                          launch shapes against cuBLAS bf16 and the dense path, 16-256 tokens)
#                                       4. scripts/gpu_bench.sh gemv (each product kernel alone, 1-256 tokens)
#   bash scripts/gpu_final.sh bench     5. scripts/gpu_bench.sh: concurrency with the HF peer, the serving
#                                          sweeps (W4A16 and bf16, prompt 128 / output 128, concurrency 1-128),
#                                          the INT8 KV cache, structured outputs, long-prompt jitter
#                                       6. scripts/profile_graph_steps.py -> GPU time per replayed step (1 and
#                                          32 tokens), its kernels, and the steady decode step of 1 and 32 streams
# With no argument it runs all three in turn. It needs the package installed (pip install -e '.[gpu]').
# A copy of the tree without .git cannot name its commit: pass it, e.g.
#   DEEPINFER_GIT_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_final.sh checks
set -uo pipefail
OUT_DIR="${OUT:-results}"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 COLUMNS=200
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 | tr 'A-Z' 'a-z' | tr -cs 'a-z0-9' '_' | sed 's/^_//; s/_$//')
GPU=${GPU:-gpu}
PART=${1:-all}

if [ "$PART" = checks ] || [ "$PART" = all ]; then
    TESTS_LOG="$OUT_DIR/gpu_tests_${GPU}.log"
    echo "[$(date +%H:%M:%S)] gpu tests"
    GPU_TESTS=(python3 -m pytest -q -rs -m gpu -p no:cacheprovider
        tests/test_hf_parity.py tests/test_kernels_gpu.py tests/test_w4_gemm_gpu.py tests/test_cuda_graph_runner.py
        tests/test_quantized_engine.py tests/test_sampler.py tests/test_async_scheduling.py
        tests/test_structured_engine.py tests/test_bench.py tests/test_chat.py)
    python3 -c "import json, sys; from deepinfer.core.bench.env_info import env_info; print(json.dumps(env_info(sys.argv[1:])))" \
        "${GPU_TESTS[@]}" > "$TESTS_LOG" 2>&1
    timeout 330 "${GPU_TESTS[@]}" >> "$TESTS_LOG" 2>&1
    echo "gpu tests exit $?"; tail -15 "$TESTS_LOG"

    echo "[$(date +%H:%M:%S)] validate-kernels"
    timeout 150 python3 -m deepinfer validate-kernels --workers 12 --no-show-passed \
        --output "$OUT_DIR/kernel_validation_${GPU}.json" > "$OUT_DIR/validate.log" 2>&1
    echo "validate-kernels exit $?"; tail -12 "$OUT_DIR/validate.log"
fi

if [ "$PART" = kernels ] || [ "$PART" = all ]; then
    echo "[$(date +%H:%M:%S)] W4 GEMM sweep"
    timeout 330 python3 scripts/tune_w4_gemm.py --tokens 16,32,64,128,256 \
        --output "$OUT_DIR/w4_gemm_sweep_${GPU}.json" > "$OUT_DIR/w4_gemm_sweep.log" 2>&1
    echo "W4 GEMM sweep exit $?"; tail -4 "$OUT_DIR/w4_gemm_sweep.log"
    OUT="$OUT_DIR" bash scripts/gpu_bench.sh gemv > /dev/null 2>&1
    echo "gpu_bench gemv exit $?"; grep -E "exit|failed" "$OUT_DIR/gpu_bench.log" | tail -3
fi

if [ "$PART" = bench ] || [ "$PART" = all ]; then
    echo "[$(date +%H:%M:%S)] benchmarks"
    OUT="$OUT_DIR" bash scripts/gpu_bench.sh concurrency serving-w4a16 serving-bf16 serving-int8-kv structured \
        jitter > /dev/null 2>&1
    echo "gpu_bench exit $?"; grep -E "exit|failed|all sections" "$OUT_DIR/gpu_bench.log" | tail -8

    echo "[$(date +%H:%M:%S)] profile"
    timeout 100 python3 scripts/profile_graph_steps.py --buckets 1,32 --streams 1,32 --out "$OUT_DIR" > /dev/null 2>&1
    echo "profile exit $?"; grep -h "^---" "$OUT_DIR"/profile_graph_steps_*.txt
fi
