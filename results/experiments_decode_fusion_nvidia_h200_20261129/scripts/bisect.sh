set -u
export PYTHONUNBUFFERED=1 COLUMNS=200
mkdir -p /tmp/o
variant() {  # name, python edit of kernels/paged_attention.cu
  rm -rf /tmp/v_$1 && mkdir -p /tmp/v_$1 && tar --exclude=./results --exclude=./.git --exclude=./_run -cf - . | tar -xf - -C /tmp/v_$1
  (cd /tmp/v_$1 && python3 -c "
p='kernels/paged_attention.cu'; s=open(p).read()
$2
open(p,'w').write(s)" && echo "[$(date +%T)] $1" && PYTHONPATH=/tmp/v_$1 timeout 240 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_cuda_graph_runner.py -k "fused_qkv or programmatic" > /tmp/o/bisect_$1.log 2>&1; echo "$1 exit $?"; tail -1 /tmp/o/bisect_$1.log)
}
variant base "pass"
variant noearly "s=s.replace('const bool settled_first_tile = first + 15 < seq_len - fresh_tokens;', 'const bool settled_first_tile = false;')"
variant fresh64 "s=s.replace('const bool settled_first_tile = first + 15 < seq_len - fresh_tokens;', 'const bool settled_first_tile = first + 15 < seq_len - fresh_tokens - 64;')"
variant coherent "s=s.replace('__ldg(reinterpret_cast<const uint4*>(reinterpret_cast<const u16*>(base) + index))', '*(reinterpret_cast<const uint4*>(reinterpret_cast<const u16*>(base) + index))').replace('__ldg(reinterpret_cast<const uint2*>(reinterpret_cast<const u16*>(base) + index))', '*(reinterpret_cast<const uint2*>(reinterpret_cast<const u16*>(base) + index))'); s=s.replace('ctx.table[tok', '((volatile const int*)ctx.table)[tok')"
cd /tmp/o && tar -czf $OUT/bisect.tgz bisect_* && echo "[$(date +%T)] end"
