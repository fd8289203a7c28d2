// Rotary embedding (HF rotate-half layout) on q and k, fused with the paged KV-cache write of the
// rotated k and of v at `slot_mapping`. With HAS_ROPE == 0 only the cache write happens.
// Roundings follow the torch reference (core/layers.apply_rope): x1*cos and x2*sin are each rounded
// to DT, then their difference (sum) is rounded. The cache rows go in as rope_cache.cuh's store_head stores them
// in the cache's storage KV (16-bit, int8 with per-token scales, e4m3 with per-head scales).
// grid: (token, head group): the heads of a token (q heads, then k heads, then v heads) are dealt
// out to the warps of its gridDim.y CTAs, one head per warp when there are enough CTAs (a decode
// step's token then costs one memory round trip, not one per head); lanes walk the D/2 rotation
// pairs (i, i + D/2) of a head.
#include "rope_cache.cuh"

template <int DT, int KV, int HAS_ROPE>
__global__ void __launch_bounds__(128) rope_cache_kernel(
    const u16* __restrict__ query,   // [T, H, D], token stride q_stride
    const u16* __restrict__ key,     // [T, KVH, D], token stride k_stride
    const u16* __restrict__ value,   // [T, KVH, D], token stride v_stride
    const u16* __restrict__ cos,     // [T, D/2]
    const u16* __restrict__ sin,     // [T, D/2]
    u16* __restrict__ query_out,     // [T, H, D] contiguous (HAS_ROPE)
    u16* __restrict__ key_out,       // [T, KVH, D] contiguous (HAS_ROPE)
    void* __restrict__ key_cache,    // [NB, KVH, BS, D]
    void* __restrict__ value_cache,  // [NB, KVH, BS, D]
    void* __restrict__ key_scales,   // int8: [NB, KVH, BS] fp16; e4m3: [KVH] fp32
    void* __restrict__ value_scales, // int8: [NB, KVH, BS] fp16; e4m3: [KVH] fp32
    const i64* __restrict__ slot_mapping,  // [T]
    int num_heads, int num_kv_heads, int head_dim, int log2_block_size,
    i64 q_stride, i64 k_stride, i64 v_stride) {
  launch_dependents();
  wait_for_prior_grids();
  const i64 tok = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int half_dim = head_dim / 2;
  const i64 slot = slot_mapping[tok];
  const int block_size = 1 << log2_block_size;
  const i64 blk = slot >> log2_block_size, off = slot & (block_size - 1);

  const int first_head = HAS_ROPE ? 0 : num_heads;  // without rope q is untouched
  for (int head = first_head + blockIdx.y * warps + warp; head < num_heads + 2 * num_kv_heads;
       head += warps * gridDim.y) {
    const bool is_q = head < num_heads, is_k = !is_q && head < num_heads + num_kv_heads;
    const int kv_head = is_q ? 0 : (is_k ? head - num_heads : head - num_heads - num_kv_heads);
    const u16* src = is_q ? query + tok * q_stride + (i64)head * head_dim
                          : (is_k ? key + tok * k_stride : value + tok * v_stride) + (i64)kv_head * head_dim;
    float vals[8];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const int i = lane + 32 * p;
      float x1 = 0.0f, x2 = 0.0f;
      if (i < half_dim) {
        x1 = Num<DT>::to_float(src[i]);
        x2 = Num<DT>::to_float(src[i + half_dim]);
        if (HAS_ROPE && (is_q || is_k)) {
          rotate_pair<DT>(x1, x2, Num<DT>::to_float(cos[tok * half_dim + i]),
                          Num<DT>::to_float(sin[tok * half_dim + i]));
        }
      }
      vals[2 * p] = x1;
      vals[2 * p + 1] = x2;
    }
    if (HAS_ROPE && (is_q || is_k)) {
      u16* dst = is_q ? query_out + (tok * num_heads + head) * head_dim : key_out + (tok * num_kv_heads + kv_head) * head_dim;
      store_pairs<DT>(dst, vals, lane, half_dim);
    }
    if (is_q || slot < 0) continue;
    const i64 slot_row = (blk * num_kv_heads + kv_head) * block_size + off;
    store_head<DT, KV>(is_k ? key_cache : value_cache, is_k ? key_scales : value_scales, slot_row * head_dim,
                            slot_row, kv_head, vals, lane, half_dim);
  }
}
