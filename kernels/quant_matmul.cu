// W4A16 / W3A16 matmul: out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) with W in deepinfer's
// PackedWeight layout (core/quant/packed.py): qweight int32 [N, K*BITS/32] packed along K, group
// scales/zeros [N, K/G] (fp16, or fp32 when SCALE_F32), W = (q - z) * s ("zero") or q * s + z ("min").
//
// Both kernels dequantize a thread's 32-code chunk (one group, since G is a multiple of 32) into 16
// pairs of DT values. The pair order is a permutation of the chunk chosen to make unpacking cheap;
// the matching activations are permuted the same way, so the dot product is unchanged:
//   BITS 4: word c holds codes 8c..8c+7; pair 4c+r = codes (8c+r, 8c+r+4)  (mask 0x000F000F, shift 4r)
//   BITS 3: pair i = codes (i, i+16) of the 96-bit chunk
// A pair's value is exact (magic-number conversion, then one fused multiply-add with s and b).
#include "common.cuh"
#include "rope_cache.cuh"

template <int BITS> struct Chunk;
template <> struct Chunk<4> { static constexpr int WORDS = 4; };
template <> struct Chunk<3> { static constexpr int WORDS = 3; };

// Chunk positions (0..31) of the low and high element of pair p.
template <int BITS> __device__ __forceinline__ constexpr int pair_pos_lo(int p) {
  return BITS == 4 ? 8 * (p / 4) + (p % 4) : p;
}
template <int BITS> __device__ __forceinline__ constexpr int pair_pos_hi(int p) {
  return BITS == 4 ? 8 * (p / 4) + (p % 4) + 4 : p + 16;
}

// Raw codes of a chunk -> 16 pairs of integer-valued DT (q exact), before scale and zero.
template <int DT, int BITS>
__device__ __forceinline__ void unpack_codes(const u32* w, u32* q) {
  const u32 magic = Num<DT>::MAGIC;
  if constexpr (BITS == 4 && DT == 0) {
    // fp16: one shift per word. Mask 0x00F000F0 leaves 16 * code in the mantissa (1024 + 16c, still
    // exact), and (v - 1024) / 16 comes back exactly through one fma with 1/16 and -64.
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const u32 w8 = w[c] >> 8;
      q[4 * c + 0] = Num<0>::sub((w[c] & 0x000F000Fu) | magic, magic);
      q[4 * c + 1] = Num<0>::fma((w[c] & 0x00F000F0u) | magic, 0x2C002C00u, 0xD400D400u);  // * 1/16 - 64
      q[4 * c + 2] = Num<0>::sub((w8 & 0x000F000Fu) | magic, magic);
      q[4 * c + 3] = Num<0>::fma((w8 & 0x00F000F0u) | magic, 0x2C002C00u, 0xD400D400u);
    }
  } else if constexpr (BITS == 4) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
#pragma unroll
      for (int r = 0; r < 4; ++r) q[4 * c + r] = Num<DT>::sub(((w[c] >> (4 * r)) & 0x000F000Fu) | magic, magic);
    }
  } else {
    const u64 lo = (u64)w[0] | ((u64)w[1] << 32);  // bits 0..63 of the chunk
    const u64 hi = (u64)w[1] | ((u64)w[2] << 32);  // bits 32..95
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const u32 a = (u32)(lo >> (3 * i)) & 7u;         // code i at bit 3i
      const u32 b = (u32)(hi >> (16 + 3 * i)) & 7u;    // code i+16 at bit 48+3i
      q[i] = Num<DT>::sub(a | (b << 16) | magic, magic);
    }
  }
}

// Load the raw words of one chunk (row `row`, codes [kc, kc+32)); zeros when out of range.
template <int BITS>
__device__ __forceinline__ void load_chunk(const u32* __restrict__ qweight, int words_per_row, int row, int kc,
                                           bool valid, u32* w) {
  if constexpr (BITS == 4) {
    if (valid) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(qweight + (i64)row * words_per_row + kc / 8));
      w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    } else {
      w[0] = w[1] = w[2] = w[3] = 0u;
    }
  } else {
    const u32* p = qweight + (i64)row * words_per_row + (kc / 32) * 3;
#pragma unroll
    for (int i = 0; i < 3; ++i) w[i] = valid ? __ldg(p + i) : 0u;
  }
}

// Group scale s and offset b (W = q * s + b) of (row, group) as DT pairs (s, s), (b, b).
template <int DT, int SCALE_F32>
__device__ __forceinline__ void load_scale(const void* __restrict__ scales, const void* __restrict__ zeros,
                                           i64 index, int zero_mode, bool valid, u32& s2, u32& b2) {
  float s = 0.0f, z = 0.0f;
  if (valid) {
    if constexpr (SCALE_F32) {
      s = __ldg(reinterpret_cast<const float*>(scales) + index);
      z = __ldg(reinterpret_cast<const float*>(zeros) + index);
    } else {
      s = half_bits_to_float(__ldg(reinterpret_cast<const u16*>(scales) + index));
      z = half_bits_to_float(__ldg(reinterpret_cast<const u16*>(zeros) + index));
    }
  }
  const float b = zero_mode == 0 ? -z * s : z;
  s2 = Num<DT>::pack(s, s);
  b2 = Num<DT>::pack(b, b);
}

// Activations of one chunk for one token, permuted like the weight pairs: 16 pairs.
template <int DT, int BITS>
__device__ __forceinline__ void load_x_pairs(const u16* __restrict__ x, bool valid, u32* xp) {
  uint4 u[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) u[c] = valid ? __ldg(reinterpret_cast<const uint4*>(x) + c) : make_uint4(0, 0, 0, 0);
  if constexpr (BITS == 4) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {  // x[8c..8c+7] = (h0,h1) (h2,h3) (h4,h5) (h6,h7)
      xp[4 * c + 0] = pair_of_los(u[c].x, u[c].z);  // (h0, h4)
      xp[4 * c + 1] = pair_of_his(u[c].x, u[c].z);  // (h1, h5)
      xp[4 * c + 2] = pair_of_los(u[c].y, u[c].w);  // (h2, h6)
      xp[4 * c + 3] = pair_of_his(u[c].y, u[c].w);  // (h3, h7)
    }
  } else {
    const u32 words[16] = {u[0].x, u[0].y, u[0].z, u[0].w, u[1].x, u[1].y, u[1].z, u[1].w,
                           u[2].x, u[2].y, u[2].z, u[2].w, u[3].x, u[3].y, u[3].z, u[3].w};
#pragma unroll
    for (int i = 0; i < 16; ++i) {  // (x[i], x[i+16]): word i/2 of x[0..15], word i/2 of x[16..31]
      const u32 a = words[i / 2], b = words[8 + i / 2];
      xp[i] = (i % 2 == 0) ? pair_of_los(a, b) : pair_of_his(a, b);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core path (mma.sync m16n8k16, fp32 accumulate). A warp owns 16 output rows as the mma A
// operand (weights) and 8*TT tokens as the n=8 operand. Thread (g = lane/4, t = lane%4) holds rows
// +g and +g+8 and, of each 128-code K segment, the chunk [128*seg + 32t, +32).

template <int BITS>
struct SegmentPair {  // raw words, scales and offsets of two segments of the thread's two rows
  u32 raw[2][2][Chunk<BITS>::WORDS];
  u32 s2[2][2], b2[2][2];
};

// Load segments seg and seg + stride (those < seg_end) of rows row0 and row0 + 8.
template <int DT, int BITS, int SCALE_F32>
__device__ __forceinline__ void load_segment_pair(SegmentPair<BITS>& d, int seg, int stride, int seg_end,
                                                  const u32* __restrict__ qweight, const void* __restrict__ scales,
                                                  const void* __restrict__ zeros, int row0, int t, int N, int K,
                                                  int group_size, int zero_mode) {
  const int words_per_row = K * BITS / 32, num_groups = K / group_size;
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int kc = (seg + u * stride) * 128 + 32 * t;
    const bool in_k = seg + u * stride < seg_end && kc < K;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + 8 * r;
      const bool valid = in_k && row < N;
      load_chunk<BITS>(qweight, words_per_row, row, kc, valid, d.raw[u][r]);
      load_scale<DT, SCALE_F32>(scales, zeros, (i64)row * num_groups + (valid ? kc / group_size : 0), zero_mode, valid,
                                d.s2[u][r], d.b2[u][r]);
    }
  }
}

