// W4A16 GEMM on tensor cores for batches of 9 to 256 tokens: out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]),
// reading the packed weight of core/quant/packed.py as it is stored (qweight int32 [N, K/8], code j of word w is
// k = 8w + j at bits 4j), so one copy of the weight serves this kernel and the few-token kernels alike.
//
// One kernel, w4_gemm_kernel<DT, ZMODE, WGMMA, A, B, C, STAGES>, with two tensor-core paths: mma.sync (WGMMA false,
// SM80+) and wgmma (WGMMA true, SM90a). Both compute Y^T = W . X^T: the weight is the A operand (16 output features a
// warp fragment), the tokens are the N operand, so a batch pads to a multiple of 8 (mma.sync) or of the wgmma width,
// not of 16 or 64. A CTA owns ROWS output features and TOKENS tokens and walks K in stages of 128 through a cp.async
// pipeline STAGES deep (a stage's weights, scale pairs and activations land in shared memory together; weights and
// scales of the first stages are fetched before the PDL wait, since no earlier kernel writes them); a grid z > 1 splits
// K.
//
// mma.sync path (m16n8k16; A, B, C = WARPS, RW, TT): WARPS warps of RW 16-row tiles each, all TT 8-token tiles. The k
// order inside a stage is a permutation chosen so both operands load with 16-byte accesses and the weights unpack
// with one LOP3 a pair. Thread (g = lane / 4, t = lane % 4) owns the 32 physical k of its chunk t of each 128 k:
// one uint4 of each weight row (g and g + 8 of a tile) and one uint4 per 8 k of each token row. Word i of the chunk
// (8 codes, physical k 8i .. 8i + 7) gives two mma steps:
//   step 0: a0 = row g codes (0, 4), a1 = row g+8 codes (0, 4), a2 = row g (1, 5), a3 = row g+8 (1, 5)
//   step 1: the same with codes (2, 6) and (3, 7)
// (pair P_p = codes (p, p + 4) = (word >> 4p) & 0x000F000F), and the activations take the same k: B pairs (e0, e4),
// (e1, e5) for step 0 and (e2, e6), (e3, e7) for step 1 of the token's 8 values. Every physical k of the stage
// meets exactly one step, so the sum is unchanged.
//
// wgmma path (wgmma.mma_async m64nNk16, A from registers; A, B, C = WG, MT, NTOK): WG warpgroups of MT 64-row
// tiles each, all TOKENS tokens as the wgmma N (one instruction up to 64, 64-wide sub-tiles beyond). wgmma reads the
// activations from shared memory in their natural k order (K-major rows of 128 bytes, 128-byte swizzle), so each
// thread unpacks the natural A fragment: codes (2t, 2t + 1) and (2t + 8, 2t + 9) of its rows in each k16 step,
// i.e. byte t of two consecutive weight words. The tensor cores run asynchronously while the warps unpack the next
// step's weights (three A register sets, two wgmma groups in flight).
//
// Dequantization is exact in the pair type for integer zero points: (1024 + q) or (128 + q) from the magic
// exponent, plus -(magic + z), times the scale, one rounding (fp16: the reference's value bit for bit; bf16: the
// scale is rounded to bf16 when the scale pairs are laid out). ZMODE 0: W = (q - z) * s; ZMODE 1: W = q * s + m.
// Scales and zero terms come pre-paired per 16-row tile (kernels/w4_gemm.py gemm_scales): sz[tile][group][g] =
// (s pair, z pair) with lo = row g, hi = row g + 8, in the activation type.
#include "wgmma.cuh"

constexpr int GEMM_BK = 128;  // k per pipeline stage

// ---------------------------------------------------------------------------------------------------------------
// Pair arithmetic

template <int DT> __device__ __forceinline__ u32 pair_mul(u32 a, u32 b);
template <> __device__ __forceinline__ u32 pair_mul<0>(u32 a, u32 b) {
  u32 d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
template <> __device__ __forceinline__ u32 pair_mul<1>(u32 a, u32 b) {
  return Num<1>::fma(a, b, 0x80008000u);  // a * b + (-0): mul.bf16x2 needs sm_90
}

// (bits & 0x000F000F) | magic: two codes, one in each half, as a pair of integer-valued DT (magic + q).
template <int DT>
__device__ __forceinline__ u32 magic_codes(u32 bits) {
  u32 out;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(out) : "r"(bits), "r"(0x000F000Fu), "r"(Num<DT>::MAGIC));
  return out;
}

// Codes (p, p + 4) of an 8-code word: the mma.sync kernel's permuted pairs.
template <int DT, int P>
__device__ __forceinline__ u32 strided_pair(u32 word) { return magic_codes<DT>(word >> (4 * P)); }

