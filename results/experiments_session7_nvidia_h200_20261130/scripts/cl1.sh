set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD COLUMNS=200
echo "[$(date +%T)] validate"
timeout 150 python3 -m deepinfer_cli.main validate-kernels --workers 12 --no-show-passed --only paged_decode_attention --output $OUT/validate_cl.json > $OUT/validate_cl.log 2>&1
echo "validate exit $?"; tail -25 $OUT/validate_cl.log | cut -c1-220
echo "[$(date +%T)] steps"
OUT_JSON=$OUT/cl_B1.json timeout 150 python3 _run/clstep.py 2>&1 | grep -v Warning | tail -8
STREAMS=8 SEQS=8 OUT_JSON=$OUT/cl_B8.json timeout 150 python3 _run/clstep.py 2>&1 | grep -v Warning | tail -6
echo "[$(date +%T)] gpu tests"
timeout 200 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_kernels_gpu.py tests/test_cuda_graph_runner.py > $OUT/gpu_tests_cl.log 2>&1
echo "gpu tests exit $?"; tail -8 $OUT/gpu_tests_cl.log | cut -c1-300
