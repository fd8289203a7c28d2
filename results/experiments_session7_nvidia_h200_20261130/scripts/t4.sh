set -u
export PYTHONUNBUFFERED=1 COLUMNS=200
T1=$PWD
mkdir -p /tmp/ta && tar -xf _run/treeA.tar -C /tmp/ta
echo "[$(date +%T)] validate (B)"
PYTHONPATH=$T1 timeout 150 python3 -m deepinfer_cli.main validate-kernels --workers 12 --no-show-passed --only quant_matmul_act_and_mul,paged_decode_attention,quant_matmul,quant_matmul_rope_cache,rms_norm --output $OUT/validate_t4.json > $OUT/validate_t4.log 2>&1
echo "validate exit $?"; tail -3 $OUT/validate_t4.log | cut -c1-200; grep -i fail $OUT/validate_t4.log | head -5
for S in 1 8; do
  echo "[$(date +%T)] streams $S"
  (cd /tmp/ta && PYTHONPATH=/tmp/ta STREAMS=$S LABEL=A VARIANTS=clustered OUT_JSON=$OUT/t4_A_$S.json timeout 120 python3 $T1/_run/tree_step.py 2>&1 | grep -v Warning | tail -1 | cut -c1-70)
  PYTHONPATH=$T1 STREAMS=$S LABEL=B VARIANTS=clustered OUT_JSON=$OUT/t4_B_$S.json timeout 120 python3 _run/tree_step.py 2>&1 | grep -v Warning | tail -1 | cut -c1-70
  [ $S = 1 ] && (cd /tmp/ta && PYTHONPATH=/tmp/ta STREAMS=$S LABEL=A2 VARIANTS=clustered OUT_JSON=$OUT/t4_A2_$S.json timeout 120 python3 $T1/_run/tree_step.py 2>&1 | grep -v Warning | tail -1 | cut -c1-70)
done
echo "[$(date +%T)] gpu tests (B)"
PYTHONPATH=$T1 timeout 200 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_kernels_gpu.py tests/test_cuda_graph_runner.py > $OUT/gpu_tests_t4.log 2>&1
echo "gpu tests exit $?"; tail -3 $OUT/gpu_tests_t4.log | cut -c1-200
