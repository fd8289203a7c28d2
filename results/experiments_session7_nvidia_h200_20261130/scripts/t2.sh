set -u
export PYTHONUNBUFFERED=1 COLUMNS=200
T1=$PWD
mkdir -p /tmp/t0 && tar -xf _run/head.tar -C /tmp/t0
echo "[$(date +%T)] validate (T1)"
PYTHONPATH=$T1 timeout 150 python3 -m deepinfer_cli.main validate-kernels --workers 12 --no-show-passed --only quant_matmul,rms_norm,quant_matmul_act_and_mul,quant_matmul_rope_cache --output $OUT/validate_t2.json > $OUT/validate_t2.log 2>&1
echo "validate exit $?"; tail -3 $OUT/validate_t2.log | cut -c1-200
for S in 1 8 32; do
  echo "[$(date +%T)] streams $S"
  (cd /tmp/t0 && PYTHONPATH=/tmp/t0 STREAMS=$S LABEL=head VARIANTS=split OUT_JSON=$OUT/t2_head_$S.json timeout 120 python3 $T1/_run/tree_step.py 2>&1 | grep -v Warning | tail -2)
  V=split,clustered; [ $S = 32 ] && V=split
  PYTHONPATH=$T1 STREAMS=$S LABEL=new VARIANTS=$V OUT_JSON=$OUT/t2_new_$S.json timeout 150 python3 _run/tree_step.py 2>&1 | grep -v Warning | tail -3
done
