set -u
export PYTHONUNBUFFERED=1 COLUMNS=200
T1=$PWD
mkdir -p /tmp/ta && tar -xf _run/treeA.tar -C /tmp/ta
for S in 1 8 32; do
  echo "[$(date +%T)] streams $S"
  (cd /tmp/ta && PYTHONPATH=/tmp/ta STREAMS=$S LABEL=A VARIANTS=clustered OUT_JSON=$OUT/t3_A_$S.json timeout 120 python3 $T1/_run/tree_step.py 2>&1 | grep -v Warning | tail -1 | cut -c1-80)
  PYTHONPATH=$T1 STREAMS=$S LABEL=B VARIANTS=clustered OUT_JSON=$OUT/t3_B_$S.json timeout 120 python3 _run/tree_step.py 2>&1 | grep -v Warning | tail -1 | cut -c1-80
  [ $S = 1 ] && (cd /tmp/ta && PYTHONPATH=/tmp/ta STREAMS=$S LABEL=A2 VARIANTS=clustered OUT_JSON=$OUT/t3_A2_$S.json timeout 120 python3 $T1/_run/tree_step.py 2>&1 | grep -v Warning | tail -1 | cut -c1-80)
done
