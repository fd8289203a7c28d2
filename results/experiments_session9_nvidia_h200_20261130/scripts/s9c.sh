set -u
export PYTHONUNBUFFERED=1 COLUMNS=200
mkdir -p /tmp/src && tar -xf _run/src.tar -C /tmp/src && cp _run/vram_diag.py /tmp/src/ && cd /tmp/src && export PYTHONPATH=/tmp/src
echo "[$(date +%T)] diag"
timeout 150 python3 vram_diag.py cap 2>&1 | grep -E "^  |KV cache|CUDA graphs:" | grep -v "after capture [0-9]*x1024\|after capture [1-9][0-9]\?x" 
echo "[$(date +%T)] 4gib"
timeout 120 python3 -m deepinfer_cli.main bench concurrency --dummy-weights --shape qwen2.5-3b --quantization w4a16 --max-model-len 4096 --max-vram 4GiB --max-num-seqs 8 --concurrency 1,2,4,8 --prompt-len 256 --output-len 64 --output $OUT/bench_4gib.json > $OUT/bench_4gib.log 2>&1; echo "exit $?"; tail -3 $OUT/bench_4gib.log
python3 - <<'PY'
import json,os
d=json.load(open(os.environ['OUT']+'/bench_4gib.json'))
for l in d['levels']:
    r=l['repeats'][0]; print(l['concurrency'], round(r['output_tokens_per_s'],1), r['peak_allocated_bytes']/2**30, r['peak_reserved_bytes']/2**30)
print(d['health']['kv_budget'])
PY
echo "[$(date +%T)] graph tests"
timeout 200 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_cuda_graph_runner.py > $OUT/gpu_tests_graphs.log 2>&1; echo "exit $?"; tail -5 $OUT/gpu_tests_graphs.log
echo "[$(date +%T)] done"
