#!/usr/bin/env bash
# Issue #7 benchmarks on one GPU; about 8 minutes on an H200. JSON goes to $OUT (default results/),
# the console output (Rich tables) to gpu_bench.log next to it.
#   1. Qwen2.5-3B body, W4A16 (dummy weights), concurrency 1,4,8,32,64, with the HF transformers peer
#   2. the same model inside --max-vram 4GiB (a 4 GiB card's budget), concurrency 1,2,4,8
#   3. the same model: long-document insertion jitter over eight token budgets (one engine each), ITL SLO 8 ms
#   4. section 1 again with DEEPINFER_PDL=0 (every launch fully serialized, no HF peer), for the PDL ratio
# A section that fails or runs out of time is reported and the next one still runs; the script
# exits non-zero if any failed.
set -uo pipefail

OUT_DIR="${OUT:-results}"
mkdir -p "$OUT_DIR"
DEEPINFER=(python3 -m deepinfer)
MODEL=(--dummy-weights --shape qwen2.5-3b --quantization w4a16 --max-model-len 4096)
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 | tr 'A-Z' 'a-z' | tr -cs 'a-z0-9' '_' | sed 's/^_//; s/_$//')
GPU=${GPU:-gpu}
STAMP=$(date +%Y%m%d-%H%M%S)
LOG="$OUT_DIR/gpu_bench.log"
FAILED=()

section() {  # section NAME TIME_LIMIT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "[$(date +%H:%M:%S)] $name: $*" | tee -a "$LOG"
    local start=$SECONDS
    COLUMNS=200 timeout --signal=INT --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "[$(date +%H:%M:%S)] $name: exit $rc after $((SECONDS - start)) s" | tee -a "$LOG"
    [ "$rc" -eq 0 ] || FAILED+=("$name (exit $rc)")
}

section concurrency 200 "${DEEPINFER[@]}" bench concurrency "${MODEL[@]}" \
    --concurrency 1,4,8,32,64 --prompt-len 256 --output-len 64 --peer hf \
    --output "$OUT_DIR/bench_concurrency_qwen2.5-3b-w4a16_${GPU}_${STAMP}.json"

section concurrency-4gib 80 "${DEEPINFER[@]}" bench concurrency "${MODEL[@]}" --max-vram 4GiB --max-num-seqs 8 \
    --concurrency 1,2,4,8 --prompt-len 256 --output-len 64 \
    --output "$OUT_DIR/bench_concurrency_qwen2.5-3b-w4a16-4gib_${GPU}_${STAMP}.json"

section jitter 180 "${DEEPINFER[@]}" bench jitter "${MODEL[@]}" \
    --token-budgets 16,32,64,128,256,512,1024,2048 --long-prompt-len 2048 --insert-after 16 --itl-slo-ms 8 \
    --max-num-seqs 4 --kv-cache-memory 4GiB \
    --output "$OUT_DIR/bench_jitter_qwen2.5-3b-w4a16_${GPU}_${STAMP}.json"

section concurrency-no-pdl 120 env DEEPINFER_PDL=0 "${DEEPINFER[@]}" bench concurrency "${MODEL[@]}" \
    --concurrency 1,4,8,32,64 --prompt-len 256 --output-len 64 \
    --output "$OUT_DIR/bench_concurrency_qwen2.5-3b-w4a16-no-pdl_${GPU}_${STAMP}.json"

if [ ${#FAILED[@]} -gt 0 ]; then
    echo "failed: ${FAILED[*]}" | tee -a "$LOG"
    exit 1
fi
echo "all sections done; JSON in $OUT_DIR" | tee -a "$LOG"
