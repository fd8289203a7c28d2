// W8A16 product on tensor cores for 1 to 64 tokens: out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]), reading the
// 8-bit PackedWeight of core/quant/packed.py as it is stored (qweight int32 [N, K/4], code j of word w is k = 4w + j
// at bits 8j; GGUF Q8_0 re-packed exactly, or round-to-nearest 8-bit), dequantized in registers.
//
// w8_gemm_kernel<DT, TT, RW, RT, DEPTH, ZMODE, SCALE_F32>: a CTA of 8 warps owns RW x RT 16-row tiles (the mma.sync
// m16n8k16 A operand) and TT 8-token tiles (the n = 8 operand). Warp w = kw * RW + rw takes row tiles
// rw * RT .. rw * RT + RT - 1 and the kw-th of KW = 8 / RW contiguous parts of the CTA's K range, one 64-code
// segment a step. The CTA's activations of a step (8 TT tokens x one segment of each of the KW parts) are copied
// into shared memory once (cp.async, a ring of DEPTH stages) and read by all its warps; every 16-byte activation
// load feeds 2 RT mma (RT row tiles x the two steps of a 32-code block), so x's traffic from L2 is 16 TT bytes a
// K-code for 16 RW RT rows of weights.
//
// Split-K over a thread-block cluster (SM90+): grid.z CTAs of one output tile are one cluster (dims (1, 1, splits)),
// split s covering segments [s * segs_per_split, (s + 1) * segs_per_split), so a product of few row tiles or a long K
// still fills the GPU. Every warp leaves its fp32 sums in its CTA's shared memory; after the cluster barrier the
// cluster's warps share out the tile's outputs and add each through distributed shared memory in a fixed order
// (split, then warp along K), so the result does not depend on timing. Without clusters (SM80-89) there is one split
// and the same sum over the warps along K.
//
// Fragments. A 32-code block of K is two mma steps. Thread (g = lane / 4, t = lane % 4) loads the codes k = 8t ..
// 8t + 7 of the block of rows g and g + 8 (8 bytes a row): word j of them is step j, its codes (0, 1) the A pair of
// logical k (2t, 2t + 1) and (2, 3) that of (2t + 8, 2t + 9). The activations take the same physical k: one 16-byte
// shared load of x[tok][8t .. 8t + 7] gives the B pairs of both steps in natural order. Every k of the block meets
// exactly one step, so the sum is unchanged, and a step never leaves its 32-code block: a block lies in one group
// (group sizes are multiples of 32), which lets the group's scale multiply the block's sums.
//
// Dequantization. ZMODE 0 (whole zero points: Q8_0's 128, RTN's) multiplies q - z, then scales the fp32 sums of each
// group once (acc += s * group_acc, at the last block of a group or of the warp's K part): fp16 places two code bytes
// under 1024 (0x64, one PRMT) and subtracts 1024 + z (one HSUB2), exact; bf16 places each byte under the exponent of
// 2^23 (one PRMT), subtracts 2^23 + z in fp32 (exact) and packs two (one F2FP), exact for |q - z| <= 256 (every
// zero point in [0, 255]; others are rounded once). ZMODE 1 ("min": q * s + m) and ZMODE 2 (zero points that are not
// whole numbers: (q - z) * s) dequantize each weight with core.quant.packing.dequantize's fp32 arithmetic, then one
// rounding to DT. A thread's group is kc / group_size = umulhi(kc, group_magic) with group_magic =
// ceil(2^32 / group_size), exact while kc * group_size < 2^32 (the launcher checks K <= 2^16).
#include "common.cuh"

constexpr int W8_WARPS = 8;
constexpr int W8_SEGMENT = 64;  // codes of K a warp multiplies a step: two 32-code blocks
constexpr int W8_BLOCK = 32;
constexpr float TWO_23 = 8388608.0f;

// Code c of a word as the float 2^23 + code: the byte under the exponent bits of 2^23 (0x4B000000).
template <int C>
__device__ __forceinline__ float magic_code(u32 word) {
  return __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7440 | C));
}

