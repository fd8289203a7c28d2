"""Experiment tree edit: tc prefetches each segment's activations into L1 when it issues the segment's weight
loads (after the PDL wait), so the segment's x reads hit L1 instead of waiting an L2 round trip."""
import sys
root = sys.argv[1]
p = root + "/kernels/quant_matmul.cu"
s = open(p).read()
old = """  wait_for_prior_grids();
  for (; seg < num_segs; seg += 4 * stride) {
    if (seg + 2 * stride < num_segs) tc_load(b0, rows, seg + 2 * stride, t, group_shift);
    if (seg + 3 * stride < num_segs) tc_load(b1, rows, seg + 3 * stride, t, group_shift);"""
new = """  wait_for_prior_grids();
  auto xpf = [&](int s) {
    if (s < num_segs && tok_g < M)
      asm volatile("prefetch.global.L1 [%0];" :: "l"(x + (i64)tok_g * K + s * 128 + t * 32));
  };
  xpf(seg); xpf(seg + stride);
  for (; seg < num_segs; seg += 4 * stride) {
    xpf(seg + 2 * stride); xpf(seg + 3 * stride);
    if (seg + 2 * stride < num_segs) tc_load(b0, rows, seg + 2 * stride, t, group_shift);
    if (seg + 3 * stride < num_segs) tc_load(b1, rows, seg + 3 * stride, t, group_shift);"""
assert s.count(old) == 1; s = s.replace(old, new)
old2 = """    if (seg + 4 * stride < num_segs) tc_load(a0, rows, seg + 4 * stride, t, group_shift);
    if (seg + 5 * stride < num_segs) tc_load(a1, rows, seg + 5 * stride, t, group_shift);"""
new2 = """    xpf(seg + 4 * stride); xpf(seg + 5 * stride);
    if (seg + 4 * stride < num_segs) tc_load(a0, rows, seg + 4 * stride, t, group_shift);
    if (seg + 5 * stride < num_segs) tc_load(a1, rows, seg + 5 * stride, t, group_shift);"""
assert s.count(old2) == 1; s = s.replace(old2, new2)
open(p, "w").write(s)
