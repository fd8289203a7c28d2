// Dequantize a PackedWeight (core/quant/packed.py, 3, 4 or 8 bits) into a dense [N, K] fp16/bf16 matrix, in the
// stored column order (an act-order permutation stays on the activation side).
// Many-token products (prefill chunks, large decode batches) then run on cuBLAS: one read of the
// packed weight plus one write and one read of the dense copy cost less than the W4 tensor-core
// kernels once enough tokens share the weight.
// Numerics are core.quant.packing.dequantize's: fp32, (q - z) * s or q * s + z with each operation
// rounded on its own (no fused multiply-add), then rounded to DT.
// One thread dequantizes one unit: a 32-bit word (8 codes, 16 bytes out) for W4, so a warp's loads are 128
// contiguous bytes and its stores 512; two words (8 codes, 16 bytes out) for W8; a run of 32 codes (3 words, 64 bytes
// out) for W3. A unit lies inside one
// group because the group size is a multiple of 32. Grid: (row, 256-unit block of the row), so no thread
// divides a flat index by the row length. SCALE_F32: scales/zeros are float32 (else float16).
#include "common.cuh"

template <int BITS>
__device__ __forceinline__ float code_at(const u32* words, int c) {
  if constexpr (BITS == 4) {
    return (float)((words[c >> 3] >> ((c & 7) * 4)) & 0xFu);
  } else if constexpr (BITS == 8) {
    return (float)((words[c >> 2] >> ((c & 3) * 8)) & 0xFFu);
  } else {  // 32 codes in a 96-bit little-endian run, code c at bit 3c
    const int bit = 3 * c, word = bit >> 5, shift = bit & 31;
    u32 value = words[word] >> shift;
    if (shift > 29) value |= words[word + 1] << (32 - shift);
    return (float)(value & 0x7u);
  }
}

template <int SCALE_F32>
__device__ __forceinline__ float load_scale(const void* base, i64 index) {
  if constexpr (SCALE_F32) {
    return __ldg(reinterpret_cast<const float*>(base) + index);
  } else {
    return Num<0>::to_float(__ldg(reinterpret_cast<const u16*>(base) + index));
  }
}

template <int DT, int BITS, int MIN_MODE, int SCALE_F32>
__global__ void __launch_bounds__(256) dequantize_kernel(
    const u32* __restrict__ qweight,  // [N, K * BITS / 32]
    const void* __restrict__ scales,  // [N, K / group_size]
    const void* __restrict__ zeros,   // [N, K / group_size]
    u16* __restrict__ out,            // [N, K]
    int rows, int in_features, int group_size) {
  launch_dependents();
  wait_for_prior_grids();
  constexpr int CODES = BITS == 3 ? 32 : 8, WORDS = CODES * BITS / 32;  // a unit's codes and packed words
  const int row = blockIdx.x, unit = blockIdx.y * blockDim.x + threadIdx.x;
  if (unit >= in_features / CODES) return;
  const i64 group = (i64)row * (in_features / group_size) + unit * CODES / group_size;
  const float scale = load_scale<SCALE_F32>(scales, group);
  const float zero = load_scale<SCALE_F32>(zeros, group);
  const u32* src = qweight + (i64)row * (in_features / 32 * BITS) + (i64)unit * WORDS;
  u32 words[WORDS];
#pragma unroll
  for (int w = 0; w < WORDS; ++w) words[w] = __ldg(src + w);
  u16* dst = out + (i64)row * in_features + (i64)unit * CODES;
#pragma unroll
  for (int c = 0; c < CODES; c += 8) {
    uint4 vec;
    u32* pairs = reinterpret_cast<u32*>(&vec);
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const float q0 = code_at<BITS>(words, c + 2 * p), q1 = code_at<BITS>(words, c + 2 * p + 1);
      const float w0 = MIN_MODE ? __fadd_rn(__fmul_rn(q0, scale), zero) : __fmul_rn(__fsub_rn(q0, zero), scale);
      const float w1 = MIN_MODE ? __fadd_rn(__fmul_rn(q1, scale), zero) : __fmul_rn(__fsub_rn(q1, zero), scale);
      pairs[p] = Num<DT>::pack(w0, w1);
    }
    *reinterpret_cast<uint4*>(dst + c) = vec;
  }
}
