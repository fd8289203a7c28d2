set -u
export PYTHONUNBUFFERED=1
mkdir -p /tmp/src && tar -xf _run/src.tar -C /tmp/src && cp _run/vram_diag.py /tmp/src/ && cd /tmp/src && export PYTHONPATH=/tmp/src
for v in cap nocap; do
  echo "=== $v"; timeout 150 python3 vram_diag.py $v 2>&1 | grep -v "^core.models\|^core.weights" | tail -70
done
echo "=== cap + expandable segments"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 150 python3 vram_diag.py cap 2>&1 | tail -30