// Multiply the two loaded segments into acc[tt] (c0..c3 = (row0, tok 2t), (row0, 2t+1), (row0+8, 2t), (row0+8, 2t+1)).
template <int DT, int BITS, int TT>
__device__ __forceinline__ void mma_segment_pair(const SegmentPair<BITS>& d, int seg, int stride, int seg_end,
                                                 const u16* __restrict__ x, int tok0, int g, int t, int M, int K,
                                                 float (&acc)[TT][4]) {
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    if (seg + u * stride >= seg_end) break;  // uniform across the warp
    const int kc = (seg + u * stride) * 128 + 32 * t;
    u32 a[2][16];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      unpack_codes<DT, BITS>(d.raw[u][r], a[r]);
#pragma unroll
      for (int p = 0; p < 16; ++p) a[r][p] = Num<DT>::fma(a[r][p], d.s2[u][r], d.b2[u][r]);
    }
    if constexpr (TT <= 2) {
      // Both token tiles' activations first, then the k-steps with the tiles interleaved: two
      // independent accumulator chains in flight instead of one (each acc[tt] still sums j = 0..7
      // in order, so results are unchanged).
      u32 xp[TT][16];
#pragma unroll
      for (int tt = 0; tt < TT; ++tt) {
        const int tok = tok0 + tt * 8 + g;
        load_x_pairs<DT, BITS>(x + (i64)tok * K + kc, tok < M && kc < K, xp[tt]);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int tt = 0; tt < TT; ++tt)
          Num<DT>::mma(acc[tt], a[0][2 * j], a[1][2 * j], a[0][2 * j + 1], a[1][2 * j + 1], xp[tt][2 * j],
                       xp[tt][2 * j + 1]);
    } else {
#pragma unroll
      for (int tt = 0; tt < TT; ++tt) {
        const int tok = tok0 + tt * 8 + g;
        u32 xp[16];
        load_x_pairs<DT, BITS>(x + (i64)tok * K + kc, tok < M && kc < K, xp);
#pragma unroll
        for (int j = 0; j < 8; ++j)
          Num<DT>::mma(acc[tt], a[0][2 * j], a[1][2 * j], a[0][2 * j + 1], a[1][2 * j + 1], xp[2 * j], xp[2 * j + 1]);
      }
    }
  }
}

template <int DT, int TT>
__device__ __forceinline__ void store_tile(const float (&acc)[TT][4], const u16* __restrict__ bias,
                                           u16* __restrict__ out, int row0, int tok0, int t, int M, int N) {
#pragma unroll
  for (int tt = 0; tt < TT; ++tt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = row0 + 8 * (e >> 1), tok = tok0 + tt * 8 + 2 * t + (e & 1);
      if (row < N && tok < M) {
        const float b = bias != nullptr ? Num<DT>::to_float(bias[row]) : 0.0f;
        out[(i64)tok * N + row] = Num<DT>::from_float(acc[tt][e] + b);
      }
    }
  }
}

// The CTA's `warps` warps each hold a partial sum of the same output tile (K split among them): the sums
// meet in shared memory and warp 0 adds them in warp order (deterministic). True in warp 0, whose acc then
// holds the tile's sums.
template <int TT, int MAX_WARPS>
__device__ __forceinline__ bool sum_warps(float (&acc)[TT][4], int warps) {
  __shared__ float partial[MAX_WARPS][TT * 4][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int tt = 0; tt < TT; ++tt)
#pragma unroll
    for (int e = 0; e < 4; ++e) partial[warp][tt * 4 + e][lane] = acc[tt][e];
  __syncthreads();
  if (warp != 0) return false;
  // warps outside, the 4 * TT sums inside: a warp's partials are read together; each sum adds the warps in order
#pragma unroll
  for (int tt = 0; tt < TT; ++tt) acc[tt][0] = acc[tt][1] = acc[tt][2] = acc[tt][3] = 0.0f;
#pragma unroll 4
  for (int w = 0; w < warps; ++w) {
#pragma unroll
    for (int tt = 0; tt < TT; ++tt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[tt][e] += partial[w][tt * 4 + e][lane];
  }
  return true;
}

// Split-K epilogue shared by the tiled kernels. With gridDim.z > 1 splits, each CTA writes its fp32
// partials and the last CTA of an output tile (a counter per tile) sums them in split order into acc and
// resets the counter; the other CTAs return false. With one split, acc already holds the tile's sums.
template <int TT>
__device__ __forceinline__ bool reduce_splits(float (&acc)[TT][4], float* __restrict__ partials,
                                              int* __restrict__ counters, int row0, int tok0, int t, int M, int N) {
  const int splits = gridDim.z;
  if (splits == 1) return true;
#pragma unroll
  for (int tt = 0; tt < TT; ++tt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = row0 + 8 * (e >> 1), tok = tok0 + tt * 8 + 2 * t + (e & 1);
      if (row < N && tok < M) partials[((i64)blockIdx.z * M + tok) * N + row] = acc[tt][e];
    }
  }
  __threadfence();
  __syncthreads();
  __shared__ int is_last;
  const int tile = blockIdx.y * gridDim.x + blockIdx.x;
  if (threadIdx.x == 0) is_last = atomicAdd(counters + tile, 1) == splits - 1;
  __syncthreads();
  if (!is_last) return false;
  __threadfence();
  // splits outside, the thread's 4 * TT outputs inside: a split's loads go out together (one L2 round trip a split,
  // not one per output); each output still sums the splits in order
#pragma unroll
  for (int tt = 0; tt < TT; ++tt) acc[tt][0] = acc[tt][1] = acc[tt][2] = acc[tt][3] = 0.0f;
  for (int s = 0; s < splits; ++s) {
#pragma unroll
    for (int tt = 0; tt < TT; ++tt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = row0 + 8 * (e >> 1), tok = tok0 + tt * 8 + 2 * t + (e & 1);
        if (row < N && tok < M) acc[tt][e] += __ldcg(partials + ((i64)s * M + tok) * N + row);
      }
    }
  }
  if (threadIdx.x == 0) counters[tile] = 0;
  return true;
}

template <int DT, int TT>
__device__ __forceinline__ void reduce_splits_and_store(float (&acc)[TT][4], const u16* __restrict__ bias,
                                                        u16* __restrict__ out, float* __restrict__ partials,
                                                        int* __restrict__ counters, int row0, int tok0, int t, int M,
                                                        int N) {
  if (reduce_splits<TT>(acc, partials, counters, row0, tok0, t, M, N)) store_tile<DT, TT>(acc, bias, out, row0, tok0, t, M, N);
}

