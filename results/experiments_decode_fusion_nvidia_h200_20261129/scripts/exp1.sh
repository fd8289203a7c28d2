set -u
export PYTHONUNBUFFERED=1 COLUMNS=200 PYTHONPATH=.
mkdir -p /tmp/o
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > /tmp/o/gpu.txt
echo "[$(date +%T)] prod base"; TOKENS=1,4 OUT_JSON=/tmp/o/prod_base.json timeout 150 python3 _run/prod_bench.py 2>&1 | tail -9
for v in chains xsmem xpf; do
  rm -rf /tmp/t_$v && mkdir -p /tmp/t_$v && tar --exclude=./results --exclude=./.git -cf - . | tar -xf - -C /tmp/t_$v
  python3 _run/${v}_patch.py /tmp/t_$v || echo "patch $v failed"
  echo "[$(date +%T)] prod $v"; (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v TOKENS=1,4 OUT_JSON=/tmp/o/prod_$v.json timeout 150 python3 _run/prod_bench.py 2>&1 | tail -9)
done
echo "[$(date +%T)] ablate base"; OUT_JSON=/tmp/o/ablate_base.json timeout 300 python3 _run/ablate.py > /tmp/o/ablate_base.log 2>&1; tail -12 /tmp/o/ablate_base.log
for v in xsmem xpf chains; do
  echo "[$(date +%T)] step $v"; (cd /tmp/t_$v && PYTHONPATH=/tmp/t_$v OUT_JSON=/tmp/o/ablate_$v.json timeout 150 python3 _run/ablate.py base > /tmp/o/ablate_$v.log 2>&1; tail -3 /tmp/o/ablate_$v.log)
done
cd /tmp/o && tar -czf $OUT/exp1.tgz . && echo "[$(date +%T)] end"
