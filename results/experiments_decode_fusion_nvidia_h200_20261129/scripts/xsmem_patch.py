"""Experiment tree edit: tc stages the tile's activations in shared memory once per CTA (after the PDL wait),
so a segment's x fragments are LDS instead of an L2 round trip each; launcher passes the dynamic smem."""
import sys, re
root = sys.argv[1]
p = root + "/kernels/quant_matmul.cu"
s = open(p).read()
old_x = """struct TcGlobalX {  // read from x (tc): the thread's token g of each tile, zeros past M
  const u16* x;
  int seg, t, tok_g, M, K;
  __device__ __forceinline__ uint4 get(int tt, int cw) const {
    const uint4* xs = reinterpret_cast<const uint4*>(x + (i64)tok_g * K) + seg * 16 + t * 4;
    uint4 u = make_uint4(0u, 0u, 0u, 0u);
    if (tok_g + tt * 8 < M) u = __ldg(xs + (i64)tt * 8 * (K / 8) + cw);"""
new_x = """struct TcGlobalX {  // read from x (tc): the thread's token g of each tile, zeros past M
  const u16* x;
  int seg, t, tok_g, M, K;
  const uint4* stage;  // [rows][K / 8 + 1] or null
  int g;
  __device__ __forceinline__ uint4 get(int tt, int cw) const {
    uint4 u = make_uint4(0u, 0u, 0u, 0u);
    if (stage != nullptr) {
      if (tok_g + tt * 8 < M) u = stage[(g + tt * 8) * (K / 8 + 1) + seg * 16 + t * 4 + cw];
    } else {
      const uint4* xs = reinterpret_cast<const uint4*>(x + (i64)tok_g * K) + seg * 16 + t * 4;
      if (tok_g + tt * 8 < M) u = __ldg(xs + (i64)tt * 8 * (K / 8) + cw);
    }"""
assert s.count(old_x) == 1; s = s.replace(old_x, new_x)
old_l = """  auto xat = [&](int s) { return TcGlobalX{x, s, t, tok_g, M, K}; };
  int seg = warp;
  if (seg < num_segs) tc_load(a0, rows, seg, t, group_shift);
  if (seg + stride < num_segs) tc_load(a1, rows, seg + stride, t, group_shift);
  wait_for_prior_grids();"""
new_l = """  extern __shared__ uint4 xstage[];
  u32 dyn;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
  const uint4* stage = dyn > 0 ? xstage : nullptr;
  auto xat = [&](int s) { return TcGlobalX{x, s, t, tok_g, M, K, stage, g}; };
  int seg = warp;
  if (seg < num_segs) tc_load(a0, rows, seg, t, group_shift);
  if (seg + stride < num_segs) tc_load(a1, rows, seg + stride, t, group_shift);
  wait_for_prior_grids();
  if (dyn > 0) {
    const int row_words = K / 8, rows_here = min(M - tok0, 8 * TT);
    for (int i = threadIdx.x; i < rows_here * row_words; i += blockDim.x) {
      const int r = i / row_words, c = i - r * row_words;
      xstage[r * (row_words + 1) + c] = __ldg(reinterpret_cast<const uint4*>(x + (i64)(tok0 + r) * K) + c);
    }
    __syncthreads();
  }"""
assert s.count(old_l) == 1; s = s.replace(old_l, new_l)
open(p, "w").write(s)
p = root + "/kernels/quant_matmul.py"
s = open(p).read()
old = """    if name in ("gemv", "stream", "ksplit", "tc"):
        launch(fn, grid, block, head + sizes, index)
        return out"""
new = """    if name == "tc":
        smem = min(num_tokens, 8 * tile) * (in_features // 8 + 1) * 16
        launch(fn, grid, block, head + sizes, index, shared_mem=smem if smem <= 40 * 1024 else 0)
        return out
    if name in ("gemv", "stream", "ksplit"):
        launch(fn, grid, block, head + sizes, index)
        return out"""
assert s.count(old) == 1; s = s.replace(old, new)
open(p, "w").write(s)