// Split-K over a thread-block cluster (SM90+): the gridDim.z splits of an output tile are one cluster (dims (1, 1,
// splits)), so instead of fp32 partials in global memory, a fence and a counter, each split's CTA leaves its sums in
// its shared memory (`exchange`, [8 warps][TT * 4][32] floats: the staging buffer, free once every warp of the CTA
// has passed the barrier below) and the CTA of split 0 adds them in split order through distributed shared memory,
// 0 + split 0 + split 1 + ..., as reduce_splits does, so the sums are the same bits. True in that CTA.
template <int TT>
__device__ __forceinline__ bool reduce_cluster_splits(float (&acc)[TT][4], float* __restrict__ exchange) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, split = blockIdx.z;
  float(*mine)[TT * 4][32] = reinterpret_cast<float(*)[TT * 4][32]>(exchange);
  __syncthreads();  // every warp of this CTA is done reading the staging buffer
  if (split != 0) {
#pragma unroll
    for (int tt = 0; tt < TT; ++tt)
#pragma unroll
      for (int e = 0; e < 4; ++e) mine[warp][tt * 4 + e][lane] = acc[tt][e];
  }
  cluster_barrier<true>();
  if (split == 0) {
#pragma unroll
    for (int tt = 0; tt < TT; ++tt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[tt][e] = 0.0f + acc[tt][e];
    for (int s = 1; s < gridDim.z; ++s) {
#pragma unroll
      for (int tt = 0; tt < TT; ++tt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[tt][e] += cluster_load(cluster_address(&mine[warp][tt * 4 + e][lane], s));
    }
  }
  cluster_barrier<false>();  // the other splits' shared memory stays until split 0 has read it
  return split == 0;
}

// Few tokens: CTA = 8 warps on the same 16 output rows, warp w taking segments w, w+8, w+16, ... of
// the whole K, so a CTA streams its rows front to back and no split-K pass over global memory is
// needed; the warps' partial sums meet in shared memory. Weight words are software-pipelined: a
// warp loads the next two segments into one register set while it multiplies the two in the other.
// The rows' scales are loaded in the loop, not staged in shared memory: these kernels are bound by the
// dequantization arithmetic, not by their loads (docs/KERNELS.md).
template <int DT, int BITS, int TT, int SCALE_F32>
__global__ void __launch_bounds__(256) quant_mma_ksplit_kernel(
    const u16* __restrict__ x,          // [M, K]
    const u32* __restrict__ qweight,    // [N, K*BITS/32]
    const void* __restrict__ scales,    // [N, K/G]
    const void* __restrict__ zeros,     // [N, K/G]
    const u16* __restrict__ bias,       // [N] or null
    u16* __restrict__ out,              // [M, N]
    int M, int N, int K, int group_size, int zero_mode) {
  constexpr int WARPS = 8;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * 16 + g;
  const int tok0 = blockIdx.y * 8 * TT;
  const int num_segs = (K + 127) / 128;
  launch_dependents();

  SegmentPair<BITS> cur, nxt;
  load_segment_pair<DT, BITS, SCALE_F32>(cur, warp, WARPS, num_segs, qweight, scales, zeros, row0, t, N, K, group_size,
                                         zero_mode);
  wait_for_prior_grids();

  float acc[TT][4];
#pragma unroll
  for (int i = 0; i < TT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  for (int seg = warp; seg < num_segs; seg += 4 * WARPS) {
    load_segment_pair<DT, BITS, SCALE_F32>(nxt, seg + 2 * WARPS, WARPS, num_segs, qweight, scales, zeros, row0, t, N,
                                           K, group_size, zero_mode);
    mma_segment_pair<DT, BITS, TT>(cur, seg, WARPS, num_segs, x, tok0, g, t, M, K, acc);
    load_segment_pair<DT, BITS, SCALE_F32>(cur, seg + 4 * WARPS, WARPS, num_segs, qweight, scales, zeros, row0, t, N,
                                           K, group_size, zero_mode);
    mma_segment_pair<DT, BITS, TT>(nxt, seg + 2 * WARPS, WARPS, num_segs, x, tok0, g, t, M, K, acc);
  }

  if (sum_warps<TT, WARPS>(acc, WARPS)) store_tile<DT, TT>(acc, bias, out, row0, tok0, t, M, N);
}

// ---------------------------------------------------------------------------------------------
// CUDA-core GEMV for a few tokens (MT <= 4): each weight chunk is read once for all MT tokens.
// CTA = 4 warps; warp w owns rows 8*bx + 2w and +1; lanes stride over the 32-code chunks of K.
template <int DT, int BITS, int MT, int SCALE_F32>
__global__ void __launch_bounds__(128) quant_gemv_kernel(
    const u16* __restrict__ x,          // [M, K]
    const u32* __restrict__ qweight,    // [N, K*BITS/32]
    const void* __restrict__ scales,    // [N, K/G]
    const void* __restrict__ zeros,     // [N, K/G]
    const u16* __restrict__ bias,       // [N] or null
    u16* __restrict__ out,              // [M, N]
    int M, int N, int K, int group_size, int zero_mode) {
  constexpr int WORDS = Chunk<BITS>::WORDS;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row0 = blockIdx.x * 8 + warp * 2;
  const int tok0 = blockIdx.y * MT;
  const int words_per_row = K * BITS / 32;
  const int num_groups = K / group_size;
  const int num_chunks = K / 32;
  launch_dependents();
  wait_for_prior_grids();

  float acc[MT][2];
#pragma unroll
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = 0.0f;

  for (int chunk = lane; chunk < num_chunks; chunk += 32) {
    const int kc = chunk * 32;
    u32 raw[2][WORDS], s2[2], b2[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const bool valid = row0 + r < N;
      load_chunk<BITS>(qweight, words_per_row, row0 + r, kc, valid, raw[r]);
      load_scale<DT, SCALE_F32>(scales, zeros, (i64)(row0 + r) * num_groups + kc / group_size, zero_mode, valid,
                                s2[r], b2[r]);
    }
    float w[2][32];  // dequantized weights of the chunk, in chunk order
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      u32 q[16];
      unpack_codes<DT, BITS>(raw[r], q);
#pragma unroll
      for (int p = 0; p < 16; ++p) {
        const u32 v = Num<DT>::fma(q[p], s2[r], b2[r]);
        w[r][pair_pos_lo<BITS>(p)] = pair_lo<DT>(v);
        w[r][pair_pos_hi<BITS>(p)] = pair_hi<DT>(v);
      }
    }
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      if (tok0 + m >= M) break;
      const uint4* xv = reinterpret_cast<const uint4*>(x + (i64)(tok0 + m) * K + kc);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const uint4 u = __ldg(xv + c);
        const u32 words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float lo = pair_lo<DT>(words[i]), hi = pair_hi<DT>(words[i]);
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            acc[m][r] = fmaf(w[r][8 * c + 2 * i], lo, acc[m][r]);
            acc[m][r] = fmaf(w[r][8 * c + 2 * i + 1], hi, acc[m][r]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sum = warp_sum(acc[m][r]);
      const int row = row0 + r, tok = tok0 + m;
      if (lane == 0 && row < N && tok < M) {
        const float b = bias != nullptr ? Num<DT>::to_float(bias[row]) : 0.0f;
        out[(i64)tok * N + row] = Num<DT>::from_float(sum + b);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core path with the activations staged in shared memory. The ksplit kernel above reloads each
// token tile's activations from L1/L2 for every 16 rows (for 64 tokens that is 16x the weight bytes);
// here a CTA of 8 warps (128 output rows, warp w rows 16w..16w+15) stages the activations of a
// K stage ONCE, already in the mma B-fragment order of load_x_pairs, and every warp dequantizes its
// weights once per segment and multiplies them against all 8*TT tokens from shared memory:
//   xs[(s * TT + tt) * 4 + c][lane] = pairs 4c..4c+3 of token tok0 + 8tt + lane/4, codes
//   [128 (stage + s) + 32 (lane % 4), +32)   (uint4; consecutive lanes -> consecutive 16 B: no conflicts)
// A CTA covers a K range of `segs_per_split` segments (gridDim.z splits, reduced by reduce_splits),
// walked in stages of Staged<TT>::SEGS segments (44 KiB of activations at most: static shared memory
// stops at 48 KiB, and the split-K epilogue needs a few bytes of it).
template <int TT> struct Staged { static constexpr int SEGS = 22 / TT; };  // a segment is TT * 2 KiB

// The activations of K segments [stage, stage_end) for the CTA's TT token tiles, into xs in mma B-fragment
// order (see above), by the CTA's THREADS threads.
template <int DT, int BITS, int TT, int THREADS>
__device__ __forceinline__ void stage_x_fragments(uint4 (*__restrict__ xs)[32], const u16* __restrict__ x, int stage,
                                                  int stage_end, int tok0, int M, int K) {
  const int items = (stage_end - stage) * TT * 32;
  for (int item = threadIdx.x; item < items; item += THREADS) {
    const int l = item & 31, tt = (item >> 5) % TT, s = (item >> 5) / TT;
    const int tok = tok0 + tt * 8 + (l >> 2), kc = (stage + s) * 128 + 32 * (l & 3);
    const bool valid = tok < M && kc < K;
    u32 xp[16];
    load_x_pairs<DT, BITS>(x + (valid ? (i64)tok * K + kc : 0), valid, xp);
#pragma unroll
    for (int c = 0; c < 4; ++c) xs[(s * TT + tt) * 4 + c][l] = make_uint4(xp[4 * c], xp[4 * c + 1], xp[4 * c + 2], xp[4 * c + 3]);
  }
}

template <int DT, int BITS, int TT>
__device__ __forceinline__ void mma_staged_pair(const SegmentPair<BITS>& d, int seg, int stage, int seg_end,
                                                const uint4 (*__restrict__ xs)[32], int lane, float (&acc)[TT][4]) {
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    if (seg + u >= seg_end) break;  // uniform across the CTA
    u32 a[2][16];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      unpack_codes<DT, BITS>(d.raw[u][r], a[r]);
#pragma unroll
      for (int p = 0; p < 16; ++p) a[r][p] = Num<DT>::fma(a[r][p], d.s2[u][r], d.b2[u][r]);
    }
    const int s = seg + u - stage;
    // k-steps outside, token tiles inside: TT independent accumulator chains in flight. Each 16-byte
    // shared load holds the B fragments of k-steps 2c and 2c+1 of one tile; acc[tt] still sums
    // j = 0..7 in order, so results are unchanged.
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      uint4 v[TT];
#pragma unroll
      for (int tt = 0; tt < TT; ++tt) v[tt] = xs[(s * TT + tt) * 4 + c][lane];
#pragma unroll
      for (int tt = 0; tt < TT; ++tt)
        Num<DT>::mma(acc[tt], a[0][4 * c], a[1][4 * c], a[0][4 * c + 1], a[1][4 * c + 1], v[tt].x, v[tt].y);
#pragma unroll
      for (int tt = 0; tt < TT; ++tt)
        Num<DT>::mma(acc[tt], a[0][4 * c + 2], a[1][4 * c + 2], a[0][4 * c + 3], a[1][4 * c + 3], v[tt].z, v[tt].w);
    }
  }
}

template <int DT, int BITS, int TT, int SCALE_F32>
__global__ void __launch_bounds__(256) quant_mma_staged_kernel(
    const u16* __restrict__ x,          // [M, K]
    const u32* __restrict__ qweight,    // [N, K*BITS/32]
    const void* __restrict__ scales,    // [N, K/G]
    const void* __restrict__ zeros,     // [N, K/G]
    const u16* __restrict__ bias,       // [N] or null
    u16* __restrict__ out,              // [M, N]
    float* __restrict__ partials,       // [splits, M, N] when gridDim.z > 1
    int* __restrict__ counters,         // [gridDim.x * gridDim.y], zero before and after
    int M, int N, int K, int group_size, int zero_mode, int segs_per_split) {
  launch_dependents();
  wait_for_prior_grids();
  constexpr int WARPS = 8, SEGS = Staged<TT>::SEGS;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * (16 * WARPS) + warp * 16 + g;
  const int tok0 = blockIdx.y * 8 * TT;
  const int num_segs = (K + 127) / 128;
  const int seg_begin = blockIdx.z * segs_per_split;
  const int seg_end = min(num_segs, seg_begin + segs_per_split);
  __shared__ uint4 xs[SEGS * TT * 4][32];

  float acc[TT][4];
#pragma unroll
  for (int i = 0; i < TT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  for (int stage = seg_begin; stage < seg_end; stage += SEGS) {
    const int stage_end = min(seg_end, stage + SEGS);
    SegmentPair<BITS> cur;  // first weights in flight while the activations are staged
    load_segment_pair<DT, BITS, SCALE_F32>(cur, stage, 1, stage_end, qweight, scales, zeros, row0, t, N, K,
                                           group_size, zero_mode);
    __syncthreads();  // the previous stage's readers are done with xs
    stage_x_fragments<DT, BITS, TT, 32 * WARPS>(xs, x, stage, stage_end, tok0, M, K);
    __syncthreads();
    for (int seg = stage; seg < stage_end; seg += 2) {
      SegmentPair<BITS> nxt;
      load_segment_pair<DT, BITS, SCALE_F32>(nxt, seg + 2, 1, stage_end, qweight, scales, zeros, row0, t, N, K,
                                             group_size, zero_mode);
      mma_staged_pair<DT, BITS, TT>(cur, seg, stage, stage_end, xs, lane, acc);
      cur = nxt;
    }
  }
  reduce_splits_and_store<DT, TT>(acc, bias, out, partials, counters, row0, tok0, t, M, N);
}

// ---------------------------------------------------------------------------------------------
// Streaming GEMV for 1..4 tokens (MT), CUDA cores. Warp = 2 output rows; lane l takes the 32-code
// chunks l, l+32, l+64, ... of both rows, UNROLL chunks per step (4; 2 for 4 tokens) with all their 16-byte loads issued
// before any math, so each lane keeps 2*UNROLL independent loads in flight. A chunk dequantizes to 16
// DT pairs (one group: G is a multiple of 32); fp16 multiplies pairs with fma.f16x2 into two half2
// accumulators of 8 products each, then adds them into fp32; bf16 multiplies in fp32.
template <int DT>
__device__ __forceinline__ float dot_pairs(const u32* w, const u32* xp) {
  if constexpr (DT == 0) {
    u32 h0 = 0u, h1 = 0u;
#pragma unroll
    for (int p = 0; p < 8; ++p) {
      h0 = Num<0>::fma(w[p], xp[p], h0);
      h1 = Num<0>::fma(w[p + 8], xp[p + 8], h1);
    }
    return (pair_lo<0>(h0) + pair_hi<0>(h0)) + (pair_lo<0>(h1) + pair_hi<0>(h1));
  } else {
    float f0 = 0.0f, f1 = 0.0f;
#pragma unroll
    for (int p = 0; p < 16; ++p) {
      f0 = fmaf(__uint_as_float(w[p] << 16), __uint_as_float(xp[p] << 16), f0);
      f1 = fmaf(__uint_as_float(w[p] & 0xFFFF0000u), __uint_as_float(xp[p] & 0xFFFF0000u), f1);
    }
    return f0 + f1;
  }
}

// The CUDA-core GEMVs' main loop over one lane's 32-code chunks first_chunk, +stride, ... of rows
// row0 and row0 + 1: UNROLL chunks a step, all their loads (codes, scales, zeros) issued before any
// of the step's math. acc[m][r] = the lane's share of (token tok0 + m) . (row row0 + r).
template <int DT, int BITS, int MT, int SCALE_F32, int UNROLL>
__device__ __forceinline__ void row_pair_sums(float (&acc)[MT][2], const u16* __restrict__ x,
                                              const u32* __restrict__ qweight, const void* __restrict__ scales,
                                              const void* __restrict__ zeros, int row0, int tok0, int M, int N, int K,
                                              int group_size, int zero_mode, int first_chunk, int stride) {
  constexpr int WORDS = Chunk<BITS>::WORDS, ROWS = 2;
  const int words_per_row = K * BITS / 32, num_groups = K / group_size, num_chunks = K / 32;
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[m][r] = 0.0f;

  for (int base = first_chunk; base < num_chunks; base += stride * UNROLL) {
    u32 raw[UNROLL][ROWS][WORDS], s2[UNROLL][ROWS], b2[UNROLL][ROWS];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int chunk = base + stride * u;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const bool valid = chunk < num_chunks && row0 + r < N;
        load_chunk<BITS>(qweight, words_per_row, row0 + r, chunk * 32, valid, raw[u][r]);
        load_scale<DT, SCALE_F32>(scales, zeros, valid ? (i64)(row0 + r) * num_groups + chunk * 32 / group_size : 0,
                                  zero_mode, valid, s2[u][r], b2[u][r]);
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int chunk = base + stride * u;
      if (chunk >= num_chunks) break;  // later chunks of this step are out of range too
      u32 w[ROWS][16];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        unpack_codes<DT, BITS>(raw[u][r], w[r]);
#pragma unroll
        for (int p = 0; p < 16; ++p) w[r][p] = Num<DT>::fma(w[r][p], s2[u][r], b2[u][r]);
      }
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if (tok0 + m >= M) break;
        u32 xp[16];
        load_x_pairs<DT, BITS>(x + (i64)(tok0 + m) * K + chunk * 32, true, xp);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[m][r] += dot_pairs<DT>(w[r], xp);
      }
    }
  }
}