template <int SCALE_F32>
__device__ __forceinline__ float load_group_value(const void* base, i64 index) {
  if constexpr (SCALE_F32) {
    return __ldg(reinterpret_cast<const float*>(base) + index);
  } else {
    return Num<0>::to_float(__ldg(reinterpret_cast<const u16*>(base) + index));
  }
}

// A warp's weights of one step: [row tile][row g, g + 8][block] 8 codes, and the block's group scale and zero term
// (ZMODE 0: fp16 the pair (1024 + z, 1024 + z), bf16 2^23 + z as a float's bits; else z as a float's bits).
template <int RT>
struct W8Step {
  uint2 codes[RT][2][2];
  float s[RT][2][2];
  u32 z[RT][2][2];
};

// Where a thread's rows start: row0 + 16 rt + 8 r, clamped to N - 1 (a row past N is multiplied, never stored), in
// words of qweight (plus the thread's 8 codes of a block) and in groups.
template <int RT>
struct W8Rows {
  u32 codes[RT][2];
  u32 groups[RT][2];
};

template <int RT>
__device__ __forceinline__ W8Rows<RT> w8_rows(int row0, int t, int N, int K, int num_groups) {
  W8Rows<RT> rows;
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const u32 row = (u32)min(row0 + rt * 16 + 8 * r, N - 1);
      rows.codes[rt][r] = row * (u32)(K / 4) + 2 * t;
      rows.groups[rt][r] = row * (u32)num_groups;
    }
  return rows;
}

// The weights of segment `seg` (nothing past the warp's K part or past K: those are never multiplied).
template <int DT, int RT, int ZMODE, int SCALE_F32>
__device__ __forceinline__ void load_w8_step(W8Step<RT>& d, int seg, int seg_end, const W8Rows<RT>& rows,
                                             const u32* __restrict__ qweight, const void* __restrict__ scales,
                                             const void* __restrict__ zeros, int K, int group_magic) {
  if (seg >= seg_end) return;  // uniform across the warp
#pragma unroll
  for (int b = 0; b < 2; ++b) {
    const int kblock = seg * W8_SEGMENT + b * W8_BLOCK;
    if (kblock >= K) break;  // uniform
    const u32 group = __umulhi((u32)kblock, (u32)group_magic);  // kblock / group_size
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        d.codes[rt][r][b] = __ldg(reinterpret_cast<const uint2*>(qweight + (rows.codes[rt][r] + (u32)kblock / 4)));
        const float s = load_group_value<SCALE_F32>(scales, rows.groups[rt][r] + group);
        const float z = load_group_value<SCALE_F32>(zeros, rows.groups[rt][r] + group);
        d.s[rt][r][b] = s;
        if constexpr (ZMODE != 0) {
          d.z[rt][r][b] = __float_as_uint(z);
        } else if constexpr (DT == 0) {
          d.z[rt][r][b] = Num<0>::pack(1024.0f + z, 1024.0f + z);
        } else {
          d.z[rt][r][b] = __float_as_uint(TWO_23 + z);  // exact: a whole zero point of at most 2^23
        }
      }
    }
  }
}

// The A pairs of one word of a row: (codes 0, 1) and (codes 2, 3), as q - z (ZMODE 0) or as the weights.
template <int DT, int ZMODE>
__device__ __forceinline__ void word_pairs(u32 word, float s, u32 z, u32& lo, u32& hi) {
  if constexpr (ZMODE == 0 && DT == 0) {
    lo = Num<0>::sub(__byte_perm(word, 0x64646464u, 0x4140), z);
    hi = Num<0>::sub(__byte_perm(word, 0x64646464u, 0x4342), z);
  } else if constexpr (ZMODE == 0) {
    const float m = __uint_as_float(z);
    lo = Num<1>::pack(__fsub_rn(magic_code<0>(word), m), __fsub_rn(magic_code<1>(word), m));
    hi = Num<1>::pack(__fsub_rn(magic_code<2>(word), m), __fsub_rn(magic_code<3>(word), m));
  } else {
    const float zf = __uint_as_float(z);
    float w[4] = {magic_code<0>(word), magic_code<1>(word), magic_code<2>(word), magic_code<3>(word)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float q = __fsub_rn(w[i], TWO_23);
      w[i] = ZMODE == 1 ? __fadd_rn(__fmul_rn(q, s), zf) : __fmul_rn(__fsub_rn(q, zf), s);
    }
    lo = Num<DT>::pack(w[0], w[1]);
    hi = Num<DT>::pack(w[2], w[3]);
  }
}