// Codes (2t, 2t + 1) of an 8-code word (byte t, its low code in the low half): the natural pairs of the wgmma
// kernel. `shift` = 8t; the high code is brought to bit 16 from the same byte.
template <int DT>
__device__ __forceinline__ u32 byte_pair(u32 word, int shift) {
  const u32 y = word >> shift;
  u32 merged;
  asm("lop3.b32 %0, %1, %2, %3, 0xE4;" : "=r"(merged) : "r"(y), "r"(y << 12), "r"(0x0000000Fu));  // (y & c) | (y<<12 & ~c)
  return magic_codes<DT>(merged);
}

template <int DT> __device__ __forceinline__ u32 pair_add(u32 a, u32 b);
template <> __device__ __forceinline__ u32 pair_add<0>(u32 a, u32 b) {
  u32 d;
  asm("add.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
template <> __device__ __forceinline__ u32 pair_add<1>(u32 a, u32 b) {
  return Num<1>::fma(a, 0x3F803F80u, b);  // a * 1 + b: add.bf16x2 needs sm_90
}

// The (negated) magic exponent as a pair: magic_q + MINUS_MAGIC = q.
template <int DT> struct MinusMagic;
template <> struct MinusMagic<0> { static constexpr u32 PAIR = 0xE400E400u; };  // -1024
template <> struct MinusMagic<1> { static constexpr u32 PAIR = 0xC300C300u; };  // -128

template <int DT, int ZMODE>
__device__ __forceinline__ u32 dequant_pair(u32 magic_q, u32 scale, u32 zero) {
  if constexpr (ZMODE == 0) {
    return pair_mul<DT>(pair_add<DT>(magic_q, zero), scale);  // zero = -(magic + z): the sum is q - z, exact
  } else {
    return Num<DT>::fma(pair_add<DT>(magic_q, MinusMagic<DT>::PAIR), scale, zero);  // zero = m: q * s + m
  }
}

// A thread's scale and zero pairs of one 16-row tile and group: (row g, row g) and (row g + 8, row g + 8).
struct ScalePairs {
  u32 s_lo, s_hi, z_lo, z_hi;
  __device__ __forceinline__ explicit ScalePairs(uint2 p)
      : s_lo(__byte_perm(p.x, 0, 0x1010)), s_hi(__byte_perm(p.x, 0, 0x3232)),
        z_lo(__byte_perm(p.y, 0, 0x1010)), z_hi(__byte_perm(p.y, 0, 0x3232)) {}
};

// The group of input feature k: a shift for power-of-two group sizes, else a division.
__device__ __forceinline__ int group_of(int k, int group_size, int group_shift) {
  return group_shift >= 0 ? k >> group_shift : k / group_size;
}

// The scale slot (group - the stage's first group) of k offset dk into a stage starting at k0. `slot_shift` >= 0:
// the slot is dk >> slot_shift whatever k0 (the launcher sets it for group sizes that divide the stage, and to 31
// for groups that hold whole stages); -1: work it out.
__device__ __forceinline__ int scale_slot(int k0, int dk, int group_size, int group_shift, int slot_shift) {
  if (slot_shift >= 0) return dk >> slot_shift;
  return group_of(k0 + dk, group_size, group_shift) - group_of(k0, group_size, group_shift);
}

// ---------------------------------------------------------------------------------------------------------------
// Tensor-core instructions

// mma.sync m16n8k16 with fp32 accumulation, left free to be scheduled among the other instructions.
template <int DT>
__device__ __forceinline__ void mma_16816(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  if constexpr (DT == 0) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}


// ---------------------------------------------------------------------------------------------------------------
// Tile layouts. A stage in shared memory holds, for the CTA's ROWS x TOKENS tile and 128 k: the packed weights
// (64 bytes a row, W_CHUNKS = 4 chunks of 16 bytes), the activations (256 bytes a token, X_CHUNKS = 16 chunks), and
// the scale pairs of the MAX_GROUPS groups a stage can touch (group sizes are multiples of 32). Both paths keep
// the accumulators as FRAG_R x FRAG_T m16n8 fragments: (row frag_row(r) + g (+8), token 8 tt + 2t (+1)).

// mma.sync tiles. Chunk slots keep each quarter warp's reads on distinct banks: activation rows {2j, 2j + 1} x
// chunks {i, 4 + i, 8 + i, 12 + i}; weight rows are 64 bytes, so a quarter warp reads 128 contiguous bytes.
template <int WARPS, int RW, int TT>
struct MmaTile {
  static constexpr int THREADS = WARPS * 32;
  static constexpr int TILES = WARPS * RW;  // 16-row weight tiles per CTA
  static constexpr int ROWS = TILES * 16;
  static constexpr int TOKENS = TT * 8;
  static constexpr int MAX_GROUPS = GEMM_BK / 32;
  static constexpr int X_OFFSET = 0;
  static constexpr int W_OFFSET = TOKENS * GEMM_BK * 2;
  static constexpr int S_OFFSET = W_OFFSET + ROWS * GEMM_BK / 2;
  static constexpr int STAGE_BYTES = S_OFFSET + TILES * MAX_GROUPS * 64;
  static constexpr int X_ROW_BYTES = GEMM_BK * 2;  // between consecutive token rows
  static constexpr int FRAG_R = RW, FRAG_T = TT;
  static constexpr int OUT_STRIDE = ROWS + 8;  // u16 per token row of the output staging (bank spread)
  static __device__ __forceinline__ int frag_row(int warp, int r) { return (warp * RW + r) * 16; }
  static __device__ __forceinline__ int x_offset(int row, int chunk) {
    return row * (GEMM_BK * 2) + (chunk ^ (((chunk >> 3) & 1) << 1) ^ (row & 1)) * 16;
  }
};

// wgmma tiles: activations as two blocks of TOKENS rows x 128 bytes (64 k each) in the 128-byte swizzle (chunk c of
// row r at c ^ (r % 8)), each block 1024-byte aligned as the descriptor wants.
template <int WG, int MT, int NTOK>
struct WgmmaTile {
  static constexpr int THREADS = WG * 128;
  static constexpr int ROWS = WG * MT * 64;
  static constexpr int TILES = ROWS / 16;
  static constexpr int TOKENS = NTOK;
  static constexpr int WN = NTOK;  // wgmma N (16, 32, 64, 128 or 256): one instruction a k16 step and 64-row tile
  static constexpr int MAX_GROUPS = GEMM_BK / 32;
  static constexpr int X_OFFSET = 0;
  static constexpr int X_BLOCK = TOKENS * 128;
  static constexpr int W_OFFSET = 2 * X_BLOCK;
  static constexpr int S_OFFSET = W_OFFSET + ROWS * GEMM_BK / 2;
  static constexpr int STAGE_BYTES = (S_OFFSET + TILES * MAX_GROUPS * 64 + 1023) / 1024 * 1024;
  static constexpr int X_ROW_BYTES = 128;
  static constexpr int FRAG_R = MT, FRAG_T = NTOK / 8;
  static constexpr int OUT_STRIDE = ROWS + 8;
  static_assert(NTOK == 16 || NTOK == 32 || NTOK == 64 || NTOK == 128 || NTOK == 256, "tokens per CTA");
  static __device__ __forceinline__ int frag_row(int warp, int mt) {
    return (((warp >> 2) * MT + mt) * 4 + (warp & 3)) * 16;
  }
  static __device__ __forceinline__ int x_offset(int row, int chunk) {
    return (chunk >> 3) * X_BLOCK + row * 128 + (((chunk & 7) ^ (row & 7)) * 16);
  }
};

// ---------------------------------------------------------------------------------------------------------------
// The cp.async copies of one pipeline stage, with every address that does not change from stage to stage worked
// out once per thread. Each thread always copies the same 16-byte column of its rows (chunk = thread % chunks per
// row), so a stage costs one pointer step and one predicate per copy.
template <class L>
struct StageLoader {
  static constexpr int W_CHUNKS = GEMM_BK / 32;       // 16-byte chunks (32 codes) of a weight row per stage
  static constexpr int W_ROWS = L::THREADS / W_CHUNKS;  // weight rows one pass of the CTA copies
  static constexpr int W_PASSES = L::ROWS / W_ROWS;
  static constexpr int X_CHUNKS = GEMM_BK / 8;        // 16-byte chunks (8 values) of a token row per stage
  static constexpr int X_ROWS = L::THREADS / X_CHUNKS;
  static constexpr int X_PASSES = (L::TOKENS + X_ROWS - 1) / X_ROWS;
  static constexpr int S_COPIES = L::TILES * L::MAX_GROUPS * 4;  // 16-byte quarters of (tile, group) entries
  static constexpr int S_PASSES = (S_COPIES + L::THREADS - 1) / L::THREADS;
  static_assert(L::THREADS % W_CHUNKS == 0 && L::ROWS % W_ROWS == 0, "weight copy passes");
  static_assert(L::THREADS % X_CHUNKS == 0 && X_ROWS % 8 == 0, "activation copy passes keep the row's slot");

  const u32* w_src;     // this thread's first weight row and chunk at k 0
  size_t w_pass;        // words between passes (W_ROWS rows)
  u32 w_rows_valid;     // bit p: pass p's row is inside N
  int w_dst, w_chunk;   // shared-memory offset of pass 0 in a stage; the chunk
  const u16* x_src;
  size_t x_pass;
  u32 x_rows_used, x_rows_valid;  // bit p: pass p's row is inside the CTA's tokens / inside M too
  int x_dst, x_chunk;
  const uint2* s_src[S_PASSES];  // (tile, slot, part) entries at group 0
  int s_slot[S_PASSES];          // -1 where the pass copies nothing
  int K, group_size, group_shift;

  __device__ __forceinline__ StageLoader(const u32* __restrict__ qweight, const uint2* __restrict__ sz,
                                         const u16* __restrict__ x, int row0, int tok0, int M, int N, int K_,
                                         int group_size_, int group_shift_, int num_groups)
      : K(K_), group_size(group_size_), group_shift(group_shift_) {
    const int tid = threadIdx.x;
    const int words_per_row = K >> 3;
    w_chunk = tid % W_CHUNKS;
    const int w_row = tid / W_CHUNKS;
    w_src = qweight + (size_t)min(row0 + w_row, N - 1) * words_per_row + 4 * w_chunk;
    w_pass = (size_t)W_ROWS * words_per_row;
    w_dst = L::W_OFFSET + w_row * (GEMM_BK / 2) + w_chunk * 16;
    w_rows_valid = 0;
#pragma unroll
    for (int p = 0; p < W_PASSES; ++p) w_rows_valid |= (u32)(row0 + w_row + p * W_ROWS < N) << p;
    x_chunk = tid % X_CHUNKS;
    const int x_row = tid / X_CHUNKS;
    x_src = x + (size_t)min(tok0 + x_row, M - 1) * K + 8 * x_chunk;
    x_pass = (size_t)X_ROWS * K;
    x_dst = L::X_OFFSET + L::x_offset(x_row, x_chunk);
    x_rows_used = x_rows_valid = 0;
#pragma unroll
    for (int p = 0; p < X_PASSES; ++p) {
      const int row = x_row + p * X_ROWS;
      x_rows_used |= (u32)(row < L::TOKENS) << p;
      x_rows_valid |= (u32)(row < L::TOKENS && tok0 + row < M) << p;
    }
    const int tile0 = row0 >> 4, num_tiles = (N + 15) >> 4;
#pragma unroll
    for (int p = 0; p < S_PASSES; ++p) {
      const int c = tid + p * L::THREADS;
      const int tile = c / (L::MAX_GROUPS * 4), slot = (c >> 2) % L::MAX_GROUPS, part = c & 3;
      const bool used = c < S_COPIES && tile0 + tile < num_tiles;
      s_src[p] = sz + ((size_t)min(tile0 + tile, num_tiles - 1) * num_groups + slot) * 8 + 2 * part;
      s_slot[p] = used ? slot : -1;
    }
  }

  // Weights and scale pairs of k-block kb (no earlier kernel writes them).
  __device__ __forceinline__ void weights(unsigned char* stage, int kb) const {
    const int k0 = kb * GEMM_BK;
    const bool k_valid = k0 + 32 * w_chunk < K;
    const u32* src = w_src + (k0 >> 3);
#pragma unroll
    for (int p = 0; p < W_PASSES; ++p) {
      cp_async16(stage + w_dst + p * W_ROWS * (GEMM_BK / 2), src, k_valid && ((w_rows_valid >> p) & 1));
      src += w_pass;
    }
    const int group0 = group_of(k0, group_size, group_shift);
    const int groups = group_of(min(k0 + GEMM_BK, K) - 1, group_size, group_shift) - group0 + 1;
#pragma unroll
    for (int p = 0; p < S_PASSES; ++p) {
      if (s_slot[p] < 0) continue;
      const int c = threadIdx.x + p * L::THREADS;
      cp_async16(stage + L::S_OFFSET + c * 16, s_src[p] + (size_t)group0 * 8, s_slot[p] < groups);
    }
  }

  // Activations of k-block kb (an earlier kernel's output: only after the PDL wait).
  __device__ __forceinline__ void activations(unsigned char* stage, int kb) const {
    const int k0 = kb * GEMM_BK;
    const bool k_valid = k0 + 8 * x_chunk < K;
    const u16* src = x_src + k0;
#pragma unroll
    for (int p = 0; p < X_PASSES; ++p) {
      if (((x_rows_used >> p) & 1) == 0) break;  // rows beyond the CTA's tokens (few-token tiles of wide CTAs)
      cp_async16(stage + x_dst + p * X_ROWS * L::X_ROW_BYTES, src, k_valid && ((x_rows_valid >> p) & 1));
      src += x_pass;
    }
  }
};

// ---------------------------------------------------------------------------------------------------------------
// One stage of mma.sync work for a warp: RW tiles x TT token tiles x 8 k16 steps. The next word's activations are
// loaded while the current word's weights are unpacked and multiplied, and each step issues its RW x TT independent
// mma before the next step's, so no mma waits on the one before it.
template <int DT, int ZMODE, int WARPS, int RW, int TT>
__device__ __forceinline__ void mma_stage(const unsigned char* stage, float (&acc)[RW][TT][4], int k0, int group_size,
                                          int group_shift, int slot_shift) {
  using L = MmaTile<WARPS, RW, TT>;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int slot = scale_slot(k0, 32 * t, group_size, group_shift, slot_shift);
  uint4 wlo[RW], whi[RW];
  u32 s_lo[RW], s_hi[RW], z_lo[RW], z_hi[RW];
#pragma unroll
  for (int r = 0; r < RW; ++r) {
    const int row = L::frag_row(warp, r) + g;
    wlo[r] = *reinterpret_cast<const uint4*>(stage + L::W_OFFSET + row * (GEMM_BK / 2) + t * 16);
    whi[r] = *reinterpret_cast<const uint4*>(stage + L::W_OFFSET + (row + 8) * (GEMM_BK / 2) + t * 16);
    const ScalePairs pairs(*reinterpret_cast<const uint2*>(
        stage + L::S_OFFSET + ((warp * RW + r) * L::MAX_GROUPS + slot) * 64 + g * 8));
    s_lo[r] = pairs.s_lo, s_hi[r] = pairs.s_hi, z_lo[r] = pairs.z_lo, z_hi[r] = pairs.z_hi;
  }
  uint4 xv[TT];
#pragma unroll
  for (int tt = 0; tt < TT; ++tt)
    xv[tt] = *reinterpret_cast<const uint4*>(stage + L::x_offset(tt * 8 + g, 4 * t));
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    u32 b[TT][4];
#pragma unroll
    for (int tt = 0; tt < TT; ++tt) {
      b[tt][0] = pair_of_los(xv[tt].x, xv[tt].z);  // (e0, e4)
      b[tt][1] = pair_of_his(xv[tt].x, xv[tt].z);  // (e1, e5)
      b[tt][2] = pair_of_los(xv[tt].y, xv[tt].w);  // (e2, e6)
      b[tt][3] = pair_of_his(xv[tt].y, xv[tt].w);  // (e3, e7)
    }
    if (i < 3) {
#pragma unroll
      for (int tt = 0; tt < TT; ++tt)
        xv[tt] = *reinterpret_cast<const uint4*>(stage + L::x_offset(tt * 8 + g, 4 * t + i + 1));
    }
    u32 a[RW][2][4];
#pragma unroll
    for (int r = 0; r < RW; ++r) {
      const u32 lo = i == 0 ? wlo[r].x : i == 1 ? wlo[r].y : i == 2 ? wlo[r].z : wlo[r].w;
      const u32 hi = i == 0 ? whi[r].x : i == 1 ? whi[r].y : i == 2 ? whi[r].z : whi[r].w;
      a[r][0][0] = dequant_pair<DT, ZMODE>(strided_pair<DT, 0>(lo), s_lo[r], z_lo[r]);
      a[r][0][1] = dequant_pair<DT, ZMODE>(strided_pair<DT, 0>(hi), s_hi[r], z_hi[r]);
      a[r][0][2] = dequant_pair<DT, ZMODE>(strided_pair<DT, 1>(lo), s_lo[r], z_lo[r]);
      a[r][0][3] = dequant_pair<DT, ZMODE>(strided_pair<DT, 1>(hi), s_hi[r], z_hi[r]);
      a[r][1][0] = dequant_pair<DT, ZMODE>(strided_pair<DT, 2>(lo), s_lo[r], z_lo[r]);
      a[r][1][1] = dequant_pair<DT, ZMODE>(strided_pair<DT, 2>(hi), s_hi[r], z_hi[r]);
      a[r][1][2] = dequant_pair<DT, ZMODE>(strided_pair<DT, 3>(lo), s_lo[r], z_lo[r]);
      a[r][1][3] = dequant_pair<DT, ZMODE>(strided_pair<DT, 3>(hi), s_hi[r], z_hi[r]);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int r = 0; r < RW; ++r)
#pragma unroll
        for (int tt = 0; tt < TT; ++tt)
          mma_16816<DT>(acc[r][tt], a[r][j][0], a[r][j][1], a[r][j][2], a[r][j][3], b[tt][2 * j], b[tt][2 * j + 1]);
  }
}

// One stage of wgmma work for a warpgroup: MT 64-row tiles x 8 k16 steps. Step s unpacks its A fragments into
// register set s % 3 while the groups of steps s - 1 and s - 2 run; the wait after each commit leaves two groups in
// flight, so the set rewritten next belongs to a finished group. The stage ends with every group done (its shared
// memory is refilled next).
template <int DT, int ZMODE, int WG, int MT, int NTOK>
__device__ __forceinline__ void wgmma_stage(const unsigned char* stage, float (&acc)[MT][NTOK / 8][4], int k0,
                                            int group_size, int group_shift, int slot_shift) {
  using L = WgmmaTile<WG, MT, NTOK>;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int shift = 8 * t;
  u32 slots = 0;  // the scale slot of step s in bits 4s .. 4s + 3 (worked out once a stage, off the steps' path)
#pragma unroll
  for (int step = 0; step < 8; ++step)
    slots |= (u32)scale_slot(k0, 16 * step, group_size, group_shift, slot_shift) << (4 * step);
  constexpr int SETS = 3;
  u32 a[SETS][MT][4];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    uint4 lo[MT][2], hi[MT][2];  // words 8 half .. 8 half + 7 of the thread's rows g and g + 8
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int row = L::frag_row(warp, mt) + g;
      const unsigned char* w = stage + L::W_OFFSET + row * (GEMM_BK / 2) + half * 32;
      lo[mt][0] = *reinterpret_cast<const uint4*>(w);
      lo[mt][1] = *reinterpret_cast<const uint4*>(w + 16);
      hi[mt][0] = *reinterpret_cast<const uint4*>(w + 8 * (GEMM_BK / 2));
      hi[mt][1] = *reinterpret_cast<const uint4*>(w + 8 * (GEMM_BK / 2) + 16);
    }
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const int step = 4 * half + s;
      u32(&as)[MT][4] = a[step % SETS];
      const int slot = (slots >> (4 * step)) & 0xF;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const ScalePairs sp(*reinterpret_cast<const uint2*>(
            stage + L::S_OFFSET + ((L::frag_row(warp, mt) / 16) * L::MAX_GROUPS + slot) * 64 + g * 8));
        const uint4& l = lo[mt][s >> 1];
        const uint4& h = hi[mt][s >> 1];
        const u32 l0 = (s & 1) ? l.z : l.x, l1 = (s & 1) ? l.w : l.y;  // words 2 step, 2 step + 1 of row g
        const u32 h0 = (s & 1) ? h.z : h.x, h1 = (s & 1) ? h.w : h.y;
        as[mt][0] = dequant_pair<DT, ZMODE>(byte_pair<DT>(l0, shift), sp.s_lo, sp.z_lo);  // (g, 2t), (g, 2t + 1)
        as[mt][1] = dequant_pair<DT, ZMODE>(byte_pair<DT>(h0, shift), sp.s_hi, sp.z_hi);  // (g + 8, 2t ..)
        as[mt][2] = dequant_pair<DT, ZMODE>(byte_pair<DT>(l1, shift), sp.s_lo, sp.z_lo);  // (g, 2t + 8 ..)
        as[mt][3] = dequant_pair<DT, ZMODE>(byte_pair<DT>(h1, shift), sp.s_hi, sp.z_hi);  // (g + 8, 2t + 8 ..)
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int tt = 0; tt < NTOK / 8; ++tt)
#pragma unroll
          for (int e = 0; e < 4; ++e) hold(acc[mt][tt][e]);  // no register moves of the accumulators in flight
      wgmma_fence();
      const unsigned char* xb = stage + L::X_OFFSET + half * L::X_BLOCK + 32 * s;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) wgmma_rs<DT, L::WN>(&acc[mt][0][0], as[mt], swizzled_desc(xb));
      wgmma_commit();
      wgmma_wait<SETS - 1>();
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) hold(a[(step + 1) % SETS][mt][e]);  // step - 2's set: its group is done
    }
  }
  wgmma_wait<0>();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int set = 0; set < SETS; ++set)