template <int DT, int BITS, int MT, int SCALE_F32>
__global__ void __launch_bounds__(128) quant_stream_kernel(
    const u16* __restrict__ x,          // [M, K]
    const u32* __restrict__ qweight,    // [N, K*BITS/32]
    const void* __restrict__ scales,    // [N, K/G]
    const void* __restrict__ zeros,     // [N, K/G]
    const u16* __restrict__ bias,       // [N] or null
    u16* __restrict__ out,              // [M, N]
    int M, int N, int K, int group_size, int zero_mode) {
  launch_dependents();
  wait_for_prior_grids();
  constexpr int UNROLL = MT >= 4 ? 2 : 4, ROWS = 2;  // registers: fewer loads ahead for 4 tokens
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row0 = (blockIdx.x * 4 + warp) * ROWS;
  const int tok0 = blockIdx.y * MT;

  float acc[MT][ROWS];
  row_pair_sums<DT, BITS, MT, SCALE_F32, UNROLL>(acc, x, qweight, scales, zeros, row0, tok0, M, N, K, group_size,
                                                 zero_mode, lane, 32);
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const float sum = warp_sum(acc[m][r]);
      const int row = row0 + r, tok = tok0 + m;
      if (lane == 0 && row < N && tok < M) {
        const float b = bias != nullptr ? Num<DT>::to_float(bias[row]) : 0.0f;
        out[(i64)tok * N + row] = Num<DT>::from_float(sum + b);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core GEMV for 1..32 tokens, W4 only: ksplit's fragment layout with fewer instructions per weight
// byte. The GEMVs above are bound by instruction issue, not by DRAM (64-bit index math, an integer division
// per chunk, bounds branches, fp32 dot products in bf16; docs/KERNELS.md). Here a thread spends ~2-3
// instructions per weight pair:
//   - shapes are whole: N % 16 == 0 and K % 128 == 0 (the launcher checks), so no bounds tests on weights;
//   - per-row base pointers are computed once; a chunk's group is chunk >> group_shift (the launcher
//     passes log2(G / 32), or 31 for per-channel scales);
//   - MODE 0 (zero mode, integer zero points, G % 128 == 0): a pair is (q - z) exactly, one LOP3 and one
//     HSUB2/HFMA2 from the raw codes (fp16: 1024 + q minus 1024 + z; bf16: 128 + q minus 128 + z), and each
//     128-code segment's mma sums (one group) are scaled once in fp32: acc += s * sum((q - z) x);
//   - MODE 1 (any other zero mode or group size): pairs are dequantized to W = q * s + b in DT first, as in
//     the other kernels, and the mma accumulates across segments.
// CTA = blockDim.x / 32 warps on 16 output rows (16 warps for one token tile when every CTA is resident at
// once, else 8: the launcher decides), warp w taking segments w, w + WARPS, ...; each warp keeps 4 segments
// of loads in flight (two ping-pong pairs). The warps' sums meet in shared memory.
template <int TT> struct TcWarps { static constexpr int MAX = TT == 1 ? 16 : 8; };
template <int SCALE_F32> struct TcScale { typedef u16 T; };
template <> struct TcScale<1> { typedef float T; };

// (a & mask) | bits in one LOP3 (written as C, the compiler emits an AND and an OR)
template <u32 MASK, u32 BITS>
__device__ __forceinline__ u32 and_or(u32 a) {
  u32 d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "n"(MASK), "n"(BITS));
  return d;
}

// The pointer as an opaque register value: the compiler then adds a segment's offset to it with one
// IMAD.WIDE.U32 instead of rebuilding row * stride + offset from the kernel parameter every time.
template <typename T>
__device__ __forceinline__ const T* opaque(const T* p) {
  const T* q;
  asm("mov.b64 %0, %1;" : "=l"(q) : "l"(p));
  return q;
}

template <int SCALE_F32>
struct TcSegment {  // one 128-code segment of the thread's two rows: raw words, raw scales and zeros
  uint4 w[2];
  typename TcScale<SCALE_F32>::T s[2], z[2];
};

template <int SCALE_F32>
struct TcRows {  // the thread's two rows (row0, row0 + 8): chunk t of each row, scales and zeros
  const uint4* w[2];
  const typename TcScale<SCALE_F32>::T* s[2];
  const typename TcScale<SCALE_F32>::T* z[2];
};

// The thread's rows row0 and row0 + row_step of a packed [N, K] weight (K % 128 == 0; the mma tile's rows g and
// g + 8, which are 8 apart except in quant_tc_rope_kernel): chunk t of each row, and the rows' scales and zeros
// (a chunk's group is chunk >> group_shift; 31: one group per row).
template <int SCALE_F32>
__device__ __forceinline__ TcRows<SCALE_F32> tc_rows(const u32* __restrict__ qweight, const void* __restrict__ scales,
                                                     const void* __restrict__ zeros, int row0, int row_step, int t,
                                                     int K, int group_shift) {
  typedef typename TcScale<SCALE_F32>::T ST;
  const int chunks_per_row = K >> 5;
  const int num_groups = group_shift >= 31 ? 1 : chunks_per_row >> group_shift;
  TcRows<SCALE_F32> rows;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const i64 row = row0 + row_step * r;
    rows.w[r] = opaque(reinterpret_cast<const uint4*>(qweight) + row * chunks_per_row + t);
    rows.s[r] = opaque(reinterpret_cast<const ST*>(scales) + row * num_groups);
    rows.z[r] = opaque(reinterpret_cast<const ST*>(zeros) + row * num_groups);
  }
  return rows;
}