// The CTA's activations of a step: [KW parts][8 TT tokens][8 16-byte chunks], chunk c of token row r stored at
// c ^ 4 (r & 1): a warp's 16-byte loads of 8 tokens x 4 chunks then meet all 32 banks twice without conflict.
// Thread i copies chunks i, i + 256, ...; W8Copies holds where each comes from at step 0 (a token past M reads
// token M - 1: never stored), where it goes, and for how many steps it is inside the part and K (zero-filled after).
template <int TT, int KW>
struct W8Copies {
  static constexpr int CHUNKS = KW * 8 * TT * 8;
  static constexpr int PER_THREAD = (CHUNKS + W8_WARPS * 32 - 1) / (W8_WARPS * 32);
  u32 src[PER_THREAD];  // u16 offset in x (the launcher checks M K < 2^32)
  u32 dst[PER_THREAD];  // u16 offset in a stage
  int steps[PER_THREAD];
};

template <int TT, int KW>
__device__ __forceinline__ W8Copies<TT, KW> w8_copies(const u16* __restrict__ x, int tok0, int seg_begin,
                                                      int seg_end, int steps, int M, int K) {
  W8Copies<TT, KW> copies;
#pragma unroll
  for (int i = 0; i < W8Copies<TT, KW>::PER_THREAD; ++i) {
    const int c = threadIdx.x + i * W8_WARPS * 32;
    const int part = c / (8 * TT * 8), tok = (c / 8) % (8 * TT), chunk = c % 8;
    const int seg = seg_begin + part * steps;
    copies.src[i] = (u32)min(tok0 + tok, M - 1) * (u32)K + (u32)(seg * W8_SEGMENT + chunk * 8);
    copies.dst[i] = ((part * 8 * TT + tok) * 8 + (chunk ^ ((tok & 1) << 2))) * 8;
    const int k_segments = (K - chunk * 8 + W8_SEGMENT - 1) / W8_SEGMENT;  // segments holding this chunk's k
    copies.steps[i] = c < W8Copies<TT, KW>::CHUNKS ? min(seg_end, k_segments) - seg : -1;
  }
  return copies;
}

template <int TT, int KW>
__device__ __forceinline__ void copy_x_step(u16* slot, int step, int steps, const W8Copies<TT, KW>& copies,
                                            const u16* __restrict__ x) {
  if (step >= steps) return;  // past the last stage: nothing to copy (the group is still committed)
#pragma unroll
  for (int i = 0; i < W8Copies<TT, KW>::PER_THREAD; ++i) {
    if (copies.steps[i] < 0) continue;  // no chunk for this thread
    const bool valid = step < copies.steps[i];
    cp_async16(slot + copies.dst[i], x + (valid ? copies.src[i] + step * W8_SEGMENT : 0), valid);
  }
}

