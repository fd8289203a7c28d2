set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 COLUMNS=200
echo "[$(date +%T)] validate"
timeout 150 python3 -m deepinfer_cli.main validate-kernels --only paged_prefill_attention,paged_decode_attention --output $OUT/val.json > $OUT/val.log 2>&1
echo "exit $?"; grep -iE "fail|passed|error" $OUT/val.log | head -20
echo "[$(date +%T)] gpu tests"
timeout 200 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_cuda_graph_runner.py tests/test_kernels_gpu.py -k "prefill or graphs_match or paged" > $OUT/tests.log 2>&1
echo "exit $?"; tail -5 $OUT/tests.log | cut -c1-300
echo "[$(date +%T)] profile"
timeout 150 python3 _run/prefill_prof.py $OUT/prefill_prof.json 2>&1 | grep -v -i warn | head -40
echo "[$(date +%T)] done"