template <int SCALE_F32>
__device__ __forceinline__ void tc_load(TcSegment<SCALE_F32>& d, const TcRows<SCALE_F32>& rows, int seg, int t,
                                        int group_shift) {
  // unsigned offsets: each address is one IMAD.WIDE.U32 on the row's base (signed ones cost a sign extension
  // and a 64-bit add each)
  const u32 chunk = (u32)seg * 4u, group = (chunk + (u32)t) >> group_shift;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    d.w[r] = __ldg(rows.w[r] + chunk);
    d.s[r] = __ldg(rows.s[r] + group);
    d.z[r] = __ldg(rows.z[r] + group);
  }
}

__device__ __forceinline__ float tc_scale_value(u16 bits) { return half_bits_to_float(bits); }
__device__ __forceinline__ float tc_scale_value(float value) { return value; }

// The 4 pairs of word `c` of a chunk (pairs 4c..4c+3 = codes (8c+r, 8c+r+4), r = 0..3), given the
// per-(row, group) constants: MODE 0 -> q - z exactly; MODE 1 -> q exactly, then q * s + b.
template <int DT, int MODE>
__device__ __forceinline__ void tc_unpack_word(u32 w, u32 lo_off, u32 hi_off, u32 s2, u32 b2, u32 (&q)[4]) {
  constexpr u32 MAGIC = Num<DT>::MAGIC;
  if constexpr (DT == 0) {
    const u32 w8 = w >> 8;
    q[0] = Num<0>::sub(and_or<0x000F000Fu, MAGIC>(w), lo_off);                 // (1024 + c) - lo_off
    q[1] = Num<0>::fma(and_or<0x00F000F0u, MAGIC>(w), 0x2C002C00u, hi_off);    // (1024 + 16c) / 16 + hi_off
    q[2] = Num<0>::sub(and_or<0x000F000Fu, MAGIC>(w8), lo_off);
    q[3] = Num<0>::fma(and_or<0x00F000F0u, MAGIC>(w8), 0x2C002C00u, hi_off);
  } else {
    q[0] = Num<1>::sub(and_or<0x000F000Fu, MAGIC>(w), lo_off);                 // (128 + c) - lo_off
#pragma unroll
    for (int r = 1; r < 4; ++r) q[r] = Num<1>::sub(and_or<0x000F000Fu, MAGIC>(w >> (4 * r)), lo_off);
  }
  if constexpr (MODE == 1) {
#pragma unroll
    for (int r = 0; r < 4; ++r) q[r] = Num<DT>::fma(q[r], s2, b2);
  }
}

// Multiply one loaded segment into c[tt] (MODE 0: c is this segment's own sum; MODE 1: the running sum).
// Where a segment's activations come from, as the mma B fragments of word cw (k-steps 2cw, 2cw + 1) of token
// tile tt: pairs (b0, b1) of k-step 2cw, then of 2cw + 1.
struct TcGlobalX {  // read from x (tc): the thread's token g of each tile, zeros past M
  const u16* x;
  int seg, t, tok_g, M, K;
  __device__ __forceinline__ uint4 get(int tt, int cw) const {
    const uint4* xs = reinterpret_cast<const uint4*>(x + (i64)tok_g * K) + seg * 16 + t * 4;
    uint4 u = make_uint4(0u, 0u, 0u, 0u);
    if (tok_g + tt * 8 < M) u = __ldg(xs + (i64)tt * 8 * (K / 8) + cw);
    // x[8cw..8cw+7] = (h0,h1) (h2,h3) (h4,h5) (h6,h7) -> pairs (h0,h4) (h1,h5) (h2,h6) (h3,h7), like the codes
    return make_uint4(pair_of_los(u.x, u.z), pair_of_his(u.x, u.z), pair_of_los(u.y, u.w), pair_of_his(u.y, u.w));
  }
};

template <int TT>
struct TcStagedX {  // staged in shared memory in fragment order (tcs): xs[(s * TT + tt) * 4 + cw][lane]
  const uint4 (*xs)[32];
  int s, lane;
  __device__ __forceinline__ uint4 get(int tt, int cw) const { return xs[(s * TT + tt) * 4 + cw][lane]; }
};

