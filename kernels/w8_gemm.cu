// W8A16 product on tensor cores for 1 to 64 tokens: out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]), reading the
// 8-bit PackedWeight of core/quant/packed.py as it is stored (qweight int32 [N, K/4], code j of word w is k = 4w + j
// at bits 8j; GGUF Q8_0 re-packed exactly, or round-to-nearest 8-bit), dequantized in registers.
//
// w8_gemm_kernel<DT, TT, RW, ZMODE, SCALE_F32>: a CTA of 8 warps owns RW 16-row tiles (the mma.sync m16n8k16 A
// operand) and TT 8-token tiles (the n = 8 operand). Warp w = kw * RW + rw takes row tile rw and, of the CTA's K
// range, the 64-code segments kw, kw + KW, kw + 2 KW, ... (KW = 8 / RW warps share a row tile). The RW warps of one K
// step read the same activations, so from the second on they come from L1: RW trades x traffic from L2 (8 TT tokens
// of x a 16 rows of weights with RW = 1) for warps along K. A weight code is dequantized once per CTA, for all its
// token tiles (grid.y > 1 only beyond 64 tokens).
//
// Split-K over a thread-block cluster (SM90+): grid.z CTAs of one output tile are one cluster (dims (1, 1, splits)),
// split s covering segments [s * segs_per_split, (s + 1) * segs_per_split), so a product of few row tiles or a long K
// still fills the GPU. Every warp leaves its fp32 sums in its CTA's shared memory; after the cluster barrier the
// cluster's warps share out the tile's outputs and add each through distributed shared memory in a fixed order
// (split, then warp along K), so the result does not depend on timing. Without clusters (SM80-89) there is one split
// and the same sum over the warps along K.
//
// Thread (g = lane / 4, t = lane % 4) holds rows g and g + 8 and, of each segment, the 16 codes at k = 64 seg + 16 t
// (one 16-byte load a row): word j of them gives mma step j, its codes (0, 1) as the A pair of k (2t, 2t + 1) and
// (2, 3) as that of k (2t + 8, 2t + 9). The activations take the same physical k: for step j the two words at
// x[tok][64 seg + 16 t + 4 j ..], so the B pairs load in natural order (two 16-byte loads a token and segment). Every
// k of the segment meets exactly one step, so the sum is unchanged.
//
// Dequantization is core.quant.packing.dequantize's fp32 arithmetic, each operation rounded on its own, then one
// rounding to DT (the weight equals the reference's dequantized weight bit for bit): a code byte placed under the
// exponent of 2^23 (one PRMT) is 2^23 + q exactly, then
//   ZMODE 0 (zero points, all whole numbers, Q8_0's 128): (2^23 + q) - (2^23 + z) = q - z exactly, times s;
//   ZMODE 1 ("min"): q * s + m;   ZMODE 2 (zero points that are not whole numbers): (q - z) * s.
// A 16-code span lies in one group (group sizes are multiples of 32), so each thread loads one scale and zero a row;
// its group is kc / group_size = umulhi(kc, group_magic) with group_magic = ceil(2^32 / group_size), exact while
// kc * group_size < 2^32 (the launcher checks K <= 2^16), one instruction in place of an integer division.
#include "wgmma.cuh"

constexpr int W8_WARPS = 8;
constexpr int W8_SEGMENT = 64;  // codes of K per warp step: 16 per thread of a quad
constexpr float TWO_23 = 8388608.0f;

// Code c of a word as the float 2^23 + code: the byte under the exponent bits of 2^23 (0x4B000000).
template <int C>
__device__ __forceinline__ float magic_code(u32 word) {
  return __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7440 | C));
}

template <int ZMODE>
__device__ __forceinline__ float dequant(float magic_q, float s, float z) {
  if constexpr (ZMODE == 0) {
    return __fmul_rn(__fsub_rn(magic_q, z), s);  // z holds 2^23 + zero point
  } else if constexpr (ZMODE == 1) {
    return __fadd_rn(__fmul_rn(__fsub_rn(magic_q, TWO_23), s), z);
  } else {
    return __fmul_rn(__fsub_rn(__fsub_rn(magic_q, TWO_23), z), s);
  }
}

template <int SCALE_F32>
__device__ __forceinline__ float load_group_value(const void* base, i64 index) {
  if constexpr (SCALE_F32) {
    return __ldg(reinterpret_cast<const float*>(base) + index);
  } else {
    return Num<0>::to_float(__ldg(reinterpret_cast<const u16*>(base) + index));
  }
}

