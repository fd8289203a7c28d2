set -u
export PYTHONUNBUFFERED=1 COLUMNS=200 PYTHONPATH=.
mkdir -p /tmp/o
echo "[$(date +%T)] gpu tests"
timeout 300 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_cuda_graph_runner.py tests/test_kernels_gpu.py \
  tests/test_quantized_engine.py tests/test_async_scheduling.py > /tmp/o/gpu_tests.log 2>&1; echo "gpu tests exit $?"; grep -E "passed|failed|FAILED" /tmp/o/gpu_tests.log | tail -8
for s in 1 32; do
  echo "[$(date +%T)] steps new, $s streams"; STREAMS=$s SEQS=$s OUT_JSON=/tmp/o/ablate_new_$s.json timeout 150 python3 _run/ablate.py base unfused > /tmp/o/ablate_new_$s.log 2>&1; tail -4 /tmp/o/ablate_new_$s.log
done
cd /tmp/o && tar -czf $OUT/exp4.tgz . && echo "[$(date +%T)] end"