// Multiply one loaded segment into c[tt] (MODE 0: c is this segment's own sum; MODE 1: the running sum).
template <int DT, int TT, int MODE, int SCALE_F32, typename XSource>
__device__ __forceinline__ void tc_segment(const TcSegment<SCALE_F32>& d, const XSource& xsrc, int zero_mode,
                                           float (&c)[TT][4]) {
  // per-row constants: MODE 0 -> offsets that turn magic-biased codes into q - z; MODE 1 -> q, then (s, b)
  u32 lo_off[2], hi_off[2] = {0u, 0u}, s2[2] = {0u, 0u}, b2[2] = {0u, 0u};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float z = tc_scale_value(d.z[r]);
    if constexpr (MODE == 0) {
      if constexpr (DT == 0) {
        lo_off[r] = Num<0>::pack(1024.0f + z, 1024.0f + z);
        hi_off[r] = Num<0>::pack(-64.0f - z, -64.0f - z);
      } else {
        lo_off[r] = Num<1>::pack(128.0f + z, 128.0f + z);
      }
    } else {
      lo_off[r] = Num<DT>::MAGIC;
      hi_off[r] = 0xD400D400u;  // fp16 -64
      const float s = tc_scale_value(d.s[r]);
      const float b = zero_mode == 0 ? -z * s : z;
      s2[r] = Num<DT>::pack(s, s);
      b2[r] = Num<DT>::pack(b, b);
    }
  }
  const u32 wr[2][4] = {{d.w[0].x, d.w[0].y, d.w[0].z, d.w[0].w}, {d.w[1].x, d.w[1].y, d.w[1].z, d.w[1].w}};
#pragma unroll
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
}

template <int DT, int TT, int MODE, int SCALE_F32, typename XSource>
__device__ __forceinline__ void tc_step(const TcSegment<SCALE_F32>& d, const XSource& xsrc, int zero_mode,
                                        float (&acc)[TT][4]) {
  if constexpr (MODE == 0) {
    float c[TT][4];
#pragma unroll
    for (int tt = 0; tt < TT; ++tt) c[tt][0] = c[tt][1] = c[tt][2] = c[tt][3] = 0.0f;
    tc_segment<DT, TT, MODE>(d, xsrc, zero_mode, c);
    const float s0 = tc_scale_value(d.s[0]), s1 = tc_scale_value(d.s[1]);
#pragma unroll
    for (int tt = 0; tt < TT; ++tt) {  // c0, c1: row g; c2, c3: row g + 8
      acc[tt][0] = fmaf(s0, c[tt][0], acc[tt][0]);
      acc[tt][1] = fmaf(s0, c[tt][1], acc[tt][1]);
      acc[tt][2] = fmaf(s1, c[tt][2], acc[tt][2]);
      acc[tt][3] = fmaf(s1, c[tt][3], acc[tt][3]);
    }
  } else {
    tc_segment<DT, TT, MODE>(d, xsrc, zero_mode, acc);
  }
}

// A warp's share of a tc tile: segments warp, warp + warps, ... of the thread's two rows. Its first two segments'
// loads go out before the kernel's PDL wait (weights are no earlier kernel's output): tc_first_loads, then the
// wait, then tc_warp_sums, which sums every segment into acc. Ping-pong pairs: segments s, s + W in `a`,
// s + 2W, s + 3W in `b`; a pair's loads go out before the other pair's math.
template <int SCALE_F32>
__device__ __forceinline__ void tc_first_loads(TcSegment<SCALE_F32>& a0, TcSegment<SCALE_F32>& a1,
                                               const TcRows<SCALE_F32>& rows, int warp, int warps, int t, int K,
                                               int group_shift) {
  const int num_segs = K >> 7;
  if (warp < num_segs) tc_load(a0, rows, warp, t, group_shift);
  if (warp + warps < num_segs) tc_load(a1, rows, warp + warps, t, group_shift);
}

template <int DT, int TT, int MODE, int SCALE_F32>
__device__ __forceinline__ void tc_warp_sums(TcSegment<SCALE_F32>& a0, TcSegment<SCALE_F32>& a1,
                                             const TcRows<SCALE_F32>& rows, const u16* __restrict__ x, int warp,
                                             int warps, int tok_g, int t, int M, int K, int group_shift,
                                             int zero_mode, float (&acc)[TT][4]) {
  const int num_segs = K >> 7;
#pragma unroll
  for (int tt = 0; tt < TT; ++tt) acc[tt][0] = acc[tt][1] = acc[tt][2] = acc[tt][3] = 0.0f;
  TcSegment<SCALE_F32> b0, b1;
  const int stride = warps;
  auto xat = [&](int s) { return TcGlobalX{x, s, t, tok_g, M, K}; };
  for (int seg = warp; seg < num_segs; seg += 4 * stride) {
    if (seg + 2 * stride < num_segs) tc_load(b0, rows, seg + 2 * stride, t, group_shift);
    if (seg + 3 * stride < num_segs) tc_load(b1, rows, seg + 3 * stride, t, group_shift);
    tc_step<DT, TT, MODE>(a0, xat(seg), zero_mode, acc);
    if (seg + stride < num_segs) tc_step<DT, TT, MODE>(a1, xat(seg + stride), zero_mode, acc);
    if (seg + 4 * stride < num_segs) tc_load(a0, rows, seg + 4 * stride, t, group_shift);
    if (seg + 5 * stride < num_segs) tc_load(a1, rows, seg + 5 * stride, t, group_shift);
    if (seg + 2 * stride < num_segs) tc_step<DT, TT, MODE>(b0, xat(seg + 2 * stride), zero_mode, acc);
    if (seg + 3 * stride < num_segs) tc_step<DT, TT, MODE>(b1, xat(seg + 3 * stride), zero_mode, acc);
  }
}

template <int DT, int TT, int MODE, int SCALE_F32>
__global__ void __launch_bounds__(32 * TcWarps<TT>::MAX) quant_tc_gemv_kernel(
    const u16* __restrict__ x,          // [M, K]
    const u32* __restrict__ qweight,    // [N, K/8], N % 16 == 0, K % 128 == 0
    const void* __restrict__ scales,    // [N, K/G]
    const void* __restrict__ zeros,     // [N, K/G]
    const u16* __restrict__ bias,       // [N] or null
    u16* __restrict__ out,              // [M, N]
    int M, int N, int K, int group_shift, int zero_mode) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * 16 + g;
  const int tok0 = blockIdx.y * 8 * TT;
  const TcRows<SCALE_F32> rows = tc_rows<SCALE_F32>(qweight, scales, zeros, row0, 8, t, K, group_shift);
  launch_dependents();
  TcSegment<SCALE_F32> a0, a1;
  tc_first_loads(a0, a1, rows, warp, warps, t, K, group_shift);
  wait_for_prior_grids();
  float acc[TT][4];
  tc_warp_sums<DT, TT, MODE>(a0, a1, rows, x, warp, warps, tok0 + g, t, M, K, group_shift, zero_mode, acc);
  if (sum_warps<TT, TcWarps<TT>::MAX>(acc, warps)) store_tile<DT, TT>(acc, bias, out, row0, tok0, t, M, N);
}