// One segment of a thread's two rows: 4 words each and their group's scale and zero term.
struct W8Segment {
  uint4 codes[2];
  float s[2], z[2];
};

template <int ZMODE, int SCALE_F32>
__device__ __forceinline__ void load_w8_segment(W8Segment& d, int seg, int seg_end, const u32* __restrict__ qweight,
                                                const void* __restrict__ scales, const void* __restrict__ zeros,
                                                int row0, int t, int N, int K, int num_groups, int group_magic) {
  const int kc = seg * W8_SEGMENT + 16 * t;
  const int group_of_kc = (int)__umulhi((u32)kc, (u32)group_magic);  // kc / group_size
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + 8 * r;
    const bool valid = seg < seg_end && kc < K && row < N;
    d.codes[r] = valid ? __ldg(reinterpret_cast<const uint4*>(qweight + (i64)row * (K / 4) + kc / 4))
                       : make_uint4(0, 0, 0, 0);
    float s = 0.0f, z = 0.0f;
    if (valid) {
      const i64 group = (i64)row * num_groups + group_of_kc;
      s = load_group_value<SCALE_F32>(scales, group);
      z = load_group_value<SCALE_F32>(zeros, group);
    }
    d.s[r] = s;
    d.z[r] = ZMODE == 0 ? z + TWO_23 : z;  // exact: a whole zero point of at most 2^23
  }
}

// The A pairs of one word of a row: (codes 0, 1) and (codes 2, 3), dequantized.
template <int DT, int ZMODE>
__device__ __forceinline__ void word_pairs(u32 word, float s, float z, u32& lo, u32& hi) {
  lo = Num<DT>::pack(dequant<ZMODE>(magic_code<0>(word), s, z), dequant<ZMODE>(magic_code<1>(word), s, z));
  hi = Num<DT>::pack(dequant<ZMODE>(magic_code<2>(word), s, z), dequant<ZMODE>(magic_code<3>(word), s, z));
}

template <int DT, int TT, int ZMODE>
__device__ __forceinline__ void mma_w8_segment(const W8Segment& d, int seg, int seg_end, const u16* __restrict__ x,
                                               int tok0, int g, int t, int M, int K, float (&acc)[TT][4]) {
  if (seg >= seg_end) return;  // uniform across the warp
  const int kc = seg * W8_SEGMENT + 16 * t;
  u32 a[4][4];  // [step j][a0, a1, a2, a3]
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const u32 words[4] = {d.codes[r].x, d.codes[r].y, d.codes[r].z, d.codes[r].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) word_pairs<DT, ZMODE>(words[j], d.s[r], d.z[r], a[j][r], a[j][r + 2]);
  }
#pragma unroll
  for (int tt = 0; tt < TT; ++tt) {
    const int tok = tok0 + tt * 8 + g;
    const bool valid = tok < M && kc < K;
    const uint4* xv = reinterpret_cast<const uint4*>(x + (i64)tok * K + kc);
    const uint4 u0 = valid ? __ldg(xv) : make_uint4(0, 0, 0, 0);
    const uint4 u1 = valid ? __ldg(xv + 1) : make_uint4(0, 0, 0, 0);
    const u32 b[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};  // x[kc + 2i], x[kc + 2i + 1]
#pragma unroll
    for (int j = 0; j < 4; ++j) Num<DT>::mma(acc[tt], a[j][0], a[j][1], a[j][2], a[j][3], b[2 * j], b[2 * j + 1]);
  }
}

