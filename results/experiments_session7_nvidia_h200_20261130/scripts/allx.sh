set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT_JSON=$OUT/allx_A_B1.json timeout 300 python3 _run/allx.py 2>&1 | grep -v Warning
STREAMS=8 SEQS=8 PARTS=B OUT_JSON=$OUT/allx_B8.json timeout 150 python3 _run/allx.py 2>&1 | grep -v Warning