// The merged q/k/v projection of an attention layer with its epilogue fused: RoPE (HF rotate-half) on the q and
// k heads and the paged KV-cache write of k and v, what rope_cache_kernel<DT, KV, 1> does after a tc product,
// with the same roundings and cache stores (rope_cache.cuh), so the results are bit for bit the unfused ones.
// Saves that kernel's launch and round trips in every decode step.
// Rows [q heads | k heads | v heads] x D. A CTA's 16-row tile is 8 rows of the first half of one head and the 8
// rows D/2 further (tile j of head h: rows h*D + 8j + g and h*D + D/2 + 8j + g, j < D/16), i.e. the mma tile's
// rows g and g + 8 are a rotation pair, so warp 0 holds both elements of each pair after sum_warps. Each thread
// then finishes tokens tok0 + 2t, 2t + 1 (TT = 1: up to 8 tokens a CTA row): q -> query_out, k -> key_out and the
// key cache, v -> out (its v columns) and the value cache. Slots < 0 skip the cache write.
// A 16-bit or e4m3 cache row element depends on that element alone, so each CTA stores its own 16 elements. An int8
// row's scale is the amax over the whole head, whose D rows span D/16 CTAs: those CTAs count their arrivals
// (head_counters, one a head and token tile, left at zero), and the last to arrive reads the head's finished rows
// back from key_out / out (L2) and stores the codes and scales, its warp w the token tok0 + w.
template <int DT, int MODE, int SCALE_F32, int KV>
__global__ void __launch_bounds__(32 * TcWarps<1>::MAX) quant_tc_rope_kernel(
    const u16* __restrict__ x,             // [M, K]
    const u32* __restrict__ qweight,       // [N, K/8], N = (H + 2 KVH) D, K % 128 == 0
    const void* __restrict__ scales,       // [N, K/G]
    const void* __restrict__ zeros,        // [N, K/G]
    const u16* __restrict__ bias,          // [N] or null
    u16* __restrict__ out,                 // [M, N]: only the v columns are written
    u16* __restrict__ query_out,           // [M, H, D]
    u16* __restrict__ key_out,             // [M, KVH, D]
    const u16* __restrict__ cos,           // [M, D/2]
    const u16* __restrict__ sin,           // [M, D/2]
    void* __restrict__ key_cache,          // [NB, KVH, BS, D] in DT, int8 or e4m3 (KV)
    void* __restrict__ value_cache,        // [NB, KVH, BS, D]
    void* __restrict__ key_scales,         // int8: [NB, KVH, BS] fp16; e4m3: [KVH] fp32; else null
    void* __restrict__ value_scales,       // int8: [NB, KVH, BS] fp16; e4m3: [KVH] fp32; else null
    int* __restrict__ head_counters,       // int8: [gridDim.y, 2 KVH] zeros; else null
    const i64* __restrict__ slot_mapping,  // [M]
    int M, int N, int K, int group_shift, int zero_mode, int num_heads, int num_kv_heads, int head_dim,
    int log2_block_size) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int half = head_dim >> 1, tiles_per_head = head_dim >> 4;
  const int head = blockIdx.x / tiles_per_head;
  const int i = (blockIdx.x - head * tiles_per_head) * 8 + g;  // the pair's element in the head's first half
  const int row0 = head * head_dim + i;
  const int tok0 = blockIdx.y * 8;
  const bool is_q = head < num_heads, is_k = !is_q && head < num_heads + num_kv_heads;
  const int kv_head = is_q ? 0 : head - num_heads - (is_k ? 0 : num_kv_heads);
  const int block_size = 1 << log2_block_size;
  const TcRows<SCALE_F32> rows = tc_rows<SCALE_F32>(qweight, scales, zeros, row0, half, t, K, group_shift);
  launch_dependents();
  TcSegment<SCALE_F32> a0, a1;
  tc_first_loads(a0, a1, rows, warp, warps, t, K, group_shift);
  // warp 0's epilogue operands go out early, so their round trips overlap the product: the bias (a weight) before
  // the PDL wait, the tokens' cos / sin and cache slots (this step's inputs) and an e4m3 head scale right after it
  u16 bias_bits[2] = {0, 0}, cos_bits[2] = {0, 0}, sin_bits[2] = {0, 0};
  i64 slot[2] = {-1, -1};
  float kv_scale = 1.0f;
  if (warp == 0 && bias != nullptr) {
    bias_bits[0] = bias[row0];
    bias_bits[1] = bias[row0 + half];
  }
  wait_for_prior_grids();
  if (warp == 0) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int tok = tok0 + 2 * t + e;
      if (tok >= M) continue;
      cos_bits[e] = cos[(i64)tok * half + i];
      sin_bits[e] = sin[(i64)tok * half + i];
      slot[e] = slot_mapping[tok];
    }
    if (KV == KV_E4M3 && !is_q) kv_scale = reinterpret_cast<const float*>(is_k ? key_scales : value_scales)[kv_head];
  }
  float acc[1][4];
  tc_warp_sums<DT, 1, MODE>(a0, a1, rows, x, warp, warps, tok0 + g, t, M, K, group_shift, zero_mode, acc);
  const bool sums_here = sum_warps<1, TcWarps<1>::MAX>(acc, warps);
  if (KV != KV_INT8 && !sums_here) return;
  if (sums_here) {
    const float b1 = Num<DT>::to_float(bias_bits[0]), b2 = Num<DT>::to_float(bias_bits[1]);  // 0 without a bias
#pragma unroll
    for (int e = 0; e < 2; ++e) {  // acc[0][e]: (row0, token 2t + e); acc[0][2 + e]: (row0 + D/2, token 2t + e)
      const int tok = tok0 + 2 * t + e;
      if (tok >= M) continue;
      // the product's output as the unfused path stores it, then rope_cache_kernel's arithmetic
      float x1 = Num<DT>::to_float(Num<DT>::from_float(acc[0][e] + b1));
      float x2 = Num<DT>::to_float(Num<DT>::from_float(acc[0][2 + e] + b2));
      if (!is_q && !is_k) {
        out[(i64)tok * N + row0] = Num<DT>::from_float(x1);
        out[(i64)tok * N + row0 + half] = Num<DT>::from_float(x2);
      } else {
        rotate_pair<DT>(x1, x2, Num<DT>::to_float(cos_bits[e]), Num<DT>::to_float(sin_bits[e]));
        u16* dst = is_q ? query_out + ((i64)tok * num_heads + head) * head_dim
                        : key_out + ((i64)tok * num_kv_heads + kv_head) * head_dim;
        dst[i] = Num<DT>::from_float(x1);
        dst[i + half] = Num<DT>::from_float(x2);
      }
      if (KV == KV_INT8 || is_q || slot[e] < 0) continue;
      const i64 slot_row =
          ((slot[e] >> log2_block_size) * num_kv_heads + kv_head) * block_size + (slot[e] & (block_size - 1));
      void* cache = is_k ? key_cache : value_cache;
      if constexpr (KV == KV_E4M3) {
        unsigned char* dst = reinterpret_cast<unsigned char*>(cache) + slot_row * head_dim;
        dst[i] = float_to_e4m3(x1 / kv_scale);
        dst[i + half] = float_to_e4m3(x2 / kv_scale);
      } else {
        u16* dst = reinterpret_cast<u16*>(cache) + slot_row * head_dim;
        dst[i] = Num<DT>::from_float(x1);
        dst[i + half] = Num<DT>::from_float(x2);
      }
    }
  }
  if constexpr (KV == KV_INT8) {
    if (is_q) return;  // the whole CTA: a tile's head is the CTA's
    __shared__ int head_done;
    int* counter = head_counters + blockIdx.y * 2 * num_kv_heads + (head - num_heads);
    if (sums_here) {  // warp 0 stored this CTA's elements of the head
      __threadfence();
      __syncwarp();
      if (lane == 0) head_done = atomicAdd(counter, 1) == tiles_per_head - 1;
    }
    __syncthreads();
    if (!head_done) return;
    __threadfence();
    for (int r = warp; r < 8; r += warps) {
      const int tok = tok0 + r;
      if (tok >= M) break;
      const i64 s = __ldcg(slot_mapping + tok);
      if (s < 0) continue;
      const u16* src = is_k ? key_out + ((i64)tok * num_kv_heads + kv_head) * head_dim
                            : out + (i64)tok * N + (i64)head * head_dim;
      float vals[8];
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const int e = lane + 32 * p;
        vals[2 * p] = e < half ? Num<DT>::to_float(__ldcg(src + e)) : 0.0f;
        vals[2 * p + 1] = e < half ? Num<DT>::to_float(__ldcg(src + e + half)) : 0.0f;
      }
      const i64 slot_row = ((s >> log2_block_size) * num_kv_heads + kv_head) * block_size + (s & (block_size - 1));
      store_head<DT, KV_INT8>(is_k ? key_cache : value_cache, is_k ? key_scales : value_scales, slot_row * head_dim,
                              slot_row, kv_head, vals, lane, half);
    }
    if (threadIdx.x == 0) *counter = 0;
  }
}