// One step of a warp: both blocks of its segment, each two mma steps a row tile and token tile. ZMODE 0 sums a block
// from zero (the tensor cores take the zero accumulator: no register is cleared) and adds it to acc times the
// block's group scale; the other modes multiply weights already scaled into acc.
template <int DT, int TT, int RT, int KW, int ZMODE>
__device__ __forceinline__ void mma_w8_step(const W8Step<RT>& d, const u16* slot, int seg, int seg_end_warp, int kw,
                                            int g, int t, int K, float (&acc)[RT][TT][4]) {
  if (seg >= seg_end_warp) return;  // uniform across the warp
#pragma unroll
  for (int b = 0; b < 2; ++b) {
    if (seg * W8_SEGMENT + b * W8_BLOCK >= K) break;  // uniform: K ends in the segment's first block
    u32 a[RT][2][4];  // [row tile][step j][a0, a1, a2, a3]
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const u32 words[2] = {d.codes[rt][r][b].x, d.codes[rt][r][b].y};
#pragma unroll
        for (int j = 0; j < 2; ++j)
          word_pairs<DT, ZMODE>(words[j], d.s[rt][r][b], d.z[rt][r][b], a[rt][j][r], a[rt][j][r + 2]);
      }
#pragma unroll
    for (int tt = 0; tt < TT; ++tt) {
      const int tok = tt * 8 + g;
      const int chunk = (4 * b + t) ^ ((g & 1) << 2);
      const uint4 xv = *reinterpret_cast<const uint4*>(slot + ((kw * 8 * TT + tok) * 8 + chunk) * 8);
      const u32 bx[4] = {xv.x, xv.y, xv.z, xv.w};  // x[8t + 2i], x[8t + 2i + 1] of the block
#pragma unroll
      for (int rt = 0; rt < RT; ++rt) {
        if constexpr (ZMODE == 0) {
          float sums[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
          for (int j = 0; j < 2; ++j)
            Num<DT>::mma(sums, a[rt][j][0], a[rt][j][1], a[rt][j][2], a[rt][j][3], bx[2 * j], bx[2 * j + 1]);
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[rt][tt][e] = fmaf(d.s[rt][e >> 1][b], sums[e], acc[rt][tt][e]);
        } else {
#pragma unroll
          for (int j = 0; j < 2; ++j)
            Num<DT>::mma(acc[rt][tt], a[rt][j][0], a[rt][j][1], a[rt][j][2], a[rt][j][3], bx[2 * j], bx[2 * j + 1]);
        }
      }
    }
  }
}

// The tile's sums: every warp's partial sums [RT * TT * 4][32] are in `partial` of each split's CTA (visible to the
// cluster after the barrier). The sums i of row-tile group rw are shared out over its warps along K of every split,
// warp kw of split z taking i = kw + KW z, kw + KW (z + splits), ...; it adds split 0's warps of the group in k
// order, then split 1's, ..., and stores the sums (+ bias) as DT.
template <int DT, int TT, int RW, int RT>
__device__ __forceinline__ void sum_and_store(const float* partial, const u16* __restrict__ bias,
                                              u16* __restrict__ out, int row0, int tok0, int t, int M, int N) {
  constexpr int KW = W8_WARPS / RW, SUMS = RT * TT * 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int rw = warp % RW, kw = warp / RW;
  const int splits = gridDim.z;
  for (int i = kw + KW * blockIdx.z; i < SUMS; i += KW * splits) {
    float sum = 0.0f;
    for (int s = 0; s < splits; ++s) {
#pragma unroll
      for (int w = 0; w < KW; ++w) {
        const float* p = partial + ((w * RW + rw) * SUMS + i) * 32 + lane;
        sum += splits > 1 ? cluster_load(cluster_address(p, s)) : *p;
      }
    }
    // i = (rt * TT + tt) * 4 + e; c0..c3 = (row g, token 2t), (row g, 2t + 1), (row g + 8, 2t), (row g + 8, 2t + 1)
    const int e = i & 3, rt = i / (TT * 4), tt = (i >> 2) % TT;
    const int row = row0 + rt * 16 + 8 * (e >> 1), tok = tok0 + tt * 8 + 2 * t + (e & 1);
    if (row < N && tok < M) {
      const float b = bias != nullptr ? Num<DT>::to_float(bias[row]) : 0.0f;
      out[(i64)tok * N + row] = Num<DT>::from_float(sum + b);
    }
  }
}

