set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD COLUMNS=200
echo "[$(date +%T)] validate"
timeout 150 python3 -m deepinfer_cli.main validate-kernels --workers 12 --no-show-passed --only quant_matmul_act_and_mul,act_and_mul,quant_matmul --output $OUT/validate_act.json > $OUT/validate_act.log 2>&1
echo "validate exit $?"; tail -8 $OUT/validate_act.log
echo "[$(date +%T)] steps"
OUT_JSON=$OUT/act_A_B1.json timeout 200 python3 _run/actstep.py 2>&1 | grep -v Warning
STREAMS=32 SEQS=32 PARTS=B OUT_JSON=$OUT/act_B32.json timeout 150 python3 _run/actstep.py 2>&1 | grep -v Warning
echo "[$(date +%T)] gpu tests"
timeout 240 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_kernels_gpu.py tests/test_cuda_graph_runner.py > $OUT/gpu_tests_act.log 2>&1
echo "gpu tests exit $?"; tail -8 $OUT/gpu_tests_act.log
