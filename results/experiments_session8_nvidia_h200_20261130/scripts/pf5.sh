set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 COLUMNS=200 DEEPINFER_GIT_COMMIT=c752ac7
echo "[$(date +%T)] profile"
timeout 120 python3 _run/prefill_prof.py $OUT/prefill_prof_c752ac7.json 2>&1 | grep -v -i warn | grep -v "^    " | head -12
echo "[$(date +%T)] long chunk"
timeout 150 python3 _run/long_chunk.py $OUT/long_chunk_c752ac7.json 2>&1 | grep -v -i warn | tail -4
echo "[$(date +%T)] done"
