"""Experiment tree edit: tc_segment's two mma of a word go to two accumulator chains (4 dependent mma a segment
instead of 8), summed at the end."""
import sys
p = sys.argv[1] + "/kernels/quant_matmul.cu"
s = open(p).read()
old = """#pragma unroll
  for (int cw = 0; cw < 4; ++cw) {  // word cw of the chunk: k-steps 2cw and 2cw + 1
    u32 a[2][4];
#pragma unroll
    for (int r = 0; r < 2; ++r) tc_unpack_word<DT, MODE>(wr[r][cw], lo_off[r], hi_off[r], s2[r], b2[r], a[r]);
#pragma unroll
    for (int tt = 0; tt < TT; ++tt) {
      const uint4 v = xsrc.get(tt, cw);
      Num<DT>::mma(c[tt], a[0][0], a[1][0], a[0][1], a[1][1], v.x, v.y);
      Num<DT>::mma(c[tt], a[0][2], a[1][2], a[0][3], a[1][3], v.z, v.w);
    }
  }
}"""
new = """  float c2[TT][4];
#pragma unroll
  for (int tt = 0; tt < TT; ++tt) c2[tt][0] = c2[tt][1] = c2[tt][2] = c2[tt][3] = 0.0f;
#pragma unroll
  for (int cw = 0; cw < 4; ++cw) {  // word cw of the chunk: k-steps 2cw and 2cw + 1
    u32 a[2][4];
#pragma unroll
    for (int r = 0; r < 2; ++r) tc_unpack_word<DT, MODE>(wr[r][cw], lo_off[r], hi_off[r], s2[r], b2[r], a[r]);
#pragma unroll
    for (int tt = 0; tt < TT; ++tt) {
      const uint4 v = xsrc.get(tt, cw);
      Num<DT>::mma(c[tt], a[0][0], a[1][0], a[0][1], a[1][1], v.x, v.y);
      Num<DT>::mma(c2[tt], a[0][2], a[1][2], a[0][3], a[1][3], v.z, v.w);
    }
  }
#pragma unroll
  for (int tt = 0; tt < TT; ++tt)
#pragma unroll
    for (int e = 0; e < 4; ++e) c[tt][e] += c2[tt][e];
}"""
assert s.count(old) == 1
open(p, "w").write(s.replace(old, new))