#pragma unroll
      for (int e = 0; e < 4; ++e) hold(a[set][mt][e]);
#pragma unroll
    for (int tt = 0; tt < NTOK / 8; ++tt)
#pragma unroll
      for (int e = 0; e < 4; ++e) hold(acc[mt][tt][e]);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Epilogue. With gridDim.z > 1, each CTA writes its fp32 sums ([REGS][THREADS] per split, coalesced) and the last
// CTA of an output tile to arrive (a counter per tile) adds all splits in split order, so the result does not
// depend on which CTA finishes last, and resets the counter. True in the CTA that goes on to store the tile.
template <class L>
__device__ __forceinline__ bool reduce_k_splits(float (&acc)[L::FRAG_R][L::FRAG_T][4], float* __restrict__ partials,
                                                u32* __restrict__ counters, int* flag) {
  constexpr int REGS = L::FRAG_R * L::FRAG_T * 4;
  constexpr int IN_FLIGHT = REGS <= 8 ? 8 : REGS <= 16 ? 4 : REGS <= 32 ? 2 : 1;  // splits whose loads overlap
  float* flat = &acc[0][0][0];
  const int splits = gridDim.z;
  if (splits == 1) return true;
  const int tile = blockIdx.y * gridDim.x + blockIdx.x;
  float* mine = partials + ((size_t)tile * splits + blockIdx.z) * REGS * L::THREADS + threadIdx.x;
#pragma unroll
  for (int reg = 0; reg < REGS; ++reg) mine[reg * L::THREADS] = flat[reg];
  __syncthreads();  // every thread's partials are written before thread 0 releases them with the count
  if (threadIdx.x == 0) {
    u32 arrived;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(arrived) : "l"(counters + tile) : "memory");
    *flag = arrived == (u32)(splits - 1);
  }
  __syncthreads();  // and the last CTA's threads read the others' partials after thread 0 acquired them
  if (!*flag) return false;
  const float* all = partials + (size_t)tile * splits * REGS * L::THREADS + threadIdx.x;
