set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
OUT_JSON=$OUT/pf_A_B1.json timeout 300 python3 _run/l2pf.py 2>&1 | grep -v Warning
STREAMS=32 SEQS=32 PARTS=B VARIANTS=base,layer_start,layer_start_big,after_norm_qkv,base_end OUT_JSON=$OUT/pf_B32.json timeout 200 python3 _run/l2pf.py 2>&1 | grep -v Warning
