// RMSNorm with an optional fused residual add, matching core/ops/norm.py's reference roundings:
//   sum = x + residual (rounded to DT; written out as the new residual)
//   Llama (OFFSET == 0): out = weight * DT(sum * rsqrt(mean(sum^2) + eps))      (product rounded once)
//   Gemma (OFFSET == 1): out = DT(sum * rsqrt(mean(sum^2) + eps) * (offset + weight)), all in fp32
// One CTA per row; each thread handles 8 consecutive elements per step (hidden % 8 == 0).
#include "common.cuh"

template <int DT, int HAS_RESIDUAL, int OFFSET>
__global__ void __launch_bounds__(256) rms_norm_kernel(
    const u16* __restrict__ x,         // [T, hidden]
    const u16* __restrict__ residual,  // [T, hidden] or null
    const u16* __restrict__ weight,    // [hidden]
    u16* __restrict__ out,             // [T, hidden]
    u16* __restrict__ residual_out,    // [T, hidden] (HAS_RESIDUAL)
    int hidden, float eps, float weight_offset) {
  launch_dependents();
  // the weights of the thread's held vectors (below) are no kernel's output: loaded before the PDL wait
  constexpr int HELD = 2;
  const uint4* wv = reinterpret_cast<const uint4*>(weight);
  const int vectors = hidden / 8;
  uint4 held_weight[HELD];
#pragma unroll
  for (int k = 0; k < HELD; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < vectors) held_weight[k] = __ldg(wv + i);
  }
  wait_for_prior_grids();
  const i64 row = blockIdx.x;
  const uint4* xv = reinterpret_cast<const uint4*>(x + row * hidden);
  const uint4* rv = reinterpret_cast<const uint4*>(residual + row * hidden);
  uint4* sv = reinterpret_cast<uint4*>(residual_out + row * hidden);

  // The sum x + residual of a thread's first HELD vectors stays in registers for the second pass (re-reading the
  // new residual from global memory would add an L2 round trip); vectors past them (hidden > 8 * HELD * threads,
  // i.e. past 4096 at 256 threads) are re-read. A thread sums its squares in vector order either way.
  uint4 held[HELD];
  float sum_sq = 0.0f;
  auto sum_vector = [&](int i) {
    uint4 v = xv[i];
    if constexpr (HAS_RESIDUAL) {
      const uint4 r = rv[i];
      u32* a = reinterpret_cast<u32*>(&v);
      const u32* b = reinterpret_cast<const u32*>(&r);
#pragma unroll
      for (int j = 0; j < 4; ++j)
        a[j] = Num<DT>::pack(pair_lo<DT>(a[j]) + pair_lo<DT>(b[j]), pair_hi<DT>(a[j]) + pair_hi<DT>(b[j]));
      sv[i] = v;
    }
    const u32* a = reinterpret_cast<const u32*>(&v);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float lo = pair_lo<DT>(a[j]), hi = pair_hi<DT>(a[j]);
      sum_sq = fmaf(lo, lo, fmaf(hi, hi, sum_sq));
    }
    return v;
  };
#pragma unroll
  for (int k = 0; k < HELD; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < vectors) held[k] = sum_vector(i);
  }
  for (int i = threadIdx.x + HELD * blockDim.x; i < vectors; i += blockDim.x) sum_vector(i);

  // one barrier: every warp sums the warps' partial sums with the same butterfly (the same value in every lane)
  __shared__ float warp_sums[32];
  sum_sq = warp_sum(sum_sq);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = sum_sq;
  __syncthreads();
  const float total = warp_sum((threadIdx.x & 31) < (blockDim.x + 31) / 32 ? warp_sums[threadIdx.x & 31] : 0.0f);
  const float inv_rms = rsqrtf(total / (float)hidden + eps);

  const uint4* src = HAS_RESIDUAL ? reinterpret_cast<const uint4*>(sv) : xv;  // past the held vectors: re-read
  uint4* ov = reinterpret_cast<uint4*>(out + row * hidden);
  auto normalize_vector = [&](int i, uint4 v, uint4 w) {
    u32* a = reinterpret_cast<u32*>(&v);
    const u32* b = reinterpret_cast<const u32*>(&w);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float lo = pair_lo<DT>(a[j]) * inv_rms, hi = pair_hi<DT>(a[j]) * inv_rms;
      if constexpr (OFFSET) {
        lo *= weight_offset + pair_lo<DT>(b[j]);
        hi *= weight_offset + pair_hi<DT>(b[j]);
      } else {
        lo = pair_lo<DT>(b[j]) * Num<DT>::to_float(Num<DT>::from_float(lo));
        hi = pair_hi<DT>(b[j]) * Num<DT>::to_float(Num<DT>::from_float(hi));
      }
      a[j] = Num<DT>::pack(lo, hi);
    }
    ov[i] = v;
  };
#pragma unroll
  for (int k = 0; k < HELD; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < vectors) normalize_vector(i, held[k], held_weight[k]);
  }
  for (int i = threadIdx.x + HELD * blockDim.x; i < vectors; i += blockDim.x) normalize_vector(i, src[i], __ldg(wv + i));
}
