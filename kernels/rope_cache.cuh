// Stores of one head's new K or V row into the paged KV cache, in each cache storage (template argument KV):
//   KV_PLAIN: the activations' dtype DT;
//   KV_INT8:  int8 codes round(x / s), s the fp16 per-token, per-head scale DT-rounded amax(|x|) / 127,
//             beside the codes in [NB, KVH, BS] (core/kv/cache.quantize_int8);
//   KV_E4M3:  the float8 e4m3 code of x / s, s the KV head's fixed fp32 scale [KVH], saturated at ±448
//             (core/kv/cache.quantize_fp8).
// rope_cache_kernel (rope_cache.cu) and quant_tc_rope_kernel's epilogue (quant_matmul.cu) both store with these,
// so their cache rows are the same bits.
#include "common.cuh"

constexpr int KV_PLAIN = 0, KV_INT8 = 1, KV_E4M3 = 2;

// This lane's elements i = lane + 32 p and i + half_dim of a head (vals: up to 4 pairs) into dst [D], in DT.
template <int DT>
__device__ __forceinline__ void store_pairs(u16* dst, const float* vals, int lane, int half_dim) {
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const int i = lane + 32 * p;
    if (i < half_dim) {
      dst[i] = Num<DT>::from_float(vals[2 * p]);
      dst[i + half_dim] = Num<DT>::from_float(vals[2 * p + 1]);
    }
  }
}

// x saturated at ±448 and rounded to the nearest e4m3 code, ties to even (torch's cast of the clamped value).
__device__ __forceinline__ unsigned char float_to_e4m3(float x) {
  const u32 sign = (__float_as_uint(x) >> 24) & 0x80u;
  const float a = fminf(fabsf(x), 448.0f);
  u32 code;
  if (a < 0.015625f) {  // below 2^-6: subnormal codes m * 2^-9, m = 0..8 (m = 8 is 2^-6, code 0x08)
    code = (u32)__float2int_rn(a * 512.0f);
  } else {  // round the fp32 mantissa to 3 bits (a carry bumps the exponent), then rebias 127 -> 7
    const u32 bits = __float_as_uint(a);
    code = ((bits + 0x7FFFFu + ((bits >> 20) & 1u)) >> 20) - (120u << 3);
  }
  return (unsigned char)(sign | code);
}

// The int8 code of x over the (fp16-rounded) scale, saturated at ±127.
__device__ __forceinline__ signed char int8_code(float x, float scale) {
  return (signed char)fminf(fmaxf(rintf(x / scale), -127.0f), 127.0f);
}

// One head's row [D] at cache + row (elements), by a whole warp: vals holds this lane's elements i = lane + 32 p
// and i + half_dim (DT-rounded values as floats), up to 4 pairs (D <= 256). scales: int8 [NB, KVH, BS] fp16, the
// row's at scale_index; e4m3 [KVH] fp32, the row's at kv_head; unused for KV_PLAIN.
template <int DT, int KV>
__device__ __forceinline__ void store_head(void* cache, void* scales, i64 row, i64 scale_index, int kv_head,
                                           const float* vals, int lane, int half_dim) {
  if constexpr (KV == KV_E4M3) {
    const float scale = reinterpret_cast<const float*>(scales)[kv_head];
    unsigned char* dst = reinterpret_cast<unsigned char*>(cache) + row;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const int i = lane + 32 * p;
      if (i < half_dim) {
        dst[i] = float_to_e4m3(vals[2 * p] / scale);
        dst[i + half_dim] = float_to_e4m3(vals[2 * p + 1] / scale);
      }
    }
  } else if constexpr (KV == KV_INT8) {
    float amax = 0.0f;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      if (lane + 32 * p < half_dim) amax = fmaxf(amax, fmaxf(fabsf(vals[2 * p]), fabsf(vals[2 * p + 1])));
    }
    amax = warp_max(amax);
    const u16 scale_bits = Num<0>::from_float(fmaxf(amax, 1e-8f) / 127.0f);
    const float scale = half_bits_to_float(scale_bits);
    signed char* dst = reinterpret_cast<signed char*>(cache) + row;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const int i = lane + 32 * p;
      if (i < half_dim) {
        dst[i] = int8_code(vals[2 * p], scale);
        dst[i + half_dim] = int8_code(vals[2 * p + 1], scale);
      }
    }
    if (lane == 0) reinterpret_cast<u16*>(scales)[scale_index] = scale_bits;
  } else {
    store_pairs<DT>(reinterpret_cast<u16*>(cache) + row, vals, lane, half_dim);
  }
}
