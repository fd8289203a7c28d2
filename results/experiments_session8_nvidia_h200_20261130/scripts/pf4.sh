set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 COLUMNS=200
echo "[$(date +%T)] validate"
timeout 150 python3 -m deepinfer_cli.main validate-kernels --only paged_prefill_attention,paged_decode_attention --output $OUT/val.json > $OUT/val.log 2>&1
echo "exit $?"; grep -iE "fail|checks" $OUT/val.log | head -10
echo "[$(date +%T)] gpu tests"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_cuda_graph_runner.py tests/test_kernels_gpu.py > $OUT/tests.log 2>&1
echo "exit $?"; tail -3 $OUT/tests.log | cut -c1-300
echo "[$(date +%T)] micro"
timeout 100 python3 _run/attn_micro.py $OUT/attn_micro.json 2>&1 | grep -v -i warn | grep -v dequant
echo "[$(date +%T)] jitter"
timeout 100 python3 -m deepinfer_cli.main bench jitter --dummy-weights --shape qwen2.5-3b --quantization w4a16 --max-model-len 4096 --token-budgets 16,32,64,128,256,512,1024,2048 --long-prompt-len 2048 --insert-after 16 --itl-slo-ms 8 --max-num-seqs 4 --kv-cache-memory 4GiB --output $OUT/jitter.json > $OUT/jitter.log 2>&1
echo "exit $?"; grep -A 14 "budget" $OUT/jitter.log | head -30
echo "[$(date +%T)] done"
