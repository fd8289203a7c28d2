set -u
export PYTHONUNBUFFERED=1 COLUMNS=200
mkdir -p /tmp/src /tmp/o && tar -xf _run/src.tar -C /tmp/src && cp _run/vram_diag.py _run/stream_floor.py /tmp/src/ && cd /tmp/src && export PYTHONPATH=/tmp/src
echo "[$(date +%T)] vram diag"
timeout 100 python3 vram_diag.py cap > /tmp/o/vram_diag_4gib.log 2>&1; grep -E "KV cache|re-laid|engine ready|after 8|captured" /tmp/o/vram_diag_4gib.log
timeout 60 python3 stream_floor.py /tmp/o/stream_floor.json
OUT=/tmp/o DEEPINFER_GIT_COMMIT=$COMMIT timeout 500 bash scripts/gpu_final.sh
echo "gpu_final exit $?"
cd /tmp/o && tar -czf $OUT/final.tgz . && echo "[$(date +%T)] packed"
