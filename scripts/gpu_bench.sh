#!/usr/bin/env bash
# The benchmarks behind docs/RESULTS.md, on one GPU. JSON goes to $OUT (default results/) under fixed
# names, so a new run replaces the files the docs cite; the console output (Rich tables) goes to
# gpu_bench.log next to them. All on the Qwen2.5-3B body in W4A16 (random weights: speed does not
# depend on their values), bf16 activations, 256-token prompts, 64 output tokens.
#
#   bash scripts/gpu_bench.sh [SECTION ...]
#
# With no arguments it runs the default set (about 8 minutes on an H200):
#   concurrency         concurrency 1,4,8,32,64, with the HF transformers peer on the same prompts
#   concurrency-4gib    the same model inside --max-vram 4GiB (a 4 GiB card's budget), concurrency 1,2,4,8
#   jitter              a 2048-token prompt inserted into a decoding stream, over eight chunk sizes
#                       (one engine each), with an 8 ms ITL SLO
#   concurrency-no-pdl  the concurrency sweep with DEEPINFER_PDL=0 (serialized launches, no HF peer)
# Named on the command line, it also runs (each about a minute):
#   scheduling          concurrency 1 and 32 with async scheduling, then with --no-async-scheduling
#   gemv                `deepinfer bench gemv` on Qwen2.5-3B's and 7B's merged W4 products in bf16 at 1-256
#                       tokens (every kernel, the W4 GEMM, cuBLAS on the dense weight, the floor), and
#                       decode attention, each kernel alone
#   serving-w4a16       the serving sweep: prompt 128 / output 128, concurrency 1,8,32,64,128 with
#                       --max-num-seqs 128, in W4A16
#   serving-bf16        the same sweep on the same shape in bf16 (the W4A16 sweep's peer)
#   serving-int8-kv     the W4A16 serving sweep with --kv-cache-dtype int8 (its peer: serving-w4a16)
#   structured          concurrency 1 and 32, prompt 128 / output 128, each request's output constrained
#                       to configs/json_schemas/order.json (its peer: serving-w4a16's same levels)
# A section that fails or runs out of time is reported and the next one still runs; the script
# exits non-zero if any failed. The JSON names the commit: on a copy of the tree without .git, set
# DEEPINFER_GIT_COMMIT (scripts/gpu_final.sh says how).
set -uo pipefail

OUT_DIR="${OUT:-results}"
mkdir -p "$OUT_DIR"
DEEPINFER=(python3 -m deepinfer)
MODEL=(--dummy-weights --shape qwen2.5-3b --quantization w4a16 --max-model-len 4096)
SUBJECT=qwen2.5-3b-w4a16
MODEL_BF16=(--dummy-weights --shape qwen2.5-3b --max-model-len 4096)
SERVING=(--concurrency 1,8,32,64,128 --max-num-seqs 128 --prompt-len 128 --output-len 128)
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 | tr 'A-Z' 'a-z' | tr -cs 'a-z0-9' '_' | sed 's/^_//; s/_$//')
GPU=${GPU:-gpu}
LOG="$OUT_DIR/gpu_bench.log"
FAILED=()

run() {  # run NAME TIME_LIMIT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "[$(date +%H:%M:%S)] $name: $*" | tee -a "$LOG"
    local start=$SECONDS
    COLUMNS=200 timeout --signal=INT --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "[$(date +%H:%M:%S)] $name: exit $rc after $((SECONDS - start)) s" | tee -a "$LOG"
    [ "$rc" -eq 0 ] || FAILED+=("$name (exit $rc)")
}