// Dynamic shared memory: max(DEPTH stages of KW x 8 TT x 64 activations (DEPTH x KW x TT KiB), the warps' partial sums
// 8 x RT x TT x 4 x 32 floats (RT x TT x 4 KiB)); kernels/w8_gemm.py: shared_bytes.
template <int DT, int TT, int RW, int RT, int DEPTH, int ZMODE, int SCALE_F32>
__global__ void __launch_bounds__(256) w8_gemm_kernel(
    const u16* __restrict__ x,         // [M, K]
    const u32* __restrict__ qweight,   // [N, K / 4]
    const void* __restrict__ scales,   // [N, K / G]
    const void* __restrict__ zeros,    // [N, K / G]
    const u16* __restrict__ bias,      // [N] or null
    u16* __restrict__ out,             // [M, N]
    int M, int N, int K, int group_size, int group_magic, int segs_per_split) {
  static_assert(DEPTH >= 2, "a ring of at least two activation stages");
  constexpr int KW = W8_WARPS / RW;
  constexpr int SLOT = KW * 8 * TT * W8_SEGMENT;  // activations of a stage (u16)
  extern __shared__ __align__(16) unsigned char w8_shared[];
  u16* x_stages = reinterpret_cast<u16*>(w8_shared);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int rw = warp % RW, kw = warp / RW;
  const int row0 = (blockIdx.x * RW + rw) * RT * 16 + g;
  const int tok0 = blockIdx.y * 8 * TT;
  const int seg_begin = blockIdx.z * segs_per_split;
  const int seg_end = min((K + W8_SEGMENT - 1) / W8_SEGMENT, seg_begin + segs_per_split);
  const int steps = segs_per_split / KW;  // the launcher makes segs_per_split a multiple of KW
  const int warp_begin = seg_begin + kw * steps, warp_end = min(seg_end, warp_begin + steps);
  const int num_groups = K / group_size;
  launch_dependents();

  // Weights one step ahead in registers, activations DEPTH - 1 stages ahead in shared memory.
  const W8Rows<RT> rows = w8_rows<RT>(row0, t, N, K, num_groups);
  W8Step<RT> cur, nxt;
  load_w8_step<DT, RT, ZMODE, SCALE_F32>(cur, warp_begin, warp_end, rows, qweight, scales, zeros, K, group_magic);
  wait_for_prior_grids();
  const W8Copies<TT, KW> copies = w8_copies<TT, KW>(x, tok0, seg_begin, seg_end, steps, M, K);
#pragma unroll
  for (int s = 0; s < DEPTH - 1; ++s) {
    copy_x_step<TT, KW>(x_stages + s * SLOT, s, steps, copies, x);
    cp_async_commit();
  }

  float acc[RT][TT][4];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int i = 0; i < TT; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[rt][i][e] = 0.0f;

  // Stage s: wait for its activations, then (every warp being past stage s - 1) refill that slot with stage
  // s + DEPTH - 1, load the next step's weights and multiply.
  auto begin_stage = [&](int s) {
    cp_async_wait<DEPTH - 2>();
    __syncthreads();
    copy_x_step<TT, KW>(x_stages + ((s + DEPTH - 1) % DEPTH) * SLOT, s + DEPTH - 1, steps, copies, x);
    cp_async_commit();
  };
  for (int s = 0; s < steps; s += 2) {
    begin_stage(s);
    load_w8_step<DT, RT, ZMODE, SCALE_F32>(nxt, warp_begin + s + 1, warp_end, rows, qweight, scales, zeros, K,
                                           group_magic);
    mma_w8_step<DT, TT, RT, KW, ZMODE>(cur, x_stages + (s % DEPTH) * SLOT, warp_begin + s, warp_end, kw, g, t, K,
                                       acc);
    if (s + 1 >= steps) break;  // uniform across the CTA
    begin_stage(s + 1);
    load_w8_step<DT, RT, ZMODE, SCALE_F32>(cur, warp_begin + s + 2, warp_end, rows, qweight, scales, zeros, K,
                                           group_magic);
    mma_w8_step<DT, TT, RT, KW, ZMODE>(nxt, x_stages + ((s + 1) % DEPTH) * SLOT, warp_begin + s + 1, warp_end, kw,
                                       g, t, K, acc);
  }

  cp_async_wait<0>();
  __syncthreads();  // every warp is done with the activation stages: the partial sums take their place
  float* partial = reinterpret_cast<float*>(w8_shared);
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int tt = 0; tt < TT; ++tt)
#pragma unroll
      for (int e = 0; e < 4; ++e) partial[(warp * RT * TT * 4 + (rt * TT + tt) * 4 + e) * 32 + lane] = acc[rt][tt][e];
  const bool clustered = gridDim.z > 1;
  if (clustered) {
    cluster_barrier<true>();  // every split's partial sums are visible to the cluster
  } else {
    __syncthreads();
  }
  sum_and_store<DT, TT, RW, RT>(partial, bias, out, row0, tok0, t, M, N);
  if (clustered) cluster_barrier<false>();  // every split's shared memory stays until the cluster has read it
}
