set -u
export PYTHONUNBUFFERED=1 COLUMNS=200 PYTHONPATH=.
mkdir -p /tmp/o
echo "[$(date +%T)] gpu tests"
timeout 240 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_kernels_gpu.py tests/test_cuda_graph_runner.py \
  tests/test_quantized_engine.py tests/test_async_scheduling.py > /tmp/o/gpu_tests.log 2>&1; echo "gpu tests exit $?"; tail -6 /tmp/o/gpu_tests.log
echo "[$(date +%T)] validate"
timeout 200 python3 -m deepinfer_cli.main validate-kernels --workers 12 --no-show-passed \
  --only quant_matmul_rope_cache,paged_decode_attention,rope_cache_write,cuda_graph,end_to_end \
  --output /tmp/o/validate.json > /tmp/o/validate.log 2>&1; echo "validate exit $?"; tail -8 /tmp/o/validate.log
rm -rf /tmp/old && mkdir -p /tmp/old && tar -xf _run/old.tar -C /tmp/old && cp _run/ablate.py /tmp/old/_run_ablate.py
for s in 1 32; do
  echo "[$(date +%T)] steps new, $s streams"; STREAMS=$s SEQS=$s OUT_JSON=/tmp/o/ablate_new_$s.json timeout 150 python3 _run/ablate.py base unfused > /tmp/o/ablate_new_$s.log 2>&1; tail -4 /tmp/o/ablate_new_$s.log
  echo "[$(date +%T)] steps old, $s streams"; (cd /tmp/old && STREAMS=$s SEQS=$s PYTHONPATH=/tmp/old OUT_JSON=/tmp/o/ablate_old_$s.json timeout 150 python3 _run_ablate.py base > /tmp/o/ablate_old_$s.log 2>&1; tail -3 /tmp/o/ablate_old_$s.log)
done
cd /tmp/o && tar -czf $OUT/exp2.tgz . && echo "[$(date +%T)] end"