#pragma unroll
  for (int reg = 0; reg < REGS; ++reg) flat[reg] = 0.0f;
#pragma unroll 1
  for (int s0 = 0; s0 < splits; s0 += IN_FLIGHT) {
    float v[IN_FLIGHT][REGS];
#pragma unroll
    for (int u = 0; u < IN_FLIGHT; ++u)
#pragma unroll
      for (int reg = 0; reg < REGS; ++reg)
        v[u][reg] = s0 + u < splits ? __ldcg(all + ((size_t)(s0 + u) * REGS + reg) * L::THREADS) : 0.0f;
#pragma unroll
    for (int u = 0; u < IN_FLIGHT; ++u)
#pragma unroll
      for (int reg = 0; reg < REGS; ++reg) flat[reg] += v[u][reg];  // split order, whichever CTA adds them
  }
  if (threadIdx.x == 0) counters[tile] = 0;
  return true;
}

// Bias, rounding to DT, and the store: fragments are staged as [token][row] in shared memory (the pipeline's, free
// by now) so the stores write 16 contiguous bytes a thread.
template <int DT, class L>
__device__ __forceinline__ void store_tile(const float (&acc)[L::FRAG_R][L::FRAG_T][4], unsigned char* smem,
                                           const u16* __restrict__ bias, u16* __restrict__ out, int row0, int tok0,
                                           int M, int N) {
  u16* staged = reinterpret_cast<u16*>(smem);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int r = 0; r < L::FRAG_R; ++r) {
    const int row = L::frag_row(warp, r) + g;
    const float b_lo = bias != nullptr && row0 + row < N ? Num<DT>::to_float(bias[row0 + row]) : 0.0f;
    const float b_hi = bias != nullptr && row0 + row + 8 < N ? Num<DT>::to_float(bias[row0 + row + 8]) : 0.0f;
#pragma unroll
    for (int tt = 0; tt < L::FRAG_T; ++tt) {
      const int token = tt * 8 + 2 * t;
      staged[token * L::OUT_STRIDE + row] = Num<DT>::from_float(acc[r][tt][0] + b_lo);
      staged[(token + 1) * L::OUT_STRIDE + row] = Num<DT>::from_float(acc[r][tt][1] + b_lo);
      staged[token * L::OUT_STRIDE + row + 8] = Num<DT>::from_float(acc[r][tt][2] + b_hi);
      staged[(token + 1) * L::OUT_STRIDE + row + 8] = Num<DT>::from_float(acc[r][tt][3] + b_hi);
    }
  }
  __syncthreads();
  const bool vector_rows = (N & 7) == 0;
  for (int c = threadIdx.x; c < L::TOKENS * (L::ROWS / 8); c += L::THREADS) {
    const int token = c / (L::ROWS / 8), chunk = c % (L::ROWS / 8);
    const int m = tok0 + token, n = row0 + chunk * 8;
    if (m >= M || n >= N) continue;
    const u16* src = staged + token * L::OUT_STRIDE + chunk * 8;
    u16* dst = out + (size_t)m * N + n;
    if (vector_rows && n + 8 <= N) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
      for (int e = 0; e < 8 && n + e < N; ++e) dst[e] = src[e];
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The body of both paths: the same pipeline and epilogue around the stage's tensor-core work.
template <int DT, int ZMODE, class L, int STAGES, bool WGMMA>
__device__ __forceinline__ void gemm_body(const u16* __restrict__ x, const u32* __restrict__ qweight,
                                          const uint2* __restrict__ sz, const u16* __restrict__ bias,
                                          u16* __restrict__ out, float* __restrict__ partials,
                                          u32* __restrict__ counters, int M, int N, int K, int group_size,
                                          int group_shift, int slot_shift, int num_groups, unsigned char* smem,
                                          int* last_flag,
                                          float (&acc)[L::FRAG_R][L::FRAG_T][4]) {
  const int row0 = blockIdx.x * L::ROWS, tok0 = blockIdx.y * L::TOKENS;
  const StageLoader<L> load(qweight, sz, x, row0, tok0, M, N, K, group_size, group_shift, num_groups);
  const int num_kb = (K + GEMM_BK - 1) / GEMM_BK;
  const int kb_begin = (int)(((long long)blockIdx.z * num_kb) / gridDim.z);
  const int kb_end = (int)(((long long)(blockIdx.z + 1) * num_kb) / gridDim.z);
  const int steps = kb_end - kb_begin;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s)
    if (s < steps) load.weights(smem + s * L::STAGE_BYTES, kb_begin + s);
  wait_for_prior_grids();
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < steps) load.activations(smem + s * L::STAGE_BYTES, kb_begin + s);
    cp_async_commit();
  }