// The tile's sums: every warp's partial sums [TT * 4][32] are in `partial` of each split's CTA (visible to the cluster
// after the barrier). The sums i of row tile rw are shared out over the tile's warps along K of every split, warp kw
// of split z taking i = kw + KW z, kw + KW (z + splits), ...; it adds split 0's warps of the tile in k order, then
// split 1's, ..., and stores the sums (+ bias) as DT.
template <int DT, int TT, int RW>
__device__ __forceinline__ void sum_and_store(float (&partial)[W8_WARPS][TT * 4][32], const u16* __restrict__ bias,
                                              u16* __restrict__ out, int row0, int tok0, int t, int M, int N) {
  constexpr int KW = W8_WARPS / RW;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int rw = warp % RW, kw = warp / RW;
  const int splits = gridDim.z;
  for (int i = kw + KW * blockIdx.z; i < TT * 4; i += KW * splits) {
    float sum = 0.0f;
    for (int s = 0; s < splits; ++s) {
#pragma unroll
      for (int w = 0; w < KW; ++w) {
        float* p = &partial[w * RW + rw][i][lane];
        sum += splits > 1 ? cluster_load(cluster_address(p, s)) : *p;
      }
    }
    // c0..c3 = (row g, token 2t), (row g, 2t + 1), (row g + 8, 2t), (row g + 8, 2t + 1)
    const int e = i & 3, row = row0 + 8 * (e >> 1), tok = tok0 + (i >> 2) * 8 + 2 * t + (e & 1);
    if (row < N && tok < M) {
      const float b = bias != nullptr ? Num<DT>::to_float(bias[row]) : 0.0f;
      out[(i64)tok * N + row] = Num<DT>::from_float(sum + b);
    }
  }
}