// ---------------------------------------------------------------------------------------------
// "tcs": the tc kernel's lean loads and exact (q - z) pairs for 9-32 tokens, with the staged kernel's layout:
// CTA = 8 warps on 128 output rows (warp w: rows 16w..16w+15) sharing the activations of a K stage, staged
// once in shared memory in mma B-fragment order (xs[(s * TT + tt) * 4 + c][lane], as quant_mma_staged_kernel
// stages them), so the 8 warps do not each re-read and re-permute them as tc's warps do; K split across
// CTAs (gridDim.z) with the staged kernel's split-K epilogue. Each warp keeps the next segment's loads in
// flight while it multiplies the current one.
// A tcs CTA's main loop: each warp's 16-row tile (`rows`; rows_exist is the same for every lane of a warp) over
// the K segments [seg_begin, seg_end), in stages of Staged<TT>::SEGS segments whose activations the CTA's 8 warps
// stage in xs. Each warp keeps the next segment's loads in flight while it multiplies the current one; the first
// weights go out before the PDL wait. acc: the thread's sums of its two rows.
template <int DT, int TT, int MODE, int SCALE_F32>
__device__ __forceinline__ void tcs_sums(uint4 (*__restrict__ xs)[32], const TcRows<SCALE_F32> rows, bool rows_exist,
                                         const u16* __restrict__ x, int seg_begin, int seg_end, int tok0, int M, int K,
                                         int group_shift, int zero_mode, float (&acc)[TT][4]) {
  constexpr int WARPS = 8, SEGS = Staged<TT>::SEGS;
  const int lane = threadIdx.x & 31, t = lane & 3;
#pragma unroll
  for (int tt = 0; tt < TT; ++tt) acc[tt][0] = acc[tt][1] = acc[tt][2] = acc[tt][3] = 0.0f;
  if (seg_begin >= seg_end) wait_for_prior_grids();  // an empty K range (the plans make none) still waits
  for (int stage = seg_begin; stage < seg_end; stage += SEGS) {
    const int stage_end = min(seg_end, stage + SEGS);
    TcSegment<SCALE_F32> cur;  // first weights in flight while the activations are staged
    if (rows_exist) tc_load(cur, rows, stage, t, group_shift);
    if (stage == seg_begin) wait_for_prior_grids();  // x is the previous grid's output
    __syncthreads();  // the previous stage's readers are done with xs
    stage_x_fragments<DT, 4, TT, 32 * WARPS>(xs, x, stage, stage_end, tok0, M, K);
    __syncthreads();
    if (!rows_exist) continue;
    for (int seg = stage; seg < stage_end; ++seg) {
      TcSegment<SCALE_F32> nxt;
      if (seg + 1 < stage_end) tc_load(nxt, rows, seg + 1, t, group_shift);
      tc_step<DT, TT, MODE>(cur, TcStagedX<TT>{xs, seg - stage, lane}, zero_mode, acc);
      cur = nxt;
    }
  }
}

template <int DT, int TT, int MODE, int SCALE_F32>
__global__ void __launch_bounds__(256) quant_tcs_kernel(
    const u16* __restrict__ x,          // [M, K]
    const u32* __restrict__ qweight,    // [N, K/8], N % 16 == 0, K % 128 == 0
    const void* __restrict__ scales,    // [N, K/G]
    const void* __restrict__ zeros,     // [N, K/G]
    const u16* __restrict__ bias,       // [N] or null
    u16* __restrict__ out,              // [M, N]
    float* __restrict__ partials,       // [splits, M, N] when gridDim.z > 1
    int* __restrict__ counters,         // [gridDim.x * gridDim.y], zero before and after
    int M, int N, int K, int group_shift, int zero_mode, int segs_per_split) {
  constexpr int WARPS = 8;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * (16 * WARPS) + warp * 16 + g;
  const bool rows_exist = row0 < N;  // whole 16-row tiles: the same for every lane of the warp
  const int tok0 = blockIdx.y * 8 * TT;
  const int seg_begin = blockIdx.z * segs_per_split;
  const int seg_end = min(K >> 7, seg_begin + segs_per_split);
  // rows past N (whole idle tiles) point at rows 0 and 8 instead: never read, but inside the tensor
  const TcRows<SCALE_F32> rows =
      tc_rows<SCALE_F32>(qweight, scales, zeros, rows_exist ? row0 : 0, 8, t, K, group_shift);
  __shared__ uint4 xs[Staged<TT>::SEGS * TT * 4][32];
  launch_dependents();
  float acc[TT][4];
  tcs_sums<DT, TT, MODE>(xs, rows, rows_exist, x, seg_begin, seg_end, tok0, M, K, group_shift, zero_mode, acc);
  reduce_splits_and_store<DT, TT>(acc, bias, out, partials, counters, row0, tok0, t, M, N);
}

// The merged gate/up projection of a gated MLP with the activation in its epilogue: out = act(gate) * up [M, I],
// what the tcs product followed by act_and_mul_kernel<DT, ACT> gives, bit for bit, without that kernel's launch
// and the [M, 2I] product's round trip. Rows [gate | up] x I. A CTA's warps 0-3 take the gate rows
// 64 bx + 16 w .. + 15 and warps 4-7 the up rows I further, so once the CTA's K splits are summed (tcs's split-K
// epilogue) warp w + 4 hands its sums to warp w through shared memory: the same fragment positions, i.e. the same
// (row, token) pairs. Each sum becomes the product's output as the unfused path stores it (bias added, rounded to
// DT), then act_and_mul_kernel's arithmetic: act in fp32 rounded to DT, times up, rounded. CLUSTER_SPLITS (SM90+):
// the K splits of a tile are a thread-block cluster and meet in distributed shared memory (reduce_cluster_splits).
template <int DT, int TT, int MODE, int SCALE_F32, int ACT, int CLUSTER_SPLITS = 0>
__global__ void __launch_bounds__(256) quant_tcs_act_kernel(
    const u16* __restrict__ x,          // [M, K]
    const u32* __restrict__ qweight,    // [2I, K/8], I % 16 == 0, K % 128 == 0
    const void* __restrict__ scales,    // [2I, K/G]
    const void* __restrict__ zeros,     // [2I, K/G]
    const u16* __restrict__ bias,       // [2I] or null
    u16* __restrict__ out,              // [M, I]
    float* __restrict__ partials,       // [splits, M, 2I] when gridDim.z > 1 (not with CLUSTER_SPLITS)
    int* __restrict__ counters,         // [gridDim.x * gridDim.y], zero before and after (not with CLUSTER_SPLITS)
    int M, int inner, int K, int group_shift, int zero_mode, int segs_per_split) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int N = 2 * inner;
  const int gate_row0 = blockIdx.x * 64 + (warp & 3) * 16 + g;  // also the output column
  const bool rows_exist = gate_row0 - g < inner;  // whole 16-row tiles: the same for every lane of the warp
  // idle tiles get row N: the split-K epilogue's row < N tests then skip them (an up row would be a live one)
  const int row0 = !rows_exist ? N : warp < 4 ? gate_row0 : gate_row0 + inner;
  const int tok0 = blockIdx.y * 8 * TT;
  const int seg_begin = blockIdx.z * segs_per_split;
  const int seg_end = min(K >> 7, seg_begin + segs_per_split);
  const TcRows<SCALE_F32> rows =
      tc_rows<SCALE_F32>(qweight, scales, zeros, rows_exist ? row0 : 0, 8, t, K, group_shift);
  __shared__ uint4 xs[Staged<TT>::SEGS * TT * 4][32];
  launch_dependents();
  float acc[TT][4];
  tcs_sums<DT, TT, MODE>(xs, rows, rows_exist, x, seg_begin, seg_end, tok0, M, K, group_shift, zero_mode, acc);
  bool summed;  // this CTA holds the tile's sums (the last split to finish, or split 0 of a cluster)
  if constexpr (CLUSTER_SPLITS) {
    summed = reduce_cluster_splits<TT>(acc, reinterpret_cast<float*>(&xs[0][0]));
  } else {
    summed = reduce_splits<TT>(acc, partials, counters, row0, tok0, t, M, N);
  }
  if (!summed) return;
  // up's outputs go through xs, which no warp reads any more once all have passed the barrier
  float (*up)[TT * 4][32] = reinterpret_cast<float (*)[TT * 4][32]>(&xs[0][0]);
  __syncthreads();
  if (warp >= 4 && rows_exist) {
#pragma unroll
    for (int tt = 0; tt < TT; ++tt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float b = bias != nullptr ? Num<DT>::to_float(bias[row0 + 8 * (e >> 1)]) : 0.0f;
        up[warp - 4][tt * 4 + e][lane] = Num<DT>::to_float(Num<DT>::from_float(acc[tt][e] + b));
      }
  }
  __syncthreads();
  if (warp >= 4 || !rows_exist) return;
#pragma unroll
  for (int tt = 0; tt < TT; ++tt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = gate_row0 + 8 * (e >> 1), tok = tok0 + tt * 8 + 2 * t + (e & 1);
      if (tok >= M) continue;
      const float b = bias != nullptr ? Num<DT>::to_float(bias[row]) : 0.0f;
      const float gate = Num<DT>::to_float(Num<DT>::from_float(acc[tt][e] + b));
      const float act = Num<DT>::to_float(Num<DT>::from_float(gate_activation<ACT>(gate)));
      out[(i64)tok * inner + row] = Num<DT>::from_float(act * up[warp][tt * 4 + e][lane]);
    }
  }
}