section() {
    case $1 in
    concurrency)
        run concurrency 200 "${DEEPINFER[@]}" bench concurrency "${MODEL[@]}" \
            --concurrency 1,4,8,32,64 --prompt-len 256 --output-len 64 --peer hf \
            --output "$OUT_DIR/bench_concurrency_${SUBJECT}_${GPU}.json" ;;
    concurrency-4gib)
        run concurrency-4gib 80 "${DEEPINFER[@]}" bench concurrency "${MODEL[@]}" --max-vram 4GiB --max-num-seqs 8 \
            --concurrency 1,2,4,8 --prompt-len 256 --output-len 64 \
            --output "$OUT_DIR/bench_concurrency_${SUBJECT}-4gib_${GPU}.json" ;;
    jitter)
        run jitter 180 "${DEEPINFER[@]}" bench jitter "${MODEL[@]}" \
            --chunk-sizes 16,32,64,128,256,512,1024,2048 --long-prompt-len 2048 --insert-after 16 --itl-slo-ms 8 \
            --max-num-seqs 4 --kv-cache-memory 4GiB \
            --output "$OUT_DIR/bench_jitter_${SUBJECT}_${GPU}.json" ;;
    concurrency-no-pdl)
        run concurrency-no-pdl 120 env DEEPINFER_PDL=0 "${DEEPINFER[@]}" bench concurrency "${MODEL[@]}" \
            --concurrency 1,4,8,32,64 --prompt-len 256 --output-len 64 \
            --output "$OUT_DIR/bench_concurrency_${SUBJECT}-no-pdl_${GPU}.json" ;;
    scheduling)
        run scheduling-async 80 "${DEEPINFER[@]}" bench concurrency "${MODEL[@]}" \
            --concurrency 1,32 --prompt-len 256 --output-len 64 \
            --output "$OUT_DIR/bench_concurrency_${SUBJECT}-async_${GPU}.json"
        run scheduling-sync 80 "${DEEPINFER[@]}" bench concurrency "${MODEL[@]}" --no-async-scheduling \
            --concurrency 1,32 --prompt-len 256 --output-len 64 \
            --output "$OUT_DIR/bench_concurrency_${SUBJECT}-sync_${GPU}.json" ;;
    gemv)
        run gemv 240 "${DEEPINFER[@]}" bench gemv --bits 4 --dtype bfloat16 --batches 1,4,8,16,32,64,128,256 \
            --shapes 2048x2560,2048x2048,2048x22016,11008x2048,3584x4608,3584x3584,3584x37888,18944x3584 \
            --repeats 3 --output "$OUT_DIR/bench_gemv_qwen2.5-w4a16-bf16_${GPU}.json" ;;
    serving-w4a16)
        run serving-w4a16 150 "${DEEPINFER[@]}" bench concurrency "${MODEL[@]}" "${SERVING[@]}" \
            --output "$OUT_DIR/bench_serving_${SUBJECT}_${GPU}.json" ;;
    serving-bf16)
        run serving-bf16 150 "${DEEPINFER[@]}" bench concurrency "${MODEL_BF16[@]}" "${SERVING[@]}" \
            --output "$OUT_DIR/bench_serving_qwen2.5-3b-bf16_${GPU}.json" ;;
    serving-int8-kv)
        run serving-int8-kv 150 "${DEEPINFER[@]}" bench concurrency "${MODEL[@]}" "${SERVING[@]}" \
            --kv-cache-dtype int8 --output "$OUT_DIR/bench_serving_${SUBJECT}-int8-kv_${GPU}.json" ;;
    structured)
        run structured 120 "${DEEPINFER[@]}" bench concurrency "${MODEL[@]}" --concurrency 1,32 \
            --prompt-len 128 --output-len 128 --json-schema configs/json_schemas/order.json \
            --output "$OUT_DIR/bench_structured_${SUBJECT}_${GPU}.json" ;;
    *)
        echo "unknown section: $1" | tee -a "$LOG"
        FAILED+=("$1 (unknown)") ;;
    esac
}

SECTIONS=("$@")
[ ${#SECTIONS[@]} -gt 0 ] || SECTIONS=(concurrency concurrency-4gib jitter concurrency-no-pdl)
for name in "${SECTIONS[@]}"; do
    section "$name"
done

if [ ${#FAILED[@]} -gt 0 ]; then
    echo "failed: ${FAILED[*]}" | tee -a "$LOG"
    exit 1
fi
echo "all sections done; JSON in $OUT_DIR" | tee -a "$LOG"