template <int DT, int TT, int RW, int ZMODE, int SCALE_F32>
__global__ void __launch_bounds__(256) w8_gemm_kernel(
    const u16* __restrict__ x,         // [M, K]
    const u32* __restrict__ qweight,   // [N, K / 4]
    const void* __restrict__ scales,   // [N, K / G]
    const void* __restrict__ zeros,    // [N, K / G]
    const u16* __restrict__ bias,      // [N] or null
    u16* __restrict__ out,             // [M, N]
    int M, int N, int K, int group_size, int group_magic, int segs_per_split) {
  constexpr int KW = W8_WARPS / RW;
  __shared__ float partial[W8_WARPS][TT * 4][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int rw = warp % RW, kw = warp / RW;
  const int row0 = (blockIdx.x * RW + rw) * 16 + g;
  const int tok0 = blockIdx.y * 8 * TT;
  const int seg_begin = blockIdx.z * segs_per_split;
  const int seg_end = min((K + W8_SEGMENT - 1) / W8_SEGMENT, seg_begin + segs_per_split);
  const int num_groups = K / group_size;
  launch_dependents();

  // Two segments in flight: the next one's weights load while this one's multiply.
  W8Segment cur, nxt;
  load_w8_segment<ZMODE, SCALE_F32>(cur, seg_begin + kw, seg_end, qweight, scales, zeros, row0, t, N, K, num_groups,
                                    group_magic);
  wait_for_prior_grids();

  float acc[TT][4];
#pragma unroll
  for (int i = 0; i < TT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  for (int seg = seg_begin + kw; seg < seg_end; seg += 2 * KW) {
    load_w8_segment<ZMODE, SCALE_F32>(nxt, seg + KW, seg_end, qweight, scales, zeros, row0, t, N, K, num_groups,
                                      group_magic);
    mma_w8_segment<DT, TT, ZMODE>(cur, seg, seg_end, x, tok0, g, t, M, K, acc);
    load_w8_segment<ZMODE, SCALE_F32>(cur, seg + 2 * KW, seg_end, qweight, scales, zeros, row0, t, N, K, num_groups,
                                      group_magic);
    mma_w8_segment<DT, TT, ZMODE>(nxt, seg + KW, seg_end, x, tok0, g, t, M, K, acc);
  }

#pragma unroll
  for (int tt = 0; tt < TT; ++tt)
#pragma unroll
    for (int e = 0; e < 4; ++e) partial[warp][tt * 4 + e][lane] = acc[tt][e];
  const bool clustered = gridDim.z > 1;
  if (clustered) {
    cluster_barrier<true>();  // every split's partial sums are visible to the cluster
  } else {
    __syncthreads();
  }
  sum_and_store<DT, TT, RW>(partial, bias, out, row0, tok0, t, M, N);
  if (clustered) cluster_barrier<false>();  // every split's shared memory stays until the cluster has read it
}

// w8_wgmma_kernel<DT, TOK, ZMODE, SCALE_F32> (SM90a, 17-64 tokens): wgmma m64nTOKk16 with the dequantized codes as
// the A operand from registers and the activations as B from shared memory. A CTA is two warpgroups over 128 rows
// (warp w owns rows 16 w .. 16 w + 15, the layout of one mma.sync A tile, so each thread keeps the W8Segment loads
// and the dequantization of w8_gemm_kernel: rows g and g + 8, 16 codes of each a 64-k stage, the weights bit for
// bit the reference's) and TOK tokens (grid.y further blocks of TOK). K runs in stages of 64 k; the CTAs of one
// output tile split the stages over a thread-block cluster (grid.z) as w8_gemm_kernel does, the sums meeting
// through distributed shared memory in split order.
//
// Activations. A thread's step j pairs are the codes of physical k 16 t + 4 j + (0, 1) (logical kk 2t, 2t + 1) and
// + (2, 3) (kk 2t + 8, 2t + 9), so B must hold, at logical k 16 j + kk of the stage, the physical k
// 16 ((kk & 7) >> 1) + 4 j + (kk & 1) + 2 (kk >> 3). In 32-bit pairs: logical word t of logical 16-byte chunk L
// (L = 2 j + (kk >> 3)) is physical word 8 t + L, i.e. word L % 4 of physical chunk 2 t + L / 4. A thread that loads
// the four physical chunks 2 t + q (t = 0..3, one token, q = 0 or 1) holds logical chunks 4 q .. 4 q + 3 as a 4 x 4
// transpose of its registers: no instruction beyond the 16-byte loads and stores. The stage is TOK token rows of 128
// bytes in the 128-byte swizzle (chunk L of row n at L ^ (n % 8)) that the wgmma descriptor reads, in a ring of
// W8W_STAGES slots: the activations of stage i + 2 go from registers into the slot of stage i - 1 after stage i's
// products, their loads issued a stage earlier; the weights are loaded into registers two stages ahead.
constexpr int W8W_THREADS = 256;
constexpr int W8W_ROWS = 128;  // two warpgroups of 64 rows
constexpr int W8W_STAGES = 3;

__device__ __forceinline__ void fence_async_shared() {
#ifdef HAS_WGMMA
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // st.shared before wgmma reads it
#endif
}

// A thread's weight stream: rows g and g + 8 of its warp, 16 codes at k = 64 kb + 16 t of stage kb, with the
// addresses that do not change from stage to stage worked out once: kb_limit is the first stage the codes do not
// reach (past the split or past K).
struct W8WWeights {
  const u32* codes[2];  // the row's word of k = 16 t
  const void* group_base[2] = {nullptr, nullptr};  // scales / zeros index of the row's group 0, as an offset
  i64 group_row[2];
  bool valid[2];
  int kb_limit, group_magic;
};

template <int ZMODE, int SCALE_F32>
__device__ __forceinline__ void load_w8w_stage(W8Segment& d, const W8WWeights& w, int kb, int t,
                                               const void* __restrict__ scales, const void* __restrict__ zeros) {
  const u32 kc = (u32)(kb * W8_SEGMENT + 16 * t);
  const int group = (int)__umulhi(kc, (u32)w.group_magic);  // kc / group_size
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const bool valid = w.valid[r] && kb < w.kb_limit;
    d.codes[r] = valid ? __ldg(reinterpret_cast<const uint4*>(w.codes[r] + kb * (W8_SEGMENT / 4)))
                       : make_uint4(0, 0, 0, 0);
    float s = 0.0f, z = 0.0f;
    if (valid) {
      s = load_group_value<SCALE_F32>(scales, w.group_row[r] + group);
      z = load_group_value<SCALE_F32>(zeros, w.group_row[r] + group);
    }
    d.s[r] = s;
    d.z[r] = ZMODE == 0 ? z + TWO_23 : z;  // exact: a whole zero point of at most 2^23
  }
}

// One thread's share of a stage's activations: physical chunks 2 t + q (t = 0..3) of token n (thread i < 2 TOK:
// n = i / 2, q = i % 2); zeros past M or K. chunk_limit[t]: the first stage chunk t does not reach.
struct W8WActivations {
  uint4 chunk[4];
};

__device__ __forceinline__ void load_activations(W8WActivations& a, const u16* __restrict__ src, int kb,
                                                 const int (&chunk_limit)[4]) {
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    a.chunk[t] = kb < chunk_limit[t] ? __ldg(reinterpret_cast<const uint4*>(src + kb * W8_SEGMENT + 16 * t))
                                     : make_uint4(0, 0, 0, 0);
  }
}