#pragma unroll
  for (int r = 0; r < L::FRAG_R; ++r)
#pragma unroll
    for (int tt = 0; tt < L::FRAG_T; ++tt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[r][tt][e] = 0.0f;

  for (int step = 0; step < steps; ++step) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // stage `step` has landed for every thread, and nobody still reads the one refilled next
    const int next = step + STAGES - 1;
    if (next < steps) {
      unsigned char* stage = smem + (next % STAGES) * L::STAGE_BYTES;
      load.weights(stage, kb_begin + next);
      load.activations(stage, kb_begin + next);
    }
    cp_async_commit();
    const unsigned char* stage = smem + (step % STAGES) * L::STAGE_BYTES;
    const int k0 = (kb_begin + step) * GEMM_BK;
    if constexpr (WGMMA) {
      constexpr int MT = L::FRAG_R, NTOK = L::TOKENS, WG = L::THREADS / 128;
      wgmma_stage<DT, ZMODE, WG, MT, NTOK>(stage, acc, k0, group_size, group_shift, slot_shift);
    } else {
      constexpr int RW = L::FRAG_R, TT = L::FRAG_T, WARPS = L::THREADS / 32;
      mma_stage<DT, ZMODE, WARPS, RW, TT>(stage, acc, k0, group_size, group_shift, slot_shift);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the pipeline's shared memory is the output staging below

  if (!reduce_k_splits<L>(acc, partials, counters, last_flag)) return;
  store_tile<DT, L>(acc, smem, bias, out, row0, tok0, M, N);
}

// The one kernel of both families: WGMMA picks the layout and tensor-core path, A/B/C its shape (mma.sync: warps,
// 16-row tiles a warp, 8-token tiles; wgmma: warpgroups, 64-row tiles a warpgroup, tokens).
// (NVRTC has no <type_traits>, so the pick is spelled out.)
template <bool WGMMA, int A, int B, int C> struct PickLayout { using type = MmaTile<A, B, C>; };
template <int A, int B, int C> struct PickLayout<true, A, B, C> { using type = WgmmaTile<A, B, C>; };
template <bool WGMMA, int A, int B, int C>
using GemmLayout = typename PickLayout<WGMMA, A, B, C>::type;

template <int DT, int ZMODE, bool WGMMA, int A, int B, int C, int STAGES>
__global__ void __launch_bounds__(GemmLayout<WGMMA, A, B, C>::THREADS) w4_gemm_kernel(
    const u16* __restrict__ x,        // [M, K] activations, DT
    const u32* __restrict__ qweight,  // [N, K / 8] packed codes
    const uint2* __restrict__ sz,     // [ceil(N / 16), num_groups, 8] (scale pair, zero pair), DT
    const u16* __restrict__ bias,     // [N] DT, or null
    u16* __restrict__ out,            // [M, N] DT
    float* __restrict__ partials,     // split-K sums: [tiles, splits, REGS, THREADS] fp32
    u32* __restrict__ counters,       // [tiles], zero between launches
    int M, int N, int K, int group_size, int group_shift, int slot_shift, int num_groups) {
  using L = GemmLayout<WGMMA, A, B, C>;
  __shared__ int last_flag;
  launch_dependents();
  unsigned char* smem;
  if constexpr (WGMMA) {
    // the swizzled activation blocks must start on 1024-byte boundaries (the launcher asks for 1 KiB more)
    extern __shared__ __align__(1024) unsigned char smem_swizzled[];
    smem = smem_swizzled + ((1024 - ((u32)__cvta_generic_to_shared(smem_swizzled) & 1023)) & 1023);
  } else {
    extern __shared__ __align__(16) unsigned char smem_plain[];
    smem = smem_plain;
  }
  float acc[L::FRAG_R][L::FRAG_T][4];
  gemm_body<DT, ZMODE, L, STAGES, WGMMA>(x, qweight, sz, bias, out, partials, counters, M, N, K, group_size,
                                         group_shift, slot_shift, num_groups, smem, &last_flag, acc);
}
