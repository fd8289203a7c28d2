// Gated activation: out = act(gate) * up, element-wise, with the reference's roundings:
// act computed in fp32 and rounded to DT, then the product rounded to DT.
// ACT 0 = SiLU (x / (1 + e^-x)), 1 = GeLU tanh approximation.
// INTERLEAVED 0: gate and up are rows of their own tensors (or the two halves of one merged [T, 2I] tensor): row t
// of gate starts at gate + t * gate_stride. INTERLEAVED 1: both point into one [T, 2I] product whose columns hold
// gate and up in 8-column blocks (column 16 b + j: gate column 8 b + j; 16 b + 8 + j: its up column), gate at the
// product, up 8 elements after it: output block b reads input block 2 b of each.
// Each thread handles 8 consecutive outputs.
#include "common.cuh"

template <int DT, int ACT, int INTERLEAVED>
__global__ void __launch_bounds__(256) act_and_mul_kernel(
    const u16* __restrict__ gate, const u16* __restrict__ up, u16* __restrict__ out,  // out [T, I]
    int num_tokens, int inner, i64 gate_stride, i64 up_stride) {
  launch_dependents();
  wait_for_prior_grids();
  const int vectors_per_row = inner / 8;
  const i64 total = (i64)num_tokens * vectors_per_row;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
    const i64 tok = i / vectors_per_row;
    const int col = (int)(i - tok * vectors_per_row) * 8;
    const int in_col = INTERLEAVED ? 2 * col : col;
    const uint4 gv = __ldg(reinterpret_cast<const uint4*>(gate + tok * gate_stride + in_col));
    const uint4 uv = __ldg(reinterpret_cast<const uint4*>(up + tok * up_stride + in_col));
    const u32* ga = reinterpret_cast<const u32*>(&gv);
    const u32* ua = reinterpret_cast<const u32*>(&uv);
    uint4 ov;
    u32* oa = reinterpret_cast<u32*>(&ov);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float act_lo = Num<DT>::to_float(Num<DT>::from_float(gate_activation<ACT>(pair_lo<DT>(ga[j]))));
      const float act_hi = Num<DT>::to_float(Num<DT>::from_float(gate_activation<ACT>(pair_hi<DT>(ga[j]))));
      oa[j] = Num<DT>::pack(act_lo * pair_lo<DT>(ua[j]), act_hi * pair_hi<DT>(ua[j]));
    }
    *reinterpret_cast<uint4*>(out + tok * inner + col) = ov;
  }
}