// Logical chunk 4 q + i of row n is word i of each physical chunk, in t order.
__device__ __forceinline__ void store_activations(const W8WActivations& a, unsigned char* slot, int n, int q,
                                                  bool stores) {
  if (!stores) return;
  const u32 w[4][4] = {{a.chunk[0].x, a.chunk[0].y, a.chunk[0].z, a.chunk[0].w},
                       {a.chunk[1].x, a.chunk[1].y, a.chunk[1].z, a.chunk[1].w},
                       {a.chunk[2].x, a.chunk[2].y, a.chunk[2].z, a.chunk[2].w},
                       {a.chunk[3].x, a.chunk[3].y, a.chunk[3].z, a.chunk[3].w}};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int chunk = 4 * q + i;
    *reinterpret_cast<uint4*>(slot + n * 128 + ((chunk ^ (n & 7)) << 4)) = make_uint4(w[0][i], w[1][i], w[2][i], w[3][i]);
  }
}

template <int DT, int TOK, int ZMODE, int SCALE_F32>
__global__ void __launch_bounds__(W8W_THREADS, 2) w8_wgmma_kernel(
    const u16* __restrict__ x,         // [M, K]
    const u32* __restrict__ qweight,   // [N, K / 4]
    const void* __restrict__ scales,   // [N, K / G]
    const void* __restrict__ zeros,    // [N, K / G]
    const u16* __restrict__ bias,      // [N] or null
    u16* __restrict__ out,             // [M, N]
    int M, int N, int K, int group_size, int group_magic, int stages_per_split) {
  static_assert(TOK % 16 == 0 && TOK <= 64, "m64nTOKk16 with TOK a multiple of 16");
  constexpr int SLOT = TOK * 128;
  constexpr int VALUES = TOK / 2;  // accumulators a thread: 4 a token tile of 8
  constexpr int RING = W8W_STAGES * SLOT, PARTIAL = VALUES * W8W_THREADS * 4;
  // the ring, then (after the last stage) each thread's fp32 sums [VALUES][W8W_THREADS] for the cluster's sum
  __shared__ __align__(1024) unsigned char smem[RING > PARTIAL ? RING : PARTIAL];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * W8W_ROWS + warp * 16 + g;
  const int tok0 = blockIdx.y * TOK;
  const int num_kb = (K + W8_SEGMENT - 1) / W8_SEGMENT;
  const int kb_begin = blockIdx.z * stages_per_split;
  const int kb_end = min(num_kb, kb_begin + stages_per_split);
  const int num_groups = K / group_size;
  launch_dependents();

  W8WWeights w;
  w.kb_limit = min(kb_end, (K - 16 * t + W8_SEGMENT - 1) / W8_SEGMENT);
  w.group_magic = group_magic;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + 8 * r;
    w.valid[r] = row < N;
    w.codes[r] = qweight + (i64)min(row, N - 1) * (K / 4) + 4 * t;
    w.group_row[r] = (i64)min(row, N - 1) * num_groups;
  }
  // the threads that stage activations: token tid / 2, the physical chunks of parity tid % 2
  const bool copies = tid < 2 * TOK;
  const int x_n = tid >> 1, x_q = tid & 1, x_tok = tok0 + x_n;
  const u16* x_src = x + (i64)min(x_tok, M - 1) * K + 8 * x_q;
  int chunk_limit[4];
#pragma unroll
  for (int c = 0; c < 4; ++c)
    chunk_limit[c] = copies && x_tok < M ? min(kb_end, (K - 8 * (2 * c + x_q) + W8_SEGMENT - 1) / W8_SEGMENT) : 0;

  // weights two stages ahead (no earlier kernel writes them: before the programmatic-launch wait)
  W8Segment wb[3];
  load_w8w_stage<ZMODE, SCALE_F32>(wb[0], w, kb_begin, t, scales, zeros);
  load_w8w_stage<ZMODE, SCALE_F32>(wb[1], w, kb_begin + 1, t, scales, zeros);
  wait_for_prior_grids();
  W8WActivations xa;
#pragma unroll
  for (int s = 0; s < W8W_STAGES - 1; ++s) {
    load_activations(xa, x_src, kb_begin + s, chunk_limit);
    store_activations(xa, smem + s * SLOT, x_n, x_q, copies);
  }
  load_activations(xa, x_src, kb_begin + W8W_STAGES - 1, chunk_limit);
  fence_async_shared();
  __syncthreads();

  float acc[VALUES];
#pragma unroll
  for (int v = 0; v < VALUES; ++v) acc[v] = 0.0f;
  // Stage kb from ring slot `slot` with weights `cur`; loads the weights of kb + 2 into `far`, stores the activations
  // of kb + 2 into the slot of kb - 1 (every warp passed the barrier after reading it) and loads those of kb + 3.
  auto stage = [&](int kb, int slot, W8Segment& cur, W8Segment& far) {
    load_w8w_stage<ZMODE, SCALE_F32>(far, w, kb + 2, t, scales, zeros);
    const unsigned char* ring_slot = smem + slot * SLOT;
    // A step at a time into register set j % 2 while step j - 1's wgmma runs (the wait after each commit leaves
    // one group in flight, so the set rewritten next belongs to a finished group)
    u32 a[2][4];
    const u32 words[2][4] = {{cur.codes[0].x, cur.codes[0].y, cur.codes[0].z, cur.codes[0].w},
                             {cur.codes[1].x, cur.codes[1].y, cur.codes[1].z, cur.codes[1].w}};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      u32(&aj)[4] = a[j & 1];
      word_pairs<DT, ZMODE>(words[0][j], cur.s[0], cur.z[0], aj[0], aj[2]);  // row g
      word_pairs<DT, ZMODE>(words[1][j], cur.s[1], cur.z[1], aj[1], aj[3]);  // row g + 8
#pragma unroll
      for (int v = 0; v < VALUES; ++v) hold(acc[v]);  // no register moves of the sums in flight
      wgmma_fence();
      wgmma_rs<DT, TOK>(acc, aj, swizzled_desc(ring_slot + 32 * j));
      wgmma_commit();
      if (j < 3) {
        wgmma_wait<1>();
#pragma unroll
        for (int e = 0; e < 4; ++e) hold(a[(j + 1) & 1][e]);
      }
    }
    wgmma_wait<0>();
    store_activations(xa, smem + (slot == 0 ? W8W_STAGES - 1 : slot - 1) * SLOT, x_n, x_q, copies);
    load_activations(xa, x_src, kb + W8W_STAGES, chunk_limit);
    fence_async_shared();
    __syncthreads();
  };
  // three stages a trip, so the weight buffers and ring slots rotate by name, not by register moves
  static_assert(W8W_STAGES == 3, "a trip's stages match the ring's slots");
  for (int kb = kb_begin; kb < kb_end; kb += 3) {
    stage(kb, 0, wb[0], wb[2]);
    if (kb + 1 >= kb_end) break;
    stage(kb + 1, 1, wb[1], wb[0]);
    if (kb + 2 >= kb_end) break;
    stage(kb + 2, 2, wb[2], wb[1]);
  }

  // d[4 i + e] is (row g + 8 (e / 2), token 8 i + 2 t + e % 2) of the warp's 16 rows
  const bool clustered = gridDim.z > 1;
  if (clustered) {
    float* partial = reinterpret_cast<float*>(smem);  // the ring is done (the loop's last barrier)
#pragma unroll
    for (int v = 0; v < VALUES; ++v) partial[v * W8W_THREADS + tid] = acc[v];
    cluster_barrier<true>();  // every split's sums are visible to the cluster
    for (int v = blockIdx.z; v < VALUES; v += gridDim.z) {
      float sum = 0.0f;
      for (int s = 0; s < (int)gridDim.z; ++s) sum += cluster_load(cluster_address(&partial[v * W8W_THREADS + tid], s));
      const int row = row0 + 8 * ((v & 3) >> 1), tok = tok0 + (v >> 2) * 8 + 2 * t + (v & 1);
      if (row < N && tok < M) {
        const float b = bias != nullptr ? Num<DT>::to_float(bias[row]) : 0.0f;
        out[(i64)tok * N + row] = Num<DT>::from_float(sum + b);
      }
    }
    cluster_barrier<false>();  // every split's shared memory stays until the cluster has read it
  } else {
#pragma unroll
    for (int e2 = 0; e2 < 2; ++e2) {
      const int row = row0 + 8 * e2;
      if (row >= N) continue;
      const float b = bias != nullptr ? Num<DT>::to_float(bias[row]) : 0.0f;
#pragma unroll
      for (int i = 0; i < TOK / 8; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int tok = tok0 + 8 * i + 2 * t + e;
          if (tok < M) out[(i64)tok * N + row] = Num<DT>::from_float(acc[4 * i + 2 * e2 + e] + b);
        }
    }
  }
}
