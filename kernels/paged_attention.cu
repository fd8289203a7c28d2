// Paged decode attention (one new query token per sequence) reading the block table directly, and (at the end of
// this file) paged prefill attention of tiles of consecutive prompt tokens.
//
// KV cache per layer: [num_blocks, num_kv_heads, block_size, D], one of (the KVQ template parameter)
//   0: fp16/bf16 (DT);
//   1: int8 with fp16 per-token, per-head scales [num_blocks, num_kv_heads, block_size] (x = int8 * scale);
//   2: float8 e4m3 with one fp32 scale per KV head [num_kv_heads] (x = e4m3 * scale), fixed for the kernel's life.
// Codes are read in tiles of their own (CodeTile: 32 tokens, 16-byte loads) and converted to fp16 pairs in
// registers just before the mma that needs them; K scales multiply the scores, int8 V scales the V pairs, the e4m3
// V scale the output.
//
// One CTA per (kv head, 16-head tile of its query heads, sequence, split of the context): the query
// heads that share a KV head are the 16 rows of the mma A operand, so each K/V row is read once for
// all of them. The split's tokens are walked in tiles (16 tokens of a 16-bit cache) with an online softmax (flash
// decoding); Q.K^T and P.V both run on mma.sync m16n8k16 with fp32 accumulation.
//
// Two ways to cover a context, one kernel (the WARPS template parameter):
//   split path (WARPS = 1): one warp per CTA, the context cut into splits across CTAs (grid.z) sized
//     from the host's max_seq_len; with splits > 1 each CTA writes its unnormalized output and
//     (max, sum) and paged_reduce_kernel combines them. Long contexts: many CTAs keep the GPU busy.
//   combined path (WARPS > 1, one split): the CTA's warps take the sequence's tiles round robin
//     (warp w: tiles w, w + WARPS, ...) up to its real seq_len, then combine their softmax states in
//     shared memory (combine_warps) and write the output: one kernel, no partials, and latency that
//     follows the real context, not the graph's bound. Short contexts, where the reduce kernel's launch
//     and round trips would cost more than walking the tiles. With splits > 1 (the combined_split path)
//     each CTA writes the partial of its split instead: few long streams, one partial a CTA.
//
// Operand permutations of 16-bit tiles (any permutation of a reduction axis is fine if both operands share it;
// code tiles have their own, CodeSlices):
//   Q.K^T, reduction over d: thread t takes d = 32c + 8t + {0..7} of each 32-wide chunk c; k-step
//     (c, s) pairs are d = 32c + 8t + 4s + {0,1} (a0/b0) and + {2,3} (a2/b1).
//   P.V, output columns: in each 32-wide d block, n-tile j column g is d = 32*vb + 4g + j, so a
//     thread loads 4 consecutive d of a V row and ends with 8 consecutive outputs d = 32*vb + 8t + {0..7}.
#include "common.cuh"

// Four int8 or e4m3 codes (one u32, byte i = element i) -> fp16 pairs (e0, e1) and (e2, e3), the code tiles'
// mma operands. int8 exactly; e4m3 exactly on SM89+ (cvt), elsewhere as the codes' values times 2^-8: each code's
// exponent and mantissa bits (e4m3 bias 7) land in a half's low exponent and high mantissa bits (bias 15), a half
// of value 2^-8 * x, subnormals included (the caller's scales carry the 2^8: FP8_PAIR_SCALE). The kernels never
// store the NaN code 0x7F.
template <int KVQ> __device__ __forceinline__ void codes_to_halves(u32 w, u32& p01, u32& p23) {
  if constexpr (KVQ == 2) {
#if __CUDA_ARCH__ >= 890
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %2;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n cvt.rn.f16x2.e4m3x2 %1, hi;\n}"
        : "=r"(p01), "=r"(p23) : "r"(w));
#else
    p01 = ((w & 0x7Fu) << 7) | ((w & 0x80u) << 8) | ((w & 0x7F00u) << 15) | ((w & 0x8000u) << 16);
    p23 = ((w & 0x7F0000u) >> 9) | ((w & 0x800000u) >> 8) | ((w & 0x7F000000u) >> 1) | (w & 0x80000000u);
#endif
  } else {
    int8x4_to_halves(w, p01, p23);
  }
}
// What the kernels multiply an e4m3 cache's per-head scale by (codes_to_halves' 2^-8 before SM89)
#if __CUDA_ARCH__ >= 890
constexpr float FP8_PAIR_SCALE = 1.0f;
#else
constexpr float FP8_PAIR_SCALE = 256.0f;
#endif

// Two DT values (one word) -> the same two as an fp16 pair: the code tiles multiply in fp16 (bf16 queries are exact
// there between 2^-14 and 65504).
template <int DT> __device__ __forceinline__ u32 halves_of(u32 w) {
  if constexpr (DT == 1) {
    return Num<0>::pack(__uint_as_float(w << 16), __uint_as_float(w & 0xFFFF0000u));
  } else {
    return w;
  }
}

// A thread's slice of 16-bit K and V rows: 8 consecutive elements of a K row (KW words) and 4 of a V row (VW
// words).
// Cache rows, block tables, lengths and scales are read with ld.global.cg (L2, the point of coherence), not
// through the SM's non-coherent read-only cache: paged_decode_kernel reads some of them before its PDL wait,
// where a line that cache kept from an earlier kernel may predate writes since (a CUDA-graph test read stale data
// that way; the block tables, which a gather rewrites every replay, are the suspect), and only the wait makes the
// cached path safe.
// SHARED: `base` is a shared-memory tile (the prefill kernel's staged keys), read with plain loads.
template <bool SHARED = false>
struct KvRow {
  static constexpr int KW = 4, VW = 2;
  static __device__ __forceinline__ void load8(const void* base, i64 index, bool valid, u32 (&w)[KW]) {
    if constexpr (SHARED) {
      const uint4 v = *reinterpret_cast<const uint4*>(reinterpret_cast<const u16*>(base) + index);
      w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    } else {
      const uint4 v = valid ? __ldcg(reinterpret_cast<const uint4*>(reinterpret_cast<const u16*>(base) + index))
                            : make_uint4(0, 0, 0, 0);
      w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    }
  }
  static __device__ __forceinline__ void load4(const void* base, i64 index, bool valid, u32 (&w)[VW]) {
    if constexpr (SHARED) {
      const uint2 v = *reinterpret_cast<const uint2*>(reinterpret_cast<const u16*>(base) + index);
      w[0] = v.x; w[1] = v.y;
    } else {
      const uint2 v = valid ? __ldcg(reinterpret_cast<const uint2*>(reinterpret_cast<const u16*>(base) + index))
                            : make_uint2(0, 0);
      w[0] = v.x; w[1] = v.y;
    }
  }
};

// What one 16-token tile of a 16-bit cache needs from memory: the rows' addresses and with PRELOAD (D <= 128)
// the K and V rows themselves. K rows: tokens tile + 8*nt + g, elements 32c + 8t .. +7;
// V rows: tokens tile + 2t, 2t+1, 2t+8, 2t+9 (index e), elements 32c + 4g .. +3.
template <int DT, int D, int PRELOAD>
struct Tile {
  static constexpr int CH = PRELOAD ? D / 32 : 1;
  i64 krow[2], vrow[4];
  bool kvalid[2], vvalid[4];
  u32 kw[2][CH][KvRow<>::KW], vw[4][CH][KvRow<>::VW];
};

struct TileContext {  // per CTA: where the sequence's rows live
  const void* key_cache;
  const void* value_cache;
  const u16* key_scales;
  const u16* value_scales;
  const int* table;
  int log2_block_size, num_kv_heads, kv_head, end, g, t;
  float key_head_scale;  // e4m3 caches: the KV head's scale times FP8_PAIR_SCALE
};

template <int DT, int D, int PRELOAD>
__device__ __forceinline__ void fetch_tile(Tile<DT, D, PRELOAD>& T, int tile, const TileContext& ctx) {
  const int block_size = 1 << ctx.log2_block_size;
  const i64 head_stride = (i64)block_size * D;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const int tok = tile + 8 * nt + ctx.g;
    T.kvalid[nt] = tok < ctx.end;
    const int blk = T.kvalid[nt] ? __ldcg(ctx.table + (tok >> ctx.log2_block_size)) : 0;
    T.krow[nt] = ((i64)blk * ctx.num_kv_heads + ctx.kv_head) * head_stride + (i64)(tok & (block_size - 1)) * D;
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int tok = tile + 2 * ctx.t + (e & 1) + 8 * (e >> 1);
    T.vvalid[e] = tok < ctx.end;
    const int blk = T.vvalid[e] ? __ldcg(ctx.table + (tok >> ctx.log2_block_size)) : 0;
    T.vrow[e] = ((i64)blk * ctx.num_kv_heads + ctx.kv_head) * head_stride + (i64)(tok & (block_size - 1)) * D;
  }
  if constexpr (PRELOAD) {
#pragma unroll
    for (int c = 0; c < D / 32; ++c) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
        KvRow<>::load8(ctx.key_cache, T.krow[nt] + 32 * c + 8 * ctx.t, T.kvalid[nt], T.kw[nt][c]);
#pragma unroll
      for (int e = 0; e < 4; ++e)
        KvRow<>::load4(ctx.value_cache, T.vrow[e] + 32 * c + 4 * ctx.g, T.vvalid[e], T.vw[e][c]);
    }
  }
}

// The online softmax's update after a tile's scores s [NT n-tiles][c0..c3] (masked ones -inf) whose max over this
// thread's columns of each of its two rows is tile_max: running max and sum of the rows, o rescaled by the change of
// max, s replaced by the probabilities P.
template <int NT, int NTILES>
__device__ __forceinline__ void softmax_update(float (&s)[NT][4], float (&tile_max)[2], float (&o)[NTILES][4][4],
                                               float (&row_max)[2], float (&row_sum)[2]) {
  float alpha[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xFFFFFFFFu, tile_max[r], 1));
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xFFFFFFFFu, tile_max[r], 2));
    const float new_max = fmaxf(row_max[r], tile_max[r]);
    const float base = new_max == -INFINITY ? 0.0f : new_max;  // a row with nothing seen yet
    alpha[r] = __expf(row_max[r] - base);
    row_max[r] = new_max;
    row_sum[r] *= alpha[r];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float p = __expf(s[nt][2 * r + e] - base);
        row_sum[r] += p;
        s[nt][2 * r + e] = p;
      }
    }
  }
#pragma unroll
  for (int c = 0; c < NTILES; ++c)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      o[c][j][0] *= alpha[0]; o[c][j][1] *= alpha[0];
      o[c][j][2] *= alpha[1]; o[c][j][3] *= alpha[1];
    }
}

// One tile of the online softmax over a 16-bit cache: S = Q K^T, running max/sum update, O = O * alpha + P V.
// qrows: this thread's two query rows (row g and g+8) offset by 8t; q rows past the tile's heads are zero.
// Keys at positions >= ctx.end are masked; with ROW_BOUNDS (rows of different query tokens, the prefill kernel)
// row r sees keys [row_begin[r], row_end[r]) instead. SHARED (with PRELOAD = 0): ctx's caches are a staged tile
// in shared memory, read chunk by chunk at T's row offsets.
template <int DT, int D, int PRELOAD, bool ROW_BOUNDS = false, bool SHARED = false>
__device__ __forceinline__ void attend_tile(const Tile<DT, D, PRELOAD>& T, int tile, const TileContext& ctx,
                                            const u16* const (&qrows)[2], const bool (&qvalid)[2], float scale,
                                            float softcap, float (&o)[D / 32][4][4], float (&row_max)[2],
                                            float (&row_sum)[2], const int (&row_begin)[2] = {0, 0},
                                            const int (&row_end)[2] = {0, 0}) {
  constexpr int CHUNKS = D / 32;
  // scores s[nt][c0..c3] = (row g, tok 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1) of n-tile nt
  float s[2][4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    u32 qf[2][4];  // Q re-read each tile: L1 hits, and registers stay free for the next tile's loads
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint4 v = qvalid[r] ? __ldg(reinterpret_cast<const uint4*>(qrows[r] + 32 * c)) : make_uint4(0, 0, 0, 0);
      qf[r][0] = v.x; qf[r][1] = v.y; qf[r][2] = v.z; qf[r][3] = v.w;
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      u32 kf[4];
      if constexpr (PRELOAD) {
#pragma unroll
        for (int i = 0; i < 4; ++i) kf[i] = T.kw[nt][c][i];
      } else {
        KvRow<SHARED>::load8(ctx.key_cache, T.krow[nt] + 32 * c + 8 * ctx.t, T.kvalid[nt], kf);
      }
      Num<DT>::mma(s[nt], qf[0][0], qf[1][0], qf[0][1], qf[1][1], kf[0], kf[1]);
      Num<DT>::mma(s[nt], qf[0][2], qf[1][2], qf[0][3], qf[1][3], kf[2], kf[3]);
    }
  }
  float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int tok = tile + 8 * nt + 2 * ctx.t + (e & 1);
      float v = s[nt][e] * scale;
      if (softcap > 0.0f) v = tanhf(v / softcap) * softcap;
      if constexpr (ROW_BOUNDS) {
        v = tok >= row_begin[e >> 1] && tok < row_end[e >> 1] ? v : -INFINITY;
      } else {
        v = tok < ctx.end ? v : -INFINITY;  // a tile starts at or after the range's first token
      }
      s[nt][e] = v;
      tile_max[e >> 1] = fmaxf(tile_max[e >> 1], v);
    }
  }
  softmax_update(s, tile_max, o, row_max, row_sum);
  // P as the A operand (k = the tile's 16 tokens)
  const u32 pa0 = Num<DT>::pack(s[0][0], s[0][1]);  // row g, tok 2t, 2t+1
  const u32 pa1 = Num<DT>::pack(s[0][2], s[0][3]);  // row g+8
  const u32 pa2 = Num<DT>::pack(s[1][0], s[1][1]);  // row g, tok 2t+8, 2t+9
  const u32 pa3 = Num<DT>::pack(s[1][2], s[1][3]);  // row g+8
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    u32 vf[4][2];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if constexpr (PRELOAD) {
        vf[e][0] = T.vw[e][c][0];
        vf[e][1] = T.vw[e][c][1];
      } else {
        KvRow<SHARED>::load4(ctx.value_cache, T.vrow[e] + 32 * c + 4 * ctx.g, T.vvalid[e], vf[e]);
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      // b0 = (V[2t][d], V[2t+1][d]), b1 = (V[2t+8][d], V[2t+9][d]), d = 32c + 4g + j
      const int w = j >> 1;
      const u32 b0 = (j & 1) ? pair_of_his(vf[0][w], vf[1][w]) : pair_of_los(vf[0][w], vf[1][w]);
      const u32 b1 = (j & 1) ? pair_of_his(vf[2][w], vf[3][w]) : pair_of_los(vf[2][w], vf[3][w]);
      Num<DT>::mma(o[c][j], pa0, pa1, pa2, pa3, b0, b1);
    }
  }
}

// ---- Quantized caches (int8, e4m3): tiles of codes -------------------------------------------------------------
// A one-byte code streams at a 16-bit element's bandwidth only with as many bytes in flight a warp and whole
// sectors a load: a quantized tile is 32 tokens (D <= 128; 16 for wider heads, whose rows would not fit the
// registers twice), so a tile's codes are the bytes of a 16-bit tile of 16 tokens, and each thread loads 16 codes
// at once (8 where a head's row is too short to give each thread 16), so that a warp's load covers whole 32-byte
// sectors. The rows are cut between threads in another order than the 16-bit tiles' (any permutation of a
// reduction axis works if both operands share it; the output columns' permutation is undone when they are written):
//   K (Q.K^T, reduction over d): thread t holds chunks k of KB codes of its K rows at d = 4 KB k + KB t; its k-step
//     w (4 codes, word w of its slice) pairs with Q at the same d. A tile's 32 tokens are 4 n-tiles of 8 rows.
//   V (P.V, output columns): thread g holds chunks k of VB codes of its V rows at d = 8 VB k + VB g; n-tile
//     j = VB k + i has column n at d = 8 VB k + VB n + i, so the mma's B operand (V[2t][d], V[2t+1][d]) of column
//     g pairs byte i of two rows (one byte_perm for 4 columns), and the thread ends with outputs of columns 2t
//     and 2t + 1, the VB consecutive d at 8 VB k + VB (2t + h) (fragment_column).
// Tiles start at multiples of 16 tokens (the range's first token masks the ones before it), so each 8-token group
// of a tile lies in one block (block_size >= 8): a block-table read per group, the same for the whole warp, and
// the int8 scales of a thread's tokens 2t, 2t + 1 of a group are one 4-byte load.
template <int D>
struct CodeSlices {
  static constexpr int KB = (D / 4) % 16 == 0 ? 16 : 8, KWORDS = D / 16;
  static constexpr int VB = (D / 8) % 16 == 0 ? 16 : (D / 8) % 8 == 0 ? 8 : 4, VWORDS = D / 32;
  static __device__ __forceinline__ int k_column(int k, int t) { return 4 * KB * k + KB * t; }
  static __device__ __forceinline__ int v_column(int k, int g) { return 8 * VB * k + VB * g; }
};

// The first d of the 4 outputs o[c][0..3][2r + h] of this thread (t = lane % 4): 16-bit caches (KVQ = 0) d =
// 32c + 8t + 4h + j for o[c][j]; code tiles n-tile 4c + j, column 2t + h (CodeSlices).
template <int D, int KVQ>
__device__ __forceinline__ int fragment_column(int c, int t, int h) {
  if constexpr (KVQ) {
    constexpr int VB = CodeSlices<D>::VB;
    return 8 * VB * (4 * c / VB) + VB * (2 * t + h) + 4 * c % VB;
  } else {
    return 32 * c + 8 * t + 4 * h;
  }
}

// BYTES (4, 8 or 16) codes at p into BYTES / 4 words; zeros where !valid.
template <int BYTES>
__device__ __forceinline__ void load_codes(const unsigned char* p, bool valid, u32* w) {
  if constexpr (BYTES == 16) {
    const uint4 v = valid ? __ldcg(reinterpret_cast<const uint4*>(p)) : make_uint4(0, 0, 0, 0);
    w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
  } else if constexpr (BYTES == 8) {
    const uint2 v = valid ? __ldcg(reinterpret_cast<const uint2*>(p)) : make_uint2(0, 0);
    w[0] = v.x; w[1] = v.y;
  } else {
    w[0] = valid ? __ldcg(reinterpret_cast<const u32*>(p)) : 0u;
  }
}

// A thread's codes of a TOKENS-token tile, as loaded (converted to pairs just before their mma): K rows
// tile + 8nt + g; V rows tile + 16ks + 2t + (e & 1) + 8 (e >> 1); int8: the fp16 K and V scales of tokens
// tile + 8nt + 2t and + 1 (low, high half), which are also its score columns and V rows.
template <int D, int TOKENS>
struct CodeTile {
  static constexpr int NT = TOKENS / 8, KS = TOKENS / 16;
  u32 k[NT][CodeSlices<D>::KWORDS];
  u32 v[KS][4][CodeSlices<D>::VWORDS];
  u32 kscale[NT], vscale[NT];
};

// The tile type of a cache: TRUE_TYPE for codes, FALSE_TYPE for 16-bit rows.
template <bool CODES, typename TRUE_TYPE, typename FALSE_TYPE> struct Pick { using type = TRUE_TYPE; };
template <typename TRUE_TYPE, typename FALSE_TYPE> struct Pick<false, TRUE_TYPE, FALSE_TYPE> {
  using type = FALSE_TYPE;
};

// begin: the range's first token (tile >= begin & ~15); rows outside [begin, ctx.end) load as zeros.
template <int D, int KVQ, int TOKENS>
__device__ __forceinline__ void fetch_code_tile(CodeTile<D, TOKENS>& T, int tile, int begin, const TileContext& ctx) {
  using S = CodeSlices<D>;
  constexpr int NT = TOKENS / 8;
  const int block_size = 1 << ctx.log2_block_size, g = ctx.g, t = ctx.t;
  i64 first_row[NT];  // the group's first token's row of [num_blocks * KVH * block_size]
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int group = tile + 8 * nt;
    const bool live = group + 8 > begin && group < ctx.end;
    const int blk = live ? __ldcg(ctx.table + (group >> ctx.log2_block_size)) : 0;
    first_row[nt] = ((i64)blk * ctx.num_kv_heads + ctx.kv_head) * block_size + (group & (block_size - 1));
  }
  const unsigned char* keys = reinterpret_cast<const unsigned char*>(ctx.key_cache);
  const unsigned char* values = reinterpret_cast<const unsigned char*>(ctx.value_cache);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int ktok = tile + 8 * nt + g;
#pragma unroll
    for (int k = 0; k < S::KWORDS * 4 / S::KB; ++k)
      load_codes<S::KB>(keys + (first_row[nt] + g) * D + S::k_column(k, t), ktok >= begin && ktok < ctx.end,
                        &T.k[nt][k * S::KB / 4]);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int vtok = tile + 8 * nt + 2 * t + h;
#pragma unroll
      for (int k = 0; k < S::VWORDS * 4 / S::VB; ++k)
        load_codes<S::VB>(values + (first_row[nt] + 2 * t + h) * D + S::v_column(k, g),
                          vtok >= begin && vtok < ctx.end, &T.v[nt >> 1][2 * (nt & 1) + h][k * S::VB / 4]);
    }
    if constexpr (KVQ == 1) {  // any value: the scales of masked tokens are never used
      T.kscale[nt] = __ldcg(reinterpret_cast<const u32*>(ctx.key_scales + first_row[nt] + 2 * t));
      T.vscale[nt] = __ldcg(reinterpret_cast<const u32*>(ctx.value_scales + first_row[nt] + 2 * t));
    }
  }
}

// attend_tile over a code tile: keys outside [begin, ctx.end) are masked. qrows: this thread's two query rows
// (row g and g+8) at d = 0; o[c][j] is n-tile 4c + j of CodeSlices' V order.
template <int DT, int D, int KVQ, int TOKENS>
__device__ __forceinline__ void attend_code_tile(const CodeTile<D, TOKENS>& T, int tile, int begin,
                                                 const TileContext& ctx, const u16* const (&qrows)[2],
                                                 const bool (&qvalid)[2], float scale, float softcap,
                                                 float (&o)[D / 32][4][4], float (&row_max)[2], float (&row_sum)[2]) {
  using S = CodeSlices<D>;
  constexpr int NT = TOKENS / 8, KS = TOKENS / 16;
  const int t = ctx.t;
  float s[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
  for (int k = 0; k < S::KWORDS * 4 / S::KB; ++k) {
#pragma unroll
    for (int i = 0; i < S::KB / 8; ++i) {  // 8 d of the chunk a time: Q re-read each tile (L1 hits), 2 k-steps
      u32 qf[2][4];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint4 v = qvalid[r] ? __ldg(reinterpret_cast<const uint4*>(qrows[r] + S::k_column(k, t) + 8 * i))
                                  : make_uint4(0, 0, 0, 0);
        qf[r][0] = halves_of<DT>(v.x); qf[r][1] = halves_of<DT>(v.y);
        qf[r][2] = halves_of<DT>(v.z); qf[r][3] = halves_of<DT>(v.w);
      }
#pragma unroll
      for (int w = 0; w < 2; ++w) {  // k-step: codes 8i + 4w .. + 3 of the chunk, Q words 2w, 2w + 1
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          u32 b0, b1;
          codes_to_halves<KVQ>(T.k[nt][k * S::KB / 4 + 2 * i + w], b0, b1);
          Num<0>::mma(s[nt], qf[0][2 * w], qf[1][2 * w], qf[0][2 * w + 1], qf[1][2 * w + 1], b0, b1);
        }
      }
    }
  }
  float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int tok = tile + 8 * nt + 2 * t + (e & 1);
      const float key_scale =
          KVQ == 2 ? ctx.key_head_scale : half_bits_to_float((u16)(T.kscale[nt] >> (16 * (e & 1))));
      float v = s[nt][e] * scale * key_scale;
      if (softcap > 0.0f) v = tanhf(v / softcap) * softcap;
      v = tok >= begin && tok < ctx.end ? v : -INFINITY;
      s[nt][e] = v;
      tile_max[e >> 1] = fmaxf(tile_max[e >> 1], v);
    }
  }
  softmax_update(s, tile_max, o, row_max, row_sum);
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    // P of the k-step's 16 tokens as the A operand, in [0, 1]: folding small V scales into it would push its
    // products below fp16's normal range at long contexts, so int8 scales multiply the V pairs (and e4m3's head
    // scale the output, in the kernel)
    const u32 pa0 = Num<0>::pack(s[2 * ks][0], s[2 * ks][1]);          // row g, tok 2t, 2t+1
    const u32 pa1 = Num<0>::pack(s[2 * ks][2], s[2 * ks][3]);          // row g+8
    const u32 pa2 = Num<0>::pack(s[2 * ks + 1][0], s[2 * ks + 1][1]);  // row g, tok 2t+8, 2t+9
    const u32 pa3 = Num<0>::pack(s[2 * ks + 1][2], s[2 * ks + 1][3]);  // row g+8
    // int8: the fp16 scales of V rows (2t, 2t+1) and (2t+8, 2t+9) as pairs, 0 for masked tokens (whose P is 0 and
    // whose scales may be anything, NaN included)
    u32 vs[2] = {0u, 0u};
    if constexpr (KVQ == 1) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int tok = tile + 16 * ks + 8 * h + 2 * t;
        const u32 lo = tok >= begin && tok < ctx.end ? 0x0000FFFFu : 0u;
        const u32 hi = tok + 1 >= begin && tok + 1 < ctx.end ? 0xFFFF0000u : 0u;
        vs[h] = T.vscale[2 * ks + h] & (lo | hi);
      }
    }
#pragma unroll
    for (int w = 0; w < S::VWORDS; ++w) {  // codes 4w .. 4w + 3 of the slice: n-tiles 4w .. 4w + 3
      u32 b0[4], b1[4];  // per n-tile: (V[2t][d], V[2t+1][d]) and (V[2t+8][d], V[2t+9][d])
      codes_to_halves<KVQ>(__byte_perm(T.v[ks][0][w], T.v[ks][1][w], 0x5140), b0[0], b0[1]);
      codes_to_halves<KVQ>(__byte_perm(T.v[ks][0][w], T.v[ks][1][w], 0x7362), b0[2], b0[3]);
      codes_to_halves<KVQ>(__byte_perm(T.v[ks][2][w], T.v[ks][3][w], 0x5140), b1[0], b1[1]);
      codes_to_halves<KVQ>(__byte_perm(T.v[ks][2][w], T.v[ks][3][w], 0x7362), b1[2], b1[3]);
      if constexpr (KVQ == 1) {
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          b0[b] = Num<0>::mul(b0[b], vs[0]);
          b1[b] = Num<0>::mul(b1[b], vs[1]);
        }
      }
#pragma unroll
      for (int b = 0; b < 4; ++b) Num<0>::mma(o[w][b], pa0, pa1, pa2, pa3, b0[b], b1[b]);
    }
  }
}

// The decode kernel's tile steps over either cache (begin: the range's first token, which only code tiles read).
template <int KVQ, int DT, int D, int PRELOAD>
__device__ __forceinline__ void fetch_kv_tile(Tile<DT, D, PRELOAD>& T, int tile, int, const TileContext& ctx) {
  fetch_tile<DT, D, PRELOAD>(T, tile, ctx);
}
template <int KVQ, int D, int TOKENS>
__device__ __forceinline__ void fetch_kv_tile(CodeTile<D, TOKENS>& T, int tile, int begin, const TileContext& ctx) {
  fetch_code_tile<D, KVQ, TOKENS>(T, tile, begin, ctx);
}
template <int DT, int KVQ, int D, int PRELOAD>
__device__ __forceinline__ void attend_kv_tile(const Tile<DT, D, PRELOAD>& T, int tile, int, const TileContext& ctx,
                                               const u16* const (&qrows)[2], const bool (&qvalid)[2], float scale,
                                               float softcap, float (&o)[D / 32][4][4], float (&row_max)[2],
                                               float (&row_sum)[2]) {
  attend_tile<DT, D, PRELOAD>(T, tile, ctx, qrows, qvalid, scale, softcap, o, row_max, row_sum);
}
template <int DT, int KVQ, int D, int TOKENS>
__device__ __forceinline__ void attend_kv_tile(const CodeTile<D, TOKENS>& T, int tile, int begin,
                                               const TileContext& ctx, const u16* const (&qrows)[2],
                                               const bool (&qvalid)[2], float scale, float softcap,
                                               float (&o)[D / 32][4][4], float (&row_max)[2], float (&row_sum)[2]) {
  attend_code_tile<DT, D, KVQ, TOKENS>(T, tile, begin, ctx, qrows, qvalid, scale, softcap, o, row_max, row_sum);
}

// fn(c, e, sum) over the fragments of the rows this thread writes out (rows g and g + 8 below heads_here):
// its o values o[c][0..3][e] (e = 2 * row half + column half) and their float4 in the CTA's o_sum.
template <int CHUNKS, typename Fn>
__device__ __forceinline__ void each_written_fragment(float4 (&o_sum)[CHUNKS][4][32], int lane, int heads_here,
                                                      Fn&& fn) {
  const int g = lane >> 2;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (g + 8 * r >= heads_here) continue;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
      for (int h = 0; h < 2; ++h) fn(c, 2 * r + h, o_sum[c][2 * r + h][lane]);
  }
}

// The combined path's last step: the CTA's warps walked interleaved tiles of one context, each with its own
// online-softmax state (o, row max m_w, quad-summed row sum l_w). Combined in a fixed order, so the result is
// deterministic: per row the CTA max M, the total sum_w e^(m_w - M) l_w (warps in order), then o = sum_w
// e^(m_w - M) o_w accumulated in shared memory warp after warp (0, 1, ..., WARPS - 2), the last warp adding its
// own in registers. A warp that saw nothing (m_w = -inf) weighs 0; rows past heads_here are never written out,
// so they skip the shared memory (half the traffic at 8 heads a tile). On return the last warp's o, row_max and
// row_sum are the CTA's state. Shared memory: D * 64 bytes of o (16 KiB at D = 256) + WARPS * 128 of stats.
template <int D, int WARPS>
__device__ __forceinline__ void combine_warps(float (&o)[D / 32][4][4], float (&row_max)[2], float (&row_sum)[2],
                                              bool walked_tiles, int heads_here) {
  constexpr int CHUNKS = D / 32;
  __shared__ float warp_row_max[WARPS][16], warp_row_sum[WARPS][16];
  // o in fragment order, the same in every warp: [d block c][2 * row half r + column half h][lane] holds
  // d = 32c + 8t + 4h + {0..3} of row g + 8r (float4 per lane: a warp's access is 512 contiguous bytes)
  __shared__ float4 o_sum[CHUNKS][4][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  if (t == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      warp_row_max[warp][g + 8 * r] = row_max[r];
      warp_row_sum[warp][g + 8 * r] = row_sum[r];
    }
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r;
    float cta_max = -INFINITY;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) cta_max = fmaxf(cta_max, warp_row_max[w][row]);
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float m = warp_row_max[w][row];
      total += (m == -INFINITY ? 0.0f : __expf(m - cta_max)) * warp_row_sum[w][row];
    }
    const float weight = row_max[r] == -INFINITY ? 0.0f : __expf(row_max[r] - cta_max);
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        o[c][j][2 * r] *= weight;
        o[c][j][2 * r + 1] *= weight;
      }
    row_max[r] = cta_max;
    row_sum[r] = total;
  }
  for (int w = 0; w < WARPS - 1; ++w) {
    if (warp == w && (w == 0 || walked_tiles)) {  // warp 0 initializes; an idle warp would add zeros
      each_written_fragment(o_sum, lane, heads_here, [&](int c, int e, float4& sum) {
        const float4 v = make_float4(o[c][0][e], o[c][1][e], o[c][2][e], o[c][3][e]);
        sum = w == 0 ? v : make_float4(sum.x + v.x, sum.y + v.y, sum.z + v.z, sum.w + v.w);
      });
    }
    __syncthreads();
  }
  if (warp == WARPS - 1) {
    each_written_fragment(o_sum, lane, heads_here, [&](int c, int e, float4& sum) {
      o[c][0][e] += sum.x;
      o[c][1][e] += sum.y;
      o[c][2][e] += sum.z;
      o[c][3][e] += sum.w;
    });
  }
}

// The clustered path's last step, after combine_warps: the CLUSTER CTAs of a (KV head tile, sequence) walked
// interleaved tiles of its context, and each one's last warp (`holder`) holds the CTA's state. Each publishes it
// in its shared memory; after a cluster barrier every holder reads the states of all ranks through distributed
// shared memory, in rank order (deterministic), and combines the d blocks its CTA writes (c % CLUSTER == rank)
// as combine_warps combines warps: the cluster max M, total sum_q e^(m_q - M) l_q, o = sum_q e^(m_q - M) o_q. A
// rank that saw nothing (m_q = -inf) weighs 0. A second barrier keeps every CTA's shared memory alive until all
// have read it, so every thread of every CTA must reach both barriers.
template <int D, int CLUSTER>
__device__ __forceinline__ void combine_cluster(float (&o)[D / 32][4][4], float (&row_max)[2], float (&row_sum)[2],
                                                bool holder, int rank) {
  constexpr int CHUNKS = D / 32;
  __shared__ float4 cluster_o[CHUNKS][4][32];  // the holder's o in fragment order, as combine_warps' o_sum
  __shared__ float cluster_stats[2][16];       // per row: the CTA's max, its total
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  if (holder) {
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
      for (int e = 0; e < 4; ++e) cluster_o[c][e][lane] = make_float4(o[c][0][e], o[c][1][e], o[c][2][e], o[c][3][e]);
    if (t == 0) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        cluster_stats[0][g + 8 * r] = row_max[r];
        cluster_stats[1][g + 8 * r] = row_sum[r];
      }
    }
  }
  cluster_barrier<true>();
  if (holder) {
    float weight[CLUSTER][2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float rank_max[CLUSTER], rank_sum[CLUSTER], cluster_max = -INFINITY;
#pragma unroll
      for (int q = 0; q < CLUSTER; ++q) {
        rank_max[q] = cluster_load(cluster_address(&cluster_stats[0][g + 8 * r], q));
        rank_sum[q] = cluster_load(cluster_address(&cluster_stats[1][g + 8 * r], q));
        cluster_max = fmaxf(cluster_max, rank_max[q]);
      }
      float total = 0.0f;
#pragma unroll
      for (int q = 0; q < CLUSTER; ++q) {
        weight[q][r] = rank_max[q] == -INFINITY ? 0.0f : __expf(rank_max[q] - cluster_max);
        total += weight[q][r] * rank_sum[q];
      }
      row_max[r] = cluster_max;
      row_sum[r] = total;
    }
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
      if (c % CLUSTER != rank) continue;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int q = 0; q < CLUSTER; ++q) {
          const float4 v = cluster_load4(cluster_address(&cluster_o[c][e][lane], q));
          const float w = weight[q][e >> 1];
          sum = make_float4(sum.x + w * v.x, sum.y + w * v.y, sum.z + w * v.z, sum.w + w * v.w);
        }
        o[c][0][e] = sum.x;
        o[c][1][e] = sum.y;
        o[c][2][e] = sum.z;
        o[c][3][e] = sum.w;
      }
    }
  }
  cluster_barrier<false>();
}

// The 8 consecutive outputs d = 32c + 8t + 0..7 of this thread's row g + 8r from its d block's fragments oc = o[c]
// (oc[j][2r] is d = 32c + 8t + j, oc[j][2r + 1] is d + 4), times `inv`, as DT values.
template <int DT>
__device__ __forceinline__ uint4 output_piece(const float (&oc)[4][4], int r, float inv) {
  u32 packed[4];
#pragma unroll
  for (int w = 0; w < 4; ++w) {  // elements 2w, 2w+1
    const int i0 = 2 * w, i1 = 2 * w + 1;
    const float v0 = (i0 < 4 ? oc[i0][2 * r] : oc[i0 - 4][2 * r + 1]) * inv;
    const float v1 = (i1 < 4 ? oc[i1][2 * r] : oc[i1 - 4][2 * r + 1]) * inv;
    packed[w] = Num<DT>::pack(v0, v1);
  }
  return make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

// The 8 outputs of d block c of this thread's row g + 8r (fragment_column's two runs of 4), times `inv`, written
// as DT values into out_row [D].
template <int DT, int D, int KVQ>
__device__ __forceinline__ void store_output(u16* out_row, const float (&oc)[4][4], int c, int r, float inv, int t) {
  if constexpr (KVQ) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
      *reinterpret_cast<uint2*>(out_row + fragment_column<D, KVQ>(c, t, h)) =
          make_uint2(Num<DT>::pack(oc[0][2 * r + h] * inv, oc[1][2 * r + h] * inv),
                     Num<DT>::pack(oc[2][2 * r + h] * inv, oc[3][2 * r + h] * inv));
  } else {
    *reinterpret_cast<uint4*>(out_row + 32 * c + 8 * t) = output_piece<DT>(oc, r, inv);
  }
}

// A split's partial of this thread's row g + 8r for paged_reduce_kernel: its unnormalized o at
// part_out[base][fragment_column ..] and (running max, sum) at part_stats[base] (base = (row, head) * splits +
// split).
template <int D, int KVQ = 0>
__device__ __forceinline__ void write_partial(float* part_out, float* part_stats, i64 base,
                                              const float (&o)[D / 32][4][4], int r, float row_max, float row_sum,
                                              int t) {
  float* row = part_out + base * D;
#pragma unroll
  for (int c = 0; c < D / 32; ++c)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      *reinterpret_cast<float4*>(row + fragment_column<D, KVQ>(c, t, h)) =
          make_float4(o[c][0][2 * r + h], o[c][1][2 * r + h], o[c][2][2 * r + h], o[c][3][2 * r + h]);
  if (t == 0) {
    part_stats[base * 2] = row_max;
    part_stats[base * 2 + 1] = row_sum;
  }
}

// A decode CTA's keys: [begin, ctx.end) of its sequence's context (split `split` of tokens_per_split tokens, from
// the sliding window's start on), and ctx, where its KV head's rows live. An e4m3 cache's head scales (times
// FP8_PAIR_SCALE; 1 for other caches) are written once, before any step, so they are read at once (before the PDL
// wait), as are the lengths and block tables (the step's inputs, no kernel's output).
struct DecodeKeys {
  int seq_len, begin;
  float value_head_scale;
  TileContext ctx;
};

template <int KVQ>
__device__ __forceinline__ DecodeKeys decode_keys(const void* key_cache, const void* value_cache,
                                                  const u16* key_scales, const u16* value_scales,
                                                  const int* block_tables, const int* seq_lens, int seq, int kv_head,
                                                  int split, int num_kv_heads, int log2_block_size, int max_blocks,
                                                  int tokens_per_split, int window, int g, int t) {
  const int seq_len = __ldcg(seq_lens + seq);
  const int window_start = window > 0 ? max(0, seq_len - window) : 0;
  const int begin = max(split * tokens_per_split, window_start);
  const int end = min(seq_len, (split + 1) * tokens_per_split);
  const float key_head_scale = KVQ == 2 ? reinterpret_cast<const float*>(key_scales)[kv_head] * FP8_PAIR_SCALE : 1.0f;
  const float value_head_scale =
      KVQ == 2 ? reinterpret_cast<const float*>(value_scales)[kv_head] * FP8_PAIR_SCALE : 1.0f;
  return {seq_len, begin, value_head_scale,
          TileContext{key_cache, value_cache, key_scales, value_scales, block_tables + (i64)seq * max_blocks,
                      log2_block_size, num_kv_heads, kv_head, end, g, t, key_head_scale}};
}

// WARPS: 1 on the split path (the default, so the registry's names without it stay valid), COMBINED_WARPS on
// the combined and clustered paths. A combined CTA is meant to fill an SM's registers alone (at least one CTA an
// SM, or ptxas may cap registers at 128 for two and spill); the split path leaves it unspecified (0), so ptxas
// may trade registers for more one-warp CTAs an SM. CLUSTER > 1 (the clustered path, SM90+): grid.z is CLUSTER
// CTAs of one thread-block cluster, whose CLUSTER x WARPS warps take the context's tiles round robin and combine
// in combine_warps, then combine_cluster; no split, no partials.
template <int DT, int D, int KVQ, int PIPELINE, int WARPS = 1, int CLUSTER = 1>
__global__ void __launch_bounds__(32 * WARPS, WARPS > 1 ? 1 : 0) paged_decode_kernel(
    const u16* __restrict__ query,          // [B, H, D]
    const void* __restrict__ key_cache,     // [NB, KVH, BS, D]
    const void* __restrict__ value_cache,   // [NB, KVH, BS, D]
    const u16* __restrict__ key_scales,     // int8: [NB, KVH, BS] fp16; e4m3: [KVH] fp32
    const u16* __restrict__ value_scales,   // int8: [NB, KVH, BS] fp16; e4m3: [KVH] fp32
    const int* __restrict__ block_tables,   // [B, max_blocks]
    const int* __restrict__ seq_lens,       // [B]
    u16* __restrict__ out,                  // [B, H, D] (one split)
    float* __restrict__ part_out,           // [B, H, splits, D] (several splits)
    float* __restrict__ part_stats,         // [B, H, splits, 2]: running max, sum of exp
    int num_heads, int num_kv_heads, int log2_block_size, int max_blocks, int tokens_per_split,
    float scale, float softcap, int window,
    int fresh_tokens) {  // at most this many of a sequence's newest positions are the previous kernel's writes
  launch_dependents();
  static_assert(D % 32 == 0 && D <= 256, "head_dim must be a multiple of 32, at most 256");
  constexpr int CHUNKS = D / 32;
  // Up to D = 128 a tile's K and V rows are loaded whole before its math, and with PIPELINE one tile
  // ahead of it (two register sets, ping-pong: more bytes in flight, fewer warps resident); wider
  // heads load 16-bit rows chunk by chunk inside the products, and code tiles of 16 tokens whole, one at a time.
  constexpr int PRELOAD = D <= 128;
  // tokens a tile: 16 of a 16-bit cache, 32 of codes (16 past D = 128: CodeTile)
  constexpr int TILE = KVQ && D <= 128 ? 32 : 16;
  const int warp = WARPS == 1 ? 0 : threadIdx.x >> 5, lane = threadIdx.x - 32 * warp, g = lane >> 2, t = lane & 3;
  const int group = num_heads / num_kv_heads;
  const int head_tiles = (group + 15) / 16;
  const int kv_head = blockIdx.x / head_tiles;
  const int head_lo = kv_head * group + (blockIdx.x % head_tiles) * 16;  // first query head of the tile
  const int heads_here = min(16, kv_head * group + group - head_lo);
  const int seq = blockIdx.y;
  // clustered: grid.z is the cluster (dims (1, 1, CLUSTER)), so a CTA's rank in it is blockIdx.z
  const int rank = CLUSTER > 1 ? blockIdx.z : 0, split = CLUSTER > 1 ? 0 : blockIdx.z;
  const int splits = CLUSTER > 1 ? 1 : gridDim.z;
  const DecodeKeys keys = decode_keys<KVQ>(key_cache, value_cache, key_scales, value_scales, block_tables, seq_lens,
                                           seq, kv_head, split, num_kv_heads, log2_block_size, max_blocks,
                                           tokens_per_split, window, g, t);
  const int seq_len = keys.seq_len, begin = keys.begin, end = keys.ctx.end;
  const float value_head_scale = keys.value_head_scale;
  const TileContext& ctx = keys.ctx;

  const u16* qrows[2];
  bool qvalid[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    qvalid[r] = g + 8 * r < heads_here;
    qrows[r] = query + ((i64)seq * num_heads + head_lo + (qvalid[r] ? g + 8 * r : 0)) * D + (KVQ ? 0 : 8 * t);
  }

  float o[CHUNKS][4][4];  // [d block][n-tile j][c0..c3]
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
    for (int j = 0; j < 4; ++j) o[c][j][0] = o[c][j][1] = o[c][j][2] = o[c][j][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};

  // the warps take the split's tiles round robin: warp w walks tiles w, w + WARPS, ... (clustered: the cluster's
  // warps, rank after rank). Code tiles start at multiples of 16 tokens (their keys before `begin` are masked).
  const int tile_begin = KVQ ? begin & ~15 : begin;
  const int first = tile_begin + TILE * (rank * WARPS + warp), stride = TILE * WARPS * CLUSTER;
  // Up to here the kernel has read only the step's inputs (lengths, block tables), which no kernel of the
  // layer writes. Cache rows older than the sequence's `fresh_tokens` newest positions were written by earlier
  // steps, so a first tile that ends before those is fetched before waiting for the kernel just before this one
  // (the step's cache write): its block-table and K/V round trips overlap that kernel instead of following it.
  // Everything else (the query, the fresh rows, every write) waits.
  const bool settled_first_tile = first + TILE - 1 < seq_len - fresh_tokens;
  using KvTile = typename Pick<KVQ != 0, CodeTile<D, TILE>, Tile<DT, D, PRELOAD>>::type;
  if constexpr (PRELOAD && PIPELINE) {
    KvTile a, b;
    if (!settled_first_tile) wait_for_prior_grids();
    fetch_kv_tile<KVQ>(a, first, begin, ctx);
    if (settled_first_tile) wait_for_prior_grids();
    for (int tile = first; tile < end; tile += 2 * stride) {
      fetch_kv_tile<KVQ>(b, tile + stride, begin, ctx);
      attend_kv_tile<DT, KVQ>(a, tile, begin, ctx, qrows, qvalid, scale, softcap, o, row_max, row_sum);
      if (tile + stride >= end) break;
      fetch_kv_tile<KVQ>(a, tile + 2 * stride, begin, ctx);
      attend_kv_tile<DT, KVQ>(b, tile + stride, begin, ctx, qrows, qvalid, scale, softcap, o, row_max, row_sum);
    }
  } else {
    wait_for_prior_grids();
    for (int tile = first; tile < end; tile += stride) {
      KvTile a;
      fetch_kv_tile<KVQ>(a, tile, begin, ctx);
      attend_kv_tile<DT, KVQ>(a, tile, begin, ctx, qrows, qvalid, scale, softcap, o, row_max, row_sum);
    }
  }

  if constexpr (KVQ == 2) {  // P V summed the codes' values: the head's scale multiplies the result
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[c][j][e] *= value_head_scale;
  }
  // full row sums across the quad (the 4 threads of a row share its running max)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += __shfl_xor_sync(0xFFFFFFFFu, row_sum[r], 1);
    row_sum[r] += __shfl_xor_sync(0xFFFFFFFFu, row_sum[r], 2);
  }
  if constexpr (WARPS > 1) {
    combine_warps<D, WARPS>(o, row_max, row_sum, first < end, heads_here);
    if constexpr (CLUSTER > 1) combine_cluster<D, CLUSTER>(o, row_max, row_sum, warp == WARPS - 1, rank);
    if (warp != WARPS - 1) return;  // the last warp holds the CTA's output
  }
  // o[c][j]: c0/c1 = row g, d = fragment_column(c, t, 0 / 1) + j; c2/c3 the same for row g+8
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r;
    if (row >= heads_here) continue;
    const int head = head_lo + row;
    if (splits == 1) {
      const float inv = row_sum[r] > 0.0f ? 1.0f / row_sum[r] : 0.0f;
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c) {
        if (CLUSTER > 1 && c % CLUSTER != rank) continue;  // another rank of the cluster writes it
        store_output<DT, D, KVQ>(out + ((i64)seq * num_heads + head) * D, o[c], c, r, inv, t);
      }
    } else {
      write_partial<D, KVQ>(part_out, part_stats, ((i64)seq * num_heads + head) * splits + split, o, r,
                            row_max[r], row_sum[r], t);
    }
  }
}

// ---- Query heads as the mma N dimension ------------------------------------------------------------------------
// paged_decode_kernel puts a KV head's query heads on the 16 rows of the mma's A operand; with G <= 8 heads (GQA
// groups of Qwen2.5, Llama 3) half of every Q.K^T and P.V mma multiplies zero rows. paged_decode_heads_n_kernel
// (G <= 8, D = 64 or 128, any cache the decode kernel reads) transposes both products so that the heads are the
// mma's n = 8:
//   S^T [16 tokens, 8 heads] = K [16 tokens, D] . Q^T [D, 8 heads]    (K rows the A operand)
//   O^T [D, 8 heads]        += V^T [D, 16 tokens] . P^T [16 tokens, 8 heads]   (V rows the A operand)
// so a 16-token m-tile takes D / 16 k-steps of each, half the mma of the other layout, and every cache element is
// loaded and (codes) converted once, by one thread. Q^T stays in registers for the CTA's life. A tile is 8 KiB of a
// warp's loads: 16 tokens of a 16-bit cache, 32 (two m-tiles) of codes.
// One CTA per (KV head, sequence, split of the context); its WARPS warps take the split's tiles round robin, each
// loading a tile's rows one tile ahead of its math and its block-table entries two tiles ahead, and combine their
// softmax states in shared memory; with several splits the CTA writes a partial that paged_reduce_kernel combines.
//
// Operand layouts (g = lane / 4, t = lane % 4; any permutation of a reduction axis is fine if both operands share
// it, and the output's d permutation is undone when it is written):
//   m-tile rows: S^T row r of an m-tile (16 tokens from a multiple of 16) is token 2r for r < 8 and 2(r - 8) + 1
//     for r >= 8, so thread g's rows g and g + 8 are tokens 2g and 2g + 1 (one block, one 4-byte int8 scale load),
//     and the P^T rows 2t, 2t + 1, 2t + 8, 2t + 9 it multiplies with V are tokens 4t, 4t + 2, 4t + 1, 4t + 3.
//   K (A of S^T, k = d): thread t holds the 16-byte chunks at bytes 64c + 16t of its tokens' rows 2g, 2g + 1 (a
//     warp's load covers whole sectors). Codes: chunk c is d = 64c + 16t + 0..15 and k-step w = 4c + u takes its
//     word u (codes 0, 1 at k = 2t, 2t + 1, codes 2, 3 at k = 2t + 8, 2t + 9); 16-bit rows: chunk c is d = 32c + 8t
//     + 0..7 and k-step w takes the row's words 2w (k = 2t, 2t + 1) and 2w + 1 (k = 2t + 8, 2t + 9). The Q^T B
//     fragment of head g holds the query at the same d (q[2w], q[2w + 1]).
//   V (A of O^T, m = d): thread g holds d = VB g + 0..VB-1 (VB = D / 8 elements) of tokens 4t .. 4t + 3; O^T m-tile
//     j rows g and g + 8 are d = VB g + 2j and + 1, so a thread ends with the VB consecutive outputs from VB g of
//     heads 2t and 2t + 1. A pair (V[4t][d], V[4t + 2][d]) is one byte_perm of two rows (codes: 4 d, 2 m-tiles, a
//     word; 16-bit: pair_of_los / pair_of_his).
//   P^T (B of O^T): the S^T accumulator of rows g / g + 8, heads 2t, 2t + 1, packed and transposed as two 8 x 8
//     matrices (movmatrix) is the B fragment (k = 2t, 2t + 1 / 2t + 8, 2t + 9; n = head g).
// Codes multiply in fp16 whatever the query dtype (as paged_decode_kernel's code tiles), 16-bit rows in their dtype.
// int8: each token's K scale multiplies its scores, its V scale its P (in fp16, so products below 2^-14 lose
// precision: they weigh at most 2^-14 of the largest); e4m3: the head's scales multiply the scores and the output.
// int8 codes enter the mma biased, as the exact halves 1152 + code (biased_codes_to_halves: no subtraction). In
// S^T the bias's share of each score, 1152 sum_d Q[head][d], is the same for every token and subtracted from the
// scores. In O^T it is 1152 sum_k P^T[k][head] of the tile, the same for every d: the mma computes it from the same
// fp16 P (A = all 1152), and the rescale before the tile's P.V subtracts it from o, so the large terms cancel within
// the tile's own sums (fp32) and never accumulate over the context.
// Scores are kept in log2 units (ex2), and written to partials in natural ones (paged_reduce_kernel's).
template <int D, int KVQ>
struct HeadsNSlices {
  static_assert(D == 64 || D == 128, "the heads-as-n kernel takes head_dim 64 or 128");
  static constexpr int ELEMENT = KVQ ? 1 : 2;                    // bytes of a cache element
  static constexpr int MTS = KVQ ? 2 : 1, TILE = 16 * MTS;       // m-tiles, tokens a tile
  static constexpr int KSTEPS = D / 16;                          // S^T k-steps
  static constexpr int KCHUNKS = D * ELEMENT / 64;               // K: 16-byte chunks a row
  static constexpr int KWORDS = 4 * KCHUNKS;                     // K: words a row (codes: one a k-step)
  static constexpr int VB = D / 8, VBYTES = VB * ELEMENT;        // V: elements, bytes a row
  static constexpr int VWORDS = VBYTES / 4;                      // V: words a row
  static constexpr int MTILES = D / 16;                          // O^T m-tiles
};

// A thread's rows of a tile (m-tiles mt of 16 tokens), as loaded: K of tokens 16mt + 2g + h, V of tokens 16mt + 4t +
// q; int8: the fp16 K and V scales of tokens 16mt + 2g, + 1 (low, high half). kblock / vblock: the blocks holding
// those K and V tokens (0 where none is in range), read a tile before the rows (fetch_heads_n_blocks), so that a row
// load never waits on its block-table read.
template <int D, int KVQ>
struct HeadsNTile {
  using S = HeadsNSlices<D, KVQ>;
  u32 k[S::MTS][2][S::KWORDS];
  u32 v[S::MTS][4][S::VWORDS];
  u32 kscale[S::MTS], vscale[S::MTS];
  u32 kblock[S::MTS], vblock[S::MTS];
};

// The block-table entries of a tile's rows (fetch_heads_n_tile's; tokens ktok, ktok + 1 and vtok .. vtok + 3 each
// lie in one block: block_size >= 8 and tiles start at multiples of 16).
template <int D, int KVQ>
__device__ __forceinline__ void fetch_heads_n_blocks(HeadsNTile<D, KVQ>& T, int tile, int begin,
                                                     const TileContext& ctx) {
#pragma unroll
  for (int mt = 0; mt < HeadsNSlices<D, KVQ>::MTS; ++mt) {
    const int ktok = tile + 16 * mt + 2 * ctx.g, vtok = tile + 16 * mt + 4 * ctx.t;
    T.kblock[mt] = ktok + 1 >= begin && ktok < ctx.end ? __ldcg(ctx.table + (ktok >> ctx.log2_block_size)) : 0;
    T.vblock[mt] = vtok + 3 >= begin && vtok < ctx.end ? __ldcg(ctx.table + (vtok >> ctx.log2_block_size)) : 0;
  }
}

// BYTES (8, 16 or 32) at p into BYTES / 4 words where valid; elsewhere the words keep what they held.
template <int BYTES>
__device__ __forceinline__ void load_row_if(const unsigned char* p, bool valid, u32* w) {
  if (!valid) return;
  if constexpr (BYTES == 8) {
    const uint2 v = __ldcg(reinterpret_cast<const uint2*>(p));
    w[0] = v.x; w[1] = v.y;
  } else {
#pragma unroll
    for (int i = 0; i < BYTES / 16; ++i) {
      const uint4 v = __ldcg(reinterpret_cast<const uint4*>(p) + i);
      w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
    }
  }
}

// The rows of T's blocks (fetch_heads_n_blocks of the same tile). Rows outside [begin, ctx.end) are not loaded:
// their words keep an earlier tile's (zeros before the first), finite values that the masked scores and zero
// probabilities ignore, so no instruction a load clears them. Addresses: a block's rows of the CTA's KV head start
// at head_base + block * block_bytes (one 64-bit multiply a row group), the rest is 32-bit.
template <int D, int KVQ>
__device__ __forceinline__ void fetch_heads_n_tile(HeadsNTile<D, KVQ>& T, int tile, int begin,
                                                   const TileContext& ctx) {
  using S = HeadsNSlices<D, KVQ>;
  constexpr int ROW = D * S::ELEMENT;  // bytes
  const int block_size = 1 << ctx.log2_block_size, g = ctx.g, t = ctx.t;
  const u32 block_rows = (u32)ctx.num_kv_heads << ctx.log2_block_size;  // rows of one block, all KV heads
  const u32 head_row = (u32)ctx.kv_head << ctx.log2_block_size;
  const unsigned char* keys = reinterpret_cast<const unsigned char*>(ctx.key_cache) + (u64)head_row * ROW;
  const unsigned char* values = reinterpret_cast<const unsigned char*>(ctx.value_cache) + (u64)head_row * ROW;
#pragma unroll
  for (int mt = 0; mt < S::MTS; ++mt) {
    const int ktok = tile + 16 * mt + 2 * g, vtok = tile + 16 * mt + 4 * t;
    const u32 kblk = T.kblock[mt], vblk = T.vblock[mt];
    const unsigned char* krow = keys + (u64)(kblk * block_rows) * ROW + (u32)((ktok & (block_size - 1)) * ROW + 16 * t);
    const unsigned char* vrow =
        values + (u64)(vblk * block_rows) * ROW + (u32)((vtok & (block_size - 1)) * ROW + S::VBYTES * g);
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int c = 0; c < S::KCHUNKS; ++c)
        load_row_if<16>(krow + h * ROW + 64 * c, ktok + h >= begin && ktok + h < ctx.end, &T.k[mt][h][4 * c]);
#pragma unroll
    for (int q = 0; q < 4; ++q)
      load_row_if<S::VBYTES>(vrow + q * ROW, vtok + q >= begin && vtok + q < ctx.end, T.v[mt][q]);
    if constexpr (KVQ == 1) {  // any value where masked: attend_heads_n_tile zeroes those tokens' V scales
      const u32 scale_row = kblk * block_rows + head_row + (ktok & (block_size - 1));
      T.kscale[mt] = __ldcg(reinterpret_cast<const u32*>(ctx.key_scales + scale_row));
      T.vscale[mt] = __ldcg(reinterpret_cast<const u32*>(ctx.value_scales + scale_row));
    }
  }
}

// Four codes (one u32, byte i = element i) -> fp16 pairs (e0, e1) and (e2, e3) as the heads-as-n kernel's mma take
// them: e4m3 as codes_to_halves converts them, int8 as the exact halves 1152 + code (CODE_BIAS_PAIR: the bias).
constexpr u32 CODE_BIAS_PAIR = 0x64806480u;  // the halves (1152, 1152)
template <int KVQ> __device__ __forceinline__ void biased_codes_to_halves(u32 w, u32& p01, u32& p23) {
  if constexpr (KVQ == 1) {
    // flip the sign bit: byte u = e + 128; half (0x64 << 8 | u) = 1024 + u = 1152 + e
    const u32 u = w ^ 0x80808080u;
    p01 = __byte_perm(u, 0x64646464u, 0x4140);
    p23 = __byte_perm(u, 0x64646464u, 0x4342);
  } else {
    codes_to_halves<KVQ>(w, p01, p23);
  }
}

// 8 x 8 b16 matrix transpose across the warp: the fragment of row g, columns 2t, 2t + 1 becomes that of the
// transpose.
__device__ __forceinline__ u32 transpose_8x8(u32 x) {
  u32 y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

constexpr float LOG2_E = 1.4426950408889634f;

// One tile: S^T, the online softmax over it (per head 2t + e: running max row_max[e] in log2 units, this thread's
// share of the running sum row_sum[e]), O^T = O^T * alpha + V^T P^T. MT (DT for 16-bit rows, fp16 for codes): the
// mma's operand type. q: head g's Q^T B fragments (k-step w: q[2w], q[2w + 1]); key_bias[e]: int8 K codes' bias in
// head 2t + e's scores; score_scale: the softmax scale (times LOG2_E without softcap), times an e4m3 cache's key
// scale; inv_softcap: 1 / softcap (softcap > 0); o[j]: O^T m-tile j (c0 / c1: row g, heads 2t / 2t + 1; c2 / c3:
// row g + 8).
template <int MT, int D, int KVQ>
__device__ __forceinline__ void attend_heads_n_tile(const HeadsNTile<D, KVQ>& T, int tile, int begin,
                                                    const TileContext& ctx, const u32 (&q)[2 * D / 16],
                                                    const float (&key_bias)[2], float score_scale, float softcap,
                                                    float inv_softcap, float (&o)[D / 16][4], float (&row_max)[2],
                                                    float (&row_sum)[2]) {
  using S = HeadsNSlices<D, KVQ>;
  const int g = ctx.g, t = ctx.t;
  float s[S::MTS][4];  // [mt][2h + e]: token 16mt + 2g + h, head 2t + e
#pragma unroll
  for (int mt = 0; mt < S::MTS; ++mt) {
    s[mt][0] = s[mt][1] = s[mt][2] = s[mt][3] = 0.0f;
#pragma unroll
    for (int w = 0; w < S::KSTEPS; ++w) {
      u32 a0, a1, a2, a3;
      if constexpr (KVQ) {
        biased_codes_to_halves<KVQ>(T.k[mt][0][w], a0, a2);
        biased_codes_to_halves<KVQ>(T.k[mt][1][w], a1, a3);
      } else {
        a0 = T.k[mt][0][2 * w]; a2 = T.k[mt][0][2 * w + 1];
        a1 = T.k[mt][1][2 * w]; a3 = T.k[mt][1][2 * w + 1];
      }
      Num<MT>::mma(s[mt], a0, a1, a2, a3, q[2 * w], q[2 * w + 1]);
    }
  }
  float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int mt = 0; mt < S::MTS; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int tok = tile + 16 * mt + 2 * g + h;
      const float token_scale =
          KVQ == 1 ? score_scale * half_bits_to_float((u16)(T.kscale[mt] >> (16 * h))) : score_scale;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float v = (KVQ == 1 ? s[mt][2 * h + e] - key_bias[e] : s[mt][2 * h + e]) * token_scale;
        if (softcap > 0.0f) v = tanhf(v * inv_softcap) * (softcap * LOG2_E);
        v = tok >= begin && tok < ctx.end ? v : -INFINITY;
        s[mt][2 * h + e] = v;
        tile_max[e] = fmaxf(tile_max[e], v);
      }
    }
  float alpha[2], base[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {  // the head's max over the tile's tokens: the 8 threads of column 2t + e
    tile_max[e] = fmaxf(tile_max[e], __shfl_xor_sync(0xFFFFFFFFu, tile_max[e], 4));
    tile_max[e] = fmaxf(tile_max[e], __shfl_xor_sync(0xFFFFFFFFu, tile_max[e], 8));
    tile_max[e] = fmaxf(tile_max[e], __shfl_xor_sync(0xFFFFFFFFu, tile_max[e], 16));
    const float new_max = fmaxf(row_max[e], tile_max[e]);
    base[e] = new_max == -INFINITY ? 0.0f : new_max;  // a head with nothing seen yet
    alpha[e] = exp2_approx(row_max[e] - base[e]);
    row_max[e] = new_max;
    row_sum[e] *= alpha[e];
  }
  u32 pt[S::MTS][2];  // P^T B fragments of m-tile mt
#pragma unroll
  for (int mt = 0; mt < S::MTS; ++mt) {
    float p[4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int tok = tile + 16 * mt + 2 * g + h;
      // int8: the token's V scale, 0 where masked (its P is 0 and its scale may be anything, NaN included)
      const float value_scale =
          KVQ == 1 ? (tok >= begin && tok < ctx.end ? half_bits_to_float((u16)(T.vscale[mt] >> (16 * h))) : 0.0f)
                   : 1.0f;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float pe = exp2_approx(s[mt][2 * h + e] - base[e]);
        row_sum[e] += pe;
        p[2 * h + e] = KVQ == 1 ? pe * value_scale : pe;
      }
    }
    // P^T of the m-tile's 16 tokens as the B operand: rows 0..7 (tokens 2r) and 8..15 (tokens 2r + 1), transposed
    pt[mt][0] = transpose_8x8(Num<MT>::pack(p[0], p[1]));
    pt[mt][1] = transpose_8x8(Num<MT>::pack(p[2], p[3]));
  }
  if constexpr (KVQ == 1) {
    // the V codes' bias in this tile's O^T of heads 2t, 2t + 1 (c0, c1 of bias x P^T), taken out of o with the
    // rescale
    float value_bias[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int mt = 0; mt < S::MTS; ++mt)
      Num<0>::mma(value_bias, CODE_BIAS_PAIR, CODE_BIAS_PAIR, CODE_BIAS_PAIR, CODE_BIAS_PAIR, pt[mt][0], pt[mt][1]);
#pragma unroll
    for (int j = 0; j < S::MTILES; ++j) {
      o[j][0] = fmaf(o[j][0], alpha[0], -value_bias[0]); o[j][1] = fmaf(o[j][1], alpha[1], -value_bias[1]);
      o[j][2] = fmaf(o[j][2], alpha[0], -value_bias[0]); o[j][3] = fmaf(o[j][3], alpha[1], -value_bias[1]);
    }
  } else if (__any_sync(0xFFFFFFFFu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
    // the warp's maxima of all heads unchanged (most tiles past the first few): alpha is exactly 1
#pragma unroll
    for (int j = 0; j < S::MTILES; ++j) {
      o[j][0] *= alpha[0]; o[j][1] *= alpha[1];
      o[j][2] *= alpha[0]; o[j][3] *= alpha[1];
    }
  }
#pragma unroll
  for (int mt = 0; mt < S::MTS; ++mt) {
    // (V[4t][d], V[4t + 2][d]) for k = 2t, 2t + 1 and (V[4t + 1][d], V[4t + 3][d]) for k = 2t + 8, 2t + 9
    if constexpr (KVQ) {
#pragma unroll
      for (int w = 0; w < S::VWORDS; ++w) {  // codes 4w .. 4w + 3 of the slice: m-tiles 2w, 2w + 1
        u32 a0[2], a1[2], a2[2], a3[2];
        biased_codes_to_halves<KVQ>(__byte_perm(T.v[mt][0][w], T.v[mt][2][w], 0x5140), a0[0], a1[0]);
        biased_codes_to_halves<KVQ>(__byte_perm(T.v[mt][0][w], T.v[mt][2][w], 0x7362), a0[1], a1[1]);
        biased_codes_to_halves<KVQ>(__byte_perm(T.v[mt][1][w], T.v[mt][3][w], 0x5140), a2[0], a3[0]);
        biased_codes_to_halves<KVQ>(__byte_perm(T.v[mt][1][w], T.v[mt][3][w], 0x7362), a2[1], a3[1]);
#pragma unroll
        for (int i = 0; i < 2; ++i) Num<0>::mma(o[2 * w + i], a0[i], a1[i], a2[i], a3[i], pt[mt][0], pt[mt][1]);
      }
    } else {
#pragma unroll
      for (int w = 0; w < S::VWORDS; ++w)  // elements 2w, 2w + 1 of the slice: m-tile w, rows g, g + 8
        Num<MT>::mma(o[w], pair_of_los(T.v[mt][0][w], T.v[mt][2][w]), pair_of_his(T.v[mt][0][w], T.v[mt][2][w]),
                     pair_of_los(T.v[mt][1][w], T.v[mt][3][w]), pair_of_his(T.v[mt][1][w], T.v[mt][3][w]),
                     pt[mt][0], pt[mt][1]);
    }
  }
}

// Where the CTA's rows go: out [B, H, D] (one split) or part_out / part_stats (several), for KV head `kv_head`'s
// `group` heads of sequence `seq`.
struct HeadsNOutput {
  u16* out;
  float* part_out;
  float* part_stats;
  i64 first_row;  // (seq, kv_head's first query head) of [B, H]
  int group, split, splits;
  float value_scale;  // e4m3: the KV head's V scale; 1 otherwise
};

// Two consecutive outputs d, d + 1 of head `head` of the group (o0, o1: unnormalized, fp32), with the head's
// softmax state: normalized DT values into out, or (splits > 1) fp32 partials and, with `stats`, the head's max
// (natural-log units, as paged_reduce_kernel weighs the splits; -inf for a split with no keys) and sum.
template <int DT, int D>
__device__ __forceinline__ void write_heads_n_pair(const HeadsNOutput& w, int head, int d, float o0, float o1,
                                                   float row_max, float row_sum, bool stats) {
  if (head >= w.group) return;
  const i64 row = w.first_row + head;
  if (w.splits == 1) {
    const float inv = row_sum > 0.0f ? w.value_scale / row_sum : 0.0f;
    *reinterpret_cast<u32*>(w.out + row * D + d) = Num<DT>::pack(o0 * inv, o1 * inv);
  } else {
    const i64 base = row * w.splits + w.split;
    *reinterpret_cast<float2*>(w.part_out + base * D + d) = make_float2(o0 * w.value_scale, o1 * w.value_scale);
    if (stats) {
      w.part_stats[base * 2] = row_max * (1.0f / LOG2_E);
      w.part_stats[base * 2 + 1] = row_sum;
    }
  }
}

// Output entry `entry` of the fragment order (m-tile j = entry / 32, lane l = entry % 32: rows d = VB g_l + 2j and
// + 1 of heads 2t_l, 2t_l + 1) from its sums over the CTA's (or cluster's) warps and its heads' (max, total).
template <int DT, int D>
__device__ __forceinline__ void write_heads_n_entry(const HeadsNOutput& w, int entry, const float4& sum,
                                                    const float (&row_max)[2], const float (&row_sum)[2]) {
  const int j = entry >> 5, l = entry & 31, g = l >> 2, t = l & 3, d = (D / 8) * g + 2 * j;
  write_heads_n_pair<DT, D>(w, 2 * t, d, sum.x, sum.z, row_max[0], row_sum[0], entry < 4);
  write_heads_n_pair<DT, D>(w, 2 * t + 1, d, sum.y, sum.w, row_max[1], row_sum[1], entry < 4);
}

// The CTA's WARPS softmax states combined: every warp stores its o (fragment order) and its heads' (max, sum) in
// shared memory; after one barrier each thread takes one fragment entry (write_heads_n_entry's order), sums it over
// the warps in warp order (deterministic) weighted by 2^(m_w - M), M the CTA's max of the head (a warp that saw
// nothing weighs 0), and hands it to take(entry, sum, M [2], total [2]) with its two heads' max and total. row_sum
// enters summed over the warp's threads of its head. Shared memory: D * WARPS * 32 bytes of o (32 KiB at D = 128) +
// stats.
template <int D, int WARPS, typename Take>
__device__ __forceinline__ void combine_warps_heads_n(const float (&o)[D / 16][4], const float (&row_max)[2],
                                                      const float (&row_sum)[2], Take&& take) {
  constexpr int MTILES = D / 16;
  __shared__ float warp_row_max[WARPS][8], warp_row_sum[WARPS][8];
  __shared__ float4 warp_o[WARPS][MTILES][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane < 4) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      warp_row_max[warp][2 * lane + e] = row_max[e];
      warp_row_sum[warp][2 * lane + e] = row_sum[e];
    }
  }
#pragma unroll
  for (int j = 0; j < MTILES; ++j) warp_o[warp][j][lane] = make_float4(o[j][0], o[j][1], o[j][2], o[j][3]);
  __syncthreads();
  for (int entry = threadIdx.x; entry < MTILES * 32; entry += 32 * WARPS) {
    const int j = entry >> 5, l = entry & 31, t = l & 3;
    float weight[2][WARPS], cta_max[2], total[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      cta_max[e] = -INFINITY;
#pragma unroll
      for (int q = 0; q < WARPS; ++q) cta_max[e] = fmaxf(cta_max[e], warp_row_max[q][2 * t + e]);
      total[e] = 0.0f;
#pragma unroll
      for (int q = 0; q < WARPS; ++q) {
        const float m = warp_row_max[q][2 * t + e];
        weight[e][q] = m == -INFINITY ? 0.0f : exp2_approx(m - cta_max[e]);
        total[e] += weight[e][q] * warp_row_sum[q][2 * t + e];
      }
    }
    float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int q = 0; q < WARPS; ++q) {
      const float4 v = warp_o[q][j][l];
      sum = make_float4(sum.x + weight[0][q] * v.x, sum.y + weight[1][q] * v.y, sum.z + weight[0][q] * v.z,
                        sum.w + weight[1][q] * v.w);
    }
    take(entry, sum, cta_max, total);
  }
}

// The clustered path's combine (SM90+): each CTA combines its warps (combine_warps_heads_n) into its shared memory;
// after a release / acquire cluster barrier rank r's first ENTRIES / CLUSTER threads each take one of the entries
// [r, r + 1) x ENTRIES / CLUSTER, read every rank's sum and (max, total) through distributed shared memory in rank
// order (deterministic), weigh them by 2^(m_q - M) as the warps were (a rank that saw nothing weighs 0) and write
// it. A second barrier keeps every CTA's shared memory alive until all have read it, so every thread of every CTA
// reaches both. Shared memory: 16 bytes an entry (4 KiB at D = 128) + stats, beside the warps'.
template <int DT, int D, int WARPS, int CLUSTER>
__device__ __forceinline__ void combine_cluster_and_write_heads_n(const float (&o)[D / 16][4],
                                                                  const float (&row_max)[2],
                                                                  const float (&row_sum)[2], const HeadsNOutput& w,
                                                                  int rank) {
  constexpr int ENTRIES = D / 16 * 32, RANK_ENTRIES = ENTRIES / CLUSTER;
  static_assert(ENTRIES % CLUSTER == 0 && RANK_ENTRIES <= 32 * WARPS, "a rank's entries: one a thread");
  __shared__ float4 cta_o[ENTRIES];
  __shared__ float cta_stats[2][8];  // per head of the group: the CTA's max (log2 units), its total
  combine_warps_heads_n<D, WARPS>(o, row_max, row_sum, [&](int entry, const float4& sum, const float (&cta_max)[2],
                                                           const float (&total)[2]) {
    cta_o[entry] = sum;
    if (entry < 4) {  // lane l = entry of m-tile 0: heads 2l, 2l + 1
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        cta_stats[0][2 * entry + e] = cta_max[e];
        cta_stats[1][2 * entry + e] = total[e];
      }
    }
  });
  cluster_barrier<true>();
  if (threadIdx.x < RANK_ENTRIES) {
    const int entry = rank * RANK_ENTRIES + threadIdx.x, t = entry & 3;
    float weight[2][CLUSTER], cluster_max[2], total[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float rank_max[CLUSTER], rank_total[CLUSTER];
      cluster_max[e] = -INFINITY;
#pragma unroll
      for (int q = 0; q < CLUSTER; ++q) {
        rank_max[q] = cluster_load(cluster_address(&cta_stats[0][2 * t + e], q));
        rank_total[q] = cluster_load(cluster_address(&cta_stats[1][2 * t + e], q));
        cluster_max[e] = fmaxf(cluster_max[e], rank_max[q]);
      }
      total[e] = 0.0f;
#pragma unroll
      for (int q = 0; q < CLUSTER; ++q) {
        weight[e][q] = rank_max[q] == -INFINITY ? 0.0f : exp2_approx(rank_max[q] - cluster_max[e]);
        total[e] += weight[e][q] * rank_total[q];
      }
    }
    float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int q = 0; q < CLUSTER; ++q) {
      const float4 v = cluster_load4(cluster_address(&cta_o[entry], q));
      sum = make_float4(sum.x + weight[0][q] * v.x, sum.y + weight[1][q] * v.y, sum.z + weight[0][q] * v.z,
                        sum.w + weight[1][q] * v.w);
    }
    write_heads_n_entry<DT, D>(w, entry, sum, cluster_max, total);
  }
  cluster_barrier<false>();
}

// WARPS: 1 on the split path, COMBINED_WARPS on the combined, clustered and combined_split paths
// (kernels/paged_attention.py); the arguments are paged_decode_kernel's. Grid (num_kv_heads, num_seqs, splits), or
// (CLUSTER > 1, the clustered path, SM90+) (num_kv_heads, num_seqs, CLUSTER) with one thread-block cluster a
// (KV head, sequence): its CLUSTER x WARPS warps take the tiles round robin, no split, no partials.
template <int DT, int D, int KVQ, int WARPS, int CLUSTER = 1>
__global__ void __launch_bounds__(32 * WARPS, WARPS > 1 ? 1 : 0) paged_decode_heads_n_kernel(
    const u16* __restrict__ query, const void* __restrict__ key_cache, const void* __restrict__ value_cache,
    const u16* __restrict__ key_scales, const u16* __restrict__ value_scales, const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens, u16* __restrict__ out, float* __restrict__ part_out,
    float* __restrict__ part_stats, int num_heads, int num_kv_heads, int log2_block_size, int max_blocks,
    int tokens_per_split, float scale, float softcap, int window, int fresh_tokens) {
  launch_dependents();
  using S = HeadsNSlices<D, KVQ>;
  constexpr int MT = KVQ ? 0 : DT;  // the mma's operand type
  const int warp = WARPS == 1 ? 0 : threadIdx.x >> 5, lane = threadIdx.x - 32 * warp, g = lane >> 2, t = lane & 3;
  const int group = num_heads / num_kv_heads;  // <= 8
  const int kv_head = blockIdx.x, seq = blockIdx.y;
  // clustered: grid.z is the cluster (dims (1, 1, CLUSTER)), so a CTA's rank in it is blockIdx.z
  const int rank = CLUSTER > 1 ? blockIdx.z : 0, split = CLUSTER > 1 ? 0 : blockIdx.z;
  const int splits = CLUSTER > 1 ? 1 : gridDim.z;
  const DecodeKeys keys = decode_keys<KVQ>(key_cache, value_cache, key_scales, value_scales, block_tables, seq_lens,
                                           seq, kv_head, split, num_kv_heads, log2_block_size, max_blocks,
                                           tokens_per_split, window, g, t);
  const int seq_len = keys.seq_len, begin = keys.begin, end = keys.ctx.end;
  const TileContext& ctx = keys.ctx;
  const float score_scale = scale * ctx.key_head_scale * (softcap > 0.0f ? 1.0f : LOG2_E);
  const float inv_softcap = softcap > 0.0f ? 1.0f / softcap : 0.0f;

  float o[S::MTILES][4];
#pragma unroll
  for (int j = 0; j < S::MTILES; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};

  // Tiles start at multiples of 16 tokens (keys before `begin` masked); warp w walks tiles w, w + WARPS, ...
  // (clustered: the cluster's warps, rank after rank). As in paged_decode_kernel, a first tile older than the
  // sequence's `fresh_tokens` newest positions is fetched before waiting for the kernel just before this one; the
  // query and everything else wait.
  const int first = (begin & ~15) + S::TILE * (rank * WARPS + warp), stride = S::TILE * WARPS * CLUSTER;
  const bool settled_first_tile = first + S::TILE - 1 < seq_len - fresh_tokens;
  HeadsNTile<D, KVQ> a = {}, b = {};
  fetch_heads_n_blocks<D, KVQ>(a, first, begin, ctx);  // block tables: the step's inputs, no kernel's output
  if (!settled_first_tile) wait_for_prior_grids();
  fetch_heads_n_tile<D, KVQ>(a, first, begin, ctx);
  fetch_heads_n_blocks<D, KVQ>(b, first + stride, begin, ctx);
  if (settled_first_tile) wait_for_prior_grids();
  // Q^T of head g (zero past the group), at K's d (codes: words 8c .. 8c + 7 are d = 64c + 16t .. + 15; 16-bit
  // rows: words 4c .. 4c + 3 are d = 32c + 8t .. + 7)
  u32 q[2 * S::KSTEPS];
  {
    const bool live = g < group;
    const u16* row = query + ((i64)seq * num_heads + kv_head * group + (live ? g : 0)) * D;
#pragma unroll
    for (int i = 0; i < D / 32; ++i) {  // 8 elements a load
      const int d = KVQ ? 64 * (i >> 1) + 16 * t + 8 * (i & 1) : 32 * i + 8 * t;
      const uint4 v = live ? __ldg(reinterpret_cast<const uint4*>(row + d)) : make_uint4(0, 0, 0, 0);
      q[4 * i] = KVQ ? halves_of<DT>(v.x) : v.x; q[4 * i + 1] = KVQ ? halves_of<DT>(v.y) : v.y;
      q[4 * i + 2] = KVQ ? halves_of<DT>(v.z) : v.z; q[4 * i + 3] = KVQ ? halves_of<DT>(v.w) : v.w;
    }
  }
  // int8: the K codes' bias in the scores of heads 2t, 2t + 1, as the mma sums it (c0, c1 of bias x Q^T)
  float key_bias[2] = {0.0f, 0.0f};
  if constexpr (KVQ == 1) {
    float bias[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int w = 0; w < S::KSTEPS; ++w)
      Num<0>::mma(bias, CODE_BIAS_PAIR, CODE_BIAS_PAIR, CODE_BIAS_PAIR, CODE_BIAS_PAIR, q[2 * w], q[2 * w + 1]);
    key_bias[0] = bias[0];
    key_bias[1] = bias[1];
  }
  // a tile's rows are loaded a tile ahead of its math, its blocks two tiles ahead
  for (int tile = first; tile < end; tile += 2 * stride) {
    fetch_heads_n_tile<D, KVQ>(b, tile + stride, begin, ctx);
    fetch_heads_n_blocks<D, KVQ>(a, tile + 2 * stride, begin, ctx);
    attend_heads_n_tile<MT>(a, tile, begin, ctx, q, key_bias, score_scale, softcap, inv_softcap, o, row_max,
                            row_sum);
    if (tile + stride >= end) break;
    fetch_heads_n_tile<D, KVQ>(a, tile + 2 * stride, begin, ctx);
    fetch_heads_n_blocks<D, KVQ>(b, tile + 3 * stride, begin, ctx);
    attend_heads_n_tile<MT>(b, tile + stride, begin, ctx, q, key_bias, score_scale, softcap, inv_softcap, o,
                            row_max, row_sum);
  }

#pragma unroll
  for (int e = 0; e < 2; ++e) {  // the head's sum over its 8 threads (they share its running max)
    row_sum[e] += __shfl_xor_sync(0xFFFFFFFFu, row_sum[e], 4);
    row_sum[e] += __shfl_xor_sync(0xFFFFFFFFu, row_sum[e], 8);
    row_sum[e] += __shfl_xor_sync(0xFFFFFFFFu, row_sum[e], 16);
  }
  const HeadsNOutput written{out, part_out, part_stats, (i64)seq * num_heads + kv_head * group, group, split,
                             splits, keys.value_head_scale};
  if constexpr (CLUSTER > 1) {
    combine_cluster_and_write_heads_n<DT, D, WARPS, CLUSTER>(o, row_max, row_sum, written, rank);
  } else if constexpr (WARPS > 1) {
    combine_warps_heads_n<D, WARPS>(o, row_max, row_sum, [&](int entry, const float4& sum, const float (&cta_max)[2],
                                                             const float (&total)[2]) {
      write_heads_n_entry<DT, D>(written, entry, sum, cta_max, total);
    });
  } else {
#pragma unroll
    for (int j = 0; j < S::MTILES; ++j)  // o[j]: rows d = VB g + 2j, + 1 of heads 2t, 2t + 1
#pragma unroll
      for (int e = 0; e < 2; ++e)
        write_heads_n_pair<DT, D>(written, 2 * t + e, S::VB * g + 2 * j, o[j][e], o[j][e + 2], row_max[e],
                                  row_sum[e], j == 0 && g == 0);
  }
}

// ---- Paged prefill attention ----------------------------------------------------------------------------------
// A prefill chunk's tokens each attend to their causal prefix of one context, so consecutive tokens read nearly the
// same K/V. paged_decode_kernel, run with every token as a sequence of its own (a graphed step), reads a chunk's
// context once per token; this kernel reads it once per tile of PREFILL_WARPS * (16 / G) tokens (G = query heads a KV
// head): one CTA per (KV head, tile), whose warps each own 16 mma rows, 16 / G tokens x G heads, and walk the keys
// in 16-key tiles that the CTA copies into shared memory PREFILL_STAGES - 1 tiles ahead (cp.async). Each warp runs
// attend_tile on its rows with their own causal bounds (ROW_BOUNDS), reading the staged rows chunk by chunk
// (SHARED), so few registers stay live and several CTAs share an SM: the decode kernel's math, an fp32 online
// softmax over 16-key tiles in order on mma.sync m16n8k16.
// `tiles` [num_tiles, 2] = (first token row, token count): consecutive tokens of one sequence at consecutive
// positions, which share the first token's block table row; count 0 = no work (a graph's grid is fixed).
// Few tiles over long contexts would leave most SMs idle while each CTA walks its keys one tile after another, so
// the keys may be cut into splits of tokens_per_split (grid.z, a multiple of 16): each CTA then writes its rows'
// partials and paged_prefill_reduce_kernel combines them, as paged_reduce_kernel does the decode kernel's.
// KV (the KVQ template parameter, as the decode kernel's): fp16/bf16 rows are copied into the stages the warps read.
// int8 and e4m3 codes are copied into stages of their own (half the bytes), and each thread converts the pieces it
// copied, once for the CTA's 4 warps, to DT values (code x scale, rounded once) in a 16-bit stage: the warps then run
// the 16-bit tile step unchanged. D = 64 or 128.
// 4 warps: 128 registers a thread, so 4 CTAs (16 warps) share an SM, and twice the CTAs of 8-warp tiles for short
// chunks (a 256-token prompt of Qwen2.5-3B: 64 CTAs a layer).
constexpr int PREFILL_WARPS = 4;
constexpr int PREFILL_STAGES = 4;
constexpr int PREFILL_PAD = 8;  // elements after each shared row: rows 16 bytes apart in the banks

template <int D>
struct PrefillStage {  // one 16-key tile of K and V rows
  u16 k[16][D + PREFILL_PAD];
  u16 v[16][D + PREFILL_PAD];
};

// One 16-key tile of int8 or e4m3 codes, as copied: each thread reads back only the pieces it copied, so the rows
// need no padding.
template <int D>
struct PrefillCodeStage {
  unsigned char k[16][D];
  unsigned char v[16][D];
};

// Which pieces of a staged tile a thread copies: pieces tid + k * THREADS of each of K and V (ROWS of them, row
// (tid + k * THREADS) / PIECES), the same rows for K and V. A piece is 16 bytes, or 8 where a tile's rows of K
// (16 x 64 codes) would not give every thread one of 16.
template <int D, int ELEMENT_BYTES>
struct PrefillStaging {
  static constexpr int THREADS = 32 * PREFILL_WARPS, ROW_BYTES = D * ELEMENT_BYTES;
  static constexpr int PIECE_BYTES = 16 * ROW_BYTES >= 16 * THREADS ? 16 : 8;
  static constexpr int PIECE = PIECE_BYTES / ELEMENT_BYTES;  // elements a piece
  static constexpr int PIECES = ROW_BYTES / PIECE_BYTES, ROWS = 16 * PIECES / THREADS;
  static_assert(ROWS >= 1 && 16 * PIECES % THREADS == 0, "a CTA copies whole tiles, every thread the same count");
  static __device__ __forceinline__ int row(int k) { return (threadIdx.x + k * THREADS) / PIECES; }
  static __device__ __forceinline__ int column(int k) { return PIECE * (threadIdx.x % PIECES); }
};

// The blocks holding this thread's staged rows of the key tile at `tile` (0 past `end`: those rows are zero-filled).
template <typename S>
__device__ __forceinline__ void staged_blocks(int (&blocks)[S::ROWS], int tile, int end, const TileContext& ctx) {
#pragma unroll
  for (int k = 0; k < S::ROWS; ++k) {
    const int tok = tile + S::row(k);
    blocks[k] = tok < end ? __ldcg(ctx.table + (tok >> ctx.log2_block_size)) : 0;
  }
}

// cp.async of BYTES (8 or 16), zero-filled where !valid
template <int BYTES>
__device__ __forceinline__ void cp_async_piece(void* shared, const void* global, bool valid) {
  if constexpr (BYTES == 16) {
    cp_async16(shared, global, valid);
  } else {
    const u32 address = (u32)__cvta_generic_to_shared(shared);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(address), "l"(global), "r"(valid ? 8 : 0)
                 : "memory");
  }
}

// The row of [num_blocks * KVH * block_size] that holds token `tok` (in `block`) of the CTA's KV head
__device__ __forceinline__ i64 cache_row(int block, int tok, const TileContext& ctx) {
  const int block_size = 1 << ctx.log2_block_size;
  return ((i64)block * ctx.num_kv_heads + ctx.kv_head) * block_size + (tok & (block_size - 1));
}

// The CTA copies keys [tile, tile + 16) of K and V into `stage` (a PrefillStage of 16-bit rows or a PrefillCodeStage);
// rows at or past `end` are zero-filled.
template <typename S, int D, typename Element, typename Stage>
__device__ __forceinline__ void stage_keys(Stage& stage, int tile, int end, const int (&blocks)[S::ROWS],
                                           const TileContext& ctx) {
#pragma unroll
  for (int k = 0; k < S::ROWS; ++k) {
    const int row = S::row(k), column = S::column(k), tok = tile + row;
    const i64 at = cache_row(blocks[k], tok, ctx) * D + column;
    cp_async_piece<S::PIECE_BYTES>(stage.k[row] + column, reinterpret_cast<const Element*>(ctx.key_cache) + at,
                                   tok < end);
    cp_async_piece<S::PIECE_BYTES>(stage.v[row] + column, reinterpret_cast<const Element*>(ctx.value_cache) + at,
                                   tok < end);
  }
}

// N (8 or 16) codes at `codes` (shared) times `scale` -> N DT values at `out` (shared): codes_to_halves (exact values;
// before SM89 e4m3's 2^-8 x, which FP8_PAIR_SCALE in the scale undoes), each product in fp32, rounded once.
template <int DT, int KVQ, int N>
__device__ __forceinline__ void dequantize_piece(const unsigned char* codes, u16* out, float scale) {
  u32 w[N / 4], packed[N / 2];
  if constexpr (N == 16) {
    const uint4 v = *reinterpret_cast<const uint4*>(codes);
    w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
  } else {
    const uint2 v = *reinterpret_cast<const uint2*>(codes);
    w[0] = v.x; w[1] = v.y;
  }
#pragma unroll
  for (int i = 0; i < N / 4; ++i) {
    u32 pair[2];
    codes_to_halves<KVQ>(w[i], pair[0], pair[1]);
#pragma unroll
    for (int p = 0; p < 2; ++p)
      packed[2 * i + p] = Num<DT>::pack(half_bits_to_float((u16)(pair[p] & 0xFFFFu)) * scale,
                                        half_bits_to_float((u16)(pair[p] >> 16)) * scale);
  }
#pragma unroll
  for (int q = 0; q < N / 8; ++q)
    reinterpret_cast<uint4*>(out)[q] =
        make_uint4(packed[4 * q], packed[4 * q + 1], packed[4 * q + 2], packed[4 * q + 3]);
}

template <int DT, int D, int KVQ = 0>
__global__ void __launch_bounds__(32 * PREFILL_WARPS) paged_prefill_kernel(
    const u16* __restrict__ query,        // [T, H, D]
    const void* __restrict__ key_cache,   // [NB, KVH, BS, D]
    const void* __restrict__ value_cache, // [NB, KVH, BS, D]
    const u16* __restrict__ key_scales,   // int8: [NB, KVH, BS] fp16; e4m3: [KVH] fp32
    const u16* __restrict__ value_scales, // int8: [NB, KVH, BS] fp16; e4m3: [KVH] fp32
    const int* __restrict__ block_tables, // [T, max_blocks]: each token's sequence's table
    const int* __restrict__ seq_lens,     // [T]: each token's context length (its position + 1)
    const int* __restrict__ tiles,        // [num_tiles, 2]: first token, token count
    u16* __restrict__ out,                // [T, H, D]: the tiles' tokens' rows are written (one split)
    float* __restrict__ part_out,         // [T, H, splits, D] (several splits)
    float* __restrict__ part_stats,       // [T, H, splits, 2]: running max, sum of exp
    int num_heads, int num_kv_heads, int log2_block_size, int max_blocks, int tokens_per_split, float scale,
    float softcap, int window) {
  launch_dependents();
  static_assert(D == 64 || D == 128, "the prefill kernel takes head_dim 64 or 128");
  constexpr int CHUNKS = D / 32;
  constexpr bool CODES = KVQ != 0;
  using S = PrefillStaging<D, CODES ? 1 : 2>;  // the copies'
  using CodeS = PrefillStaging<D, 1>;
  // the 16-bit tiles the warps read: the copies' ring, or (codes) two, converted one tile at a time
  __shared__ __align__(16) PrefillStage<D> stages[CODES ? 2 : PREFILL_STAGES];
  __shared__ __align__(16) PrefillCodeStage<D> code_stages[CODES ? PREFILL_STAGES : 1];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int kv_head = blockIdx.x;
  wait_for_prior_grids();  // the query and the step's K/V are the layer's writes
  const int first = __ldcg(tiles + 2 * blockIdx.y), count = __ldcg(tiles + 2 * blockIdx.y + 1);
  if (count <= 0) return;
  const int group = num_heads / num_kv_heads, per_warp = 16 / group, split = blockIdx.z, splits = gridDim.z;
  // This split's keys of the tile's contexts: the last token sees the longest, the first the earliest (window).
  const int end = min(__ldcg(seq_lens + first + count - 1), (split + 1) * tokens_per_split);
  const int begin = max(window > 0 ? max(0, __ldcg(seq_lens + first) - window) & ~15 : 0, split * tokens_per_split);
  const TileContext ctx{key_cache, value_cache, nullptr, nullptr, block_tables + (i64)first * max_blocks,
                        log2_block_size, num_kv_heads, kv_head, end, g, t};
  // e4m3: the KV head's scales (with FP8_PAIR_SCALE: what codes_to_halves leaves out)
  const float key_head_scale = KVQ == 2 ? reinterpret_cast<const float*>(key_scales)[kv_head] * FP8_PAIR_SCALE : 1.0f;
  const float value_head_scale =
      KVQ == 2 ? reinterpret_cast<const float*>(value_scales)[kv_head] * FP8_PAIR_SCALE : 1.0f;

  // This warp's tokens [first + warp_first, + warp_count); mma row g + 8r is token (g + 8r) / G, head (g + 8r) % G.
  const int warp_first = warp * per_warp, warp_count = max(0, min(count - warp_first, per_warp));
  const u16* qrows[2];
  bool qvalid[2];
  int row_begin[2], row_end[2];
  i64 out_row[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r, local = row / group;
    qvalid[r] = local < warp_count;
    const int token = first + warp_first + (qvalid[r] ? local : 0);
    out_row[r] = (i64)token * num_heads + kv_head * group + (qvalid[r] ? row % group : 0);
    qrows[r] = query + out_row[r] * D + 8 * t;
    row_end[r] = qvalid[r] ? __ldcg(seq_lens + token) : 0;
    row_begin[r] = window > 0 ? max(0, row_end[r] - window) : 0;
  }
  const int warp_end = warp_count > 0 ? __ldcg(seq_lens + first + warp_first + warp_count - 1) : 0;
  const int warp_begin = window > 0 && warp_count > 0 ? max(0, __ldcg(seq_lens + first + warp_first) - window) : 0;

  // The staged rows attend_tile reads: K rows 8 * nt + g and V rows 2t + (e & 1) + 8 * (e >> 1) of a stage, all
  // valid (rows past `end` hold zeros, and the row bounds mask their scores).
  Tile<DT, D, 0> T;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    T.krow[nt] = (8 * nt + g) * (D + PREFILL_PAD);
    T.kvalid[nt] = true;
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    T.vrow[e] = (2 * t + (e & 1) + 8 * (e >> 1)) * (D + PREFILL_PAD);
    T.vvalid[e] = true;
  }

  float o[CHUNKS][4][4];
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
    for (int j = 0; j < 4; ++j) o[c][j][0] = o[c][j][1] = o[c][j][2] = o[c][j][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};

  // Tile i sits in stage i % STAGES. Before tile i's math the CTA has committed one copy group per tile up to
  // i + STAGES - 2, so waiting until at most STAGES - 2 are in flight leaves tile i landed; the barrier then makes
  // it visible and tells that every warp is done with tile i - 1, whose stage takes tile i + STAGES - 1. A thread's
  // block ids for its staged rows are loaded a tile before their copies are issued, so the copies never wait on them.
  // Codes: tile i's codes sit in code stage i % STAGES; each thread converts its own pieces of them into 16-bit stage
  // i % 2 before the barrier (its own copies have landed, and every warp finished tile i - 2 before the previous
  // barrier), which then makes the converted tile visible. int8: the thread's rows' K and V scales (fp16 bits, 0 past
  // `end`) are loaded with their copies, STAGES - 1 tiles ahead of their use (row_scales[0]: tile i's).
  int blocks[S::ROWS];
  u32 row_scales[PREFILL_STAGES - 1][CodeS::ROWS];  // int8: K scale | V scale << 16 per staged row
  auto stage = [&](int slot, int tile) {
    if constexpr (CODES) {
      stage_keys<S, D, unsigned char>(code_stages[slot], tile, end, blocks, ctx);
    } else {
      stage_keys<S, D, u16>(stages[slot], tile, end, blocks, ctx);
    }
  };
  auto load_scales = [&](u32 (&into)[CodeS::ROWS], int tile) {
    if constexpr (KVQ == 1) {
#pragma unroll
      for (int k = 0; k < CodeS::ROWS; ++k) {
        const int tok = tile + CodeS::row(k);
        const i64 at = cache_row(blocks[k], tok, ctx);
        into[k] = tok < end ? (u32)__ldcg(key_scales + at) | ((u32)__ldcg(value_scales + at) << 16) : 0u;
      }
    }
  };
#pragma unroll
  for (int s = 0; s < PREFILL_STAGES - 1; ++s) {
    const int tile = begin + 16 * s;
    if (tile < end) {
      staged_blocks<S>(blocks, tile, end, ctx);
      stage(s, tile);
      load_scales(row_scales[s], tile);
    }
    cp_async_commit();
  }
  staged_blocks<S>(blocks, begin + 16 * (PREFILL_STAGES - 1), end, ctx);
  for (int i = 0, tile = begin; tile < end; ++i, tile += 16) {
    cp_async_wait<PREFILL_STAGES - 2>();
    if constexpr (CODES) {  // this thread's pieces of tile i, converted
#pragma unroll
      for (int k = 0; k < CodeS::ROWS; ++k) {
        const int row = CodeS::row(k), column = CodeS::column(k);
        const float key_scale = KVQ == 1 ? half_bits_to_float((u16)(row_scales[0][k] & 0xFFFFu)) : key_head_scale;
        const float value_scale = KVQ == 1 ? half_bits_to_float((u16)(row_scales[0][k] >> 16)) : value_head_scale;
        const PrefillCodeStage<D>& codes = code_stages[i % PREFILL_STAGES];
        dequantize_piece<DT, KVQ, CodeS::PIECE>(codes.k[row] + column, stages[i % 2].k[row] + column, key_scale);
        dequantize_piece<DT, KVQ, CodeS::PIECE>(codes.v[row] + column, stages[i % 2].v[row] + column, value_scale);
      }
    }
    __syncthreads();
    const int ahead = tile + 16 * (PREFILL_STAGES - 1);
    if constexpr (KVQ == 1) {
#pragma unroll
      for (int s = 0; s < PREFILL_STAGES - 2; ++s)
#pragma unroll
        for (int k = 0; k < CodeS::ROWS; ++k) row_scales[s][k] = row_scales[s + 1][k];
    }
    if (ahead < end) {
      stage((i + PREFILL_STAGES - 1) % PREFILL_STAGES, ahead);
      load_scales(row_scales[PREFILL_STAGES - 2], ahead);
    }
    cp_async_commit();
    staged_blocks<S>(blocks, ahead + 16, end, ctx);
    if (tile < warp_end && tile + 16 > warp_begin) {
      const PrefillStage<D>& staged_tile = stages[CODES ? i % 2 : i % PREFILL_STAGES];
      const TileContext staged{staged_tile.k, staged_tile.v, nullptr, nullptr, nullptr, 0, 0, 0, end, g, t};
      attend_tile<DT, D, 0, true, true>(T, tile, staged, qrows, qvalid, scale, softcap, o, row_max, row_sum,
                                           row_begin, row_end);
    }
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += __shfl_xor_sync(0xFFFFFFFFu, row_sum[r], 1);
    row_sum[r] += __shfl_xor_sync(0xFFFFFFFFu, row_sum[r], 2);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (!qvalid[r]) continue;
    if (splits > 1) {  // a split with none of the row's keys writes max -inf: the reduce weighs it 0
      write_partial<D>(part_out, part_stats, out_row[r] * splits + split, o, r, row_max[r], row_sum[r], t);
      continue;
    }
    const float inv = row_sum[r] > 0.0f ? 1.0f / row_sum[r] : 0.0f;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
      *reinterpret_cast<uint4*>(out + out_row[r] * D + 32 * c + 8 * t) = output_piece<DT>(o[c], r, inv);
  }
}

// Combine the splits of each (sequence, head): out = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s.
// grid (num_heads, num_seqs), block 128 threads: first a split per thread (the max M, each split's weight
// e^(m_s - M) into shared memory, the total), then a dimension per thread, summing the splits in order with
// independent loads (a loop with one dependent L2 round trip per split would pay that latency once a split). With up to
// REDUCE_HELD_SPLITS splits and head_dim <= 128 (one dimension a thread) a thread's partials are all loaded
// right after the PDL wait, with the stats, so the kernel waits on L2 once instead of once for the stats and
// again per batch of partials (a one-stream decode step at a 1024-token bound has 32 splits).
constexpr int REDUCE_HELD_SPLITS = 64;  // kernels/paged_attention.py names it too

// Combines the splits of partials row `base` ((row, head) of [rows, H]) into out[base]; the block's 128 threads
// take part, with `split_weight` dynamic shared memory of 4 * splits bytes.
template <int DT>
__device__ __forceinline__ void reduce_splits_of_row(const float* __restrict__ part_out,
                                                     const float* __restrict__ part_stats, u16* __restrict__ out,
                                                     i64 base, int splits, int head_dim) {
  extern __shared__ float split_weight[];  // [splits]: e^(m_s - M), 0 for a split past the sequence's end
  __shared__ float warp_value[4];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float* stats = part_stats + base * splits * 2;
  const float* parts = part_out + base * splits * head_dim;
  const bool held = splits <= REDUCE_HELD_SPLITS && head_dim <= 128;
  float held_parts[REDUCE_HELD_SPLITS];  // this thread's dimension tid of each split (when held)
  if (held && tid < head_dim) {
#pragma unroll
    for (int s = 0; s < REDUCE_HELD_SPLITS; ++s) held_parts[s] = s < splits ? parts[(i64)s * head_dim + tid] : 0.0f;
  }

  float global_max = -INFINITY;
  for (int s = tid; s < splits; s += 128) global_max = fmaxf(global_max, stats[2 * s]);
  global_max = warp_max(global_max);
  if (lane == 0) warp_value[warp] = global_max;
  __syncthreads();
  global_max = fmaxf(fmaxf(warp_value[0], warp_value[1]), fmaxf(warp_value[2], warp_value[3]));
  __syncthreads();  // warp_value is reused below

  float total = 0.0f;
  for (int s = tid; s < splits; s += 128) {
    const float m = stats[2 * s];
    const float weight = m == -INFINITY ? 0.0f : __expf(m - global_max);
    split_weight[s] = weight;
    total += weight * stats[2 * s + 1];
  }
  total = warp_sum(total);
  if (lane == 0) warp_value[warp] = total;
  __syncthreads();
  total = (warp_value[0] + warp_value[1]) + (warp_value[2] + warp_value[3]);
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;

  if (held) {
    if (tid < head_dim) {
      float acc = 0.0f;
#pragma unroll
      for (int s = 0; s < REDUCE_HELD_SPLITS; ++s) {
        if (s >= splits) break;
        const float weight = split_weight[s];
        acc += weight != 0.0f ? weight * held_parts[s] : 0.0f;  // an empty split's partial is never written
      }
      out[base * head_dim + tid] = Num<DT>::from_float(acc * inv);
    }
    return;
  }
  for (int d = tid; d < head_dim; d += 128) {
    float acc = 0.0f;
#pragma unroll 8
    for (int s = 0; s < splits; ++s) {
      const float weight = split_weight[s];
      const float value = parts[(i64)s * head_dim + d];  // an empty split's partial is never written: select
      acc += weight != 0.0f ? weight * value : 0.0f;
    }
    out[base * head_dim + d] = Num<DT>::from_float(acc * inv);
  }
}

template <int DT>
__global__ void __launch_bounds__(128) paged_reduce_kernel(
    const float* __restrict__ part_out,    // [B, H, splits, D]
    const float* __restrict__ part_stats,  // [B, H, splits, 2]
    u16* __restrict__ out,                 // [B, H, D]
    int num_heads, int splits, int head_dim) {
  launch_dependents();
  wait_for_prior_grids();
  reduce_splits_of_row<DT>(part_out, part_stats, out, (i64)blockIdx.y * num_heads + blockIdx.x, splits, head_dim);
}

// paged_prefill_kernel's splits, for the tiles' tokens only (the decode kernel wrote the other rows): grid
// (num_heads, num_tiles * tile_tokens), block 128; y = (tile, token of the tile), past a tile's count nothing.
template <int DT>
__global__ void __launch_bounds__(128) paged_prefill_reduce_kernel(
    const float* __restrict__ part_out,    // [T, H, splits, D]
    const float* __restrict__ part_stats,  // [T, H, splits, 2]
    const int* __restrict__ tiles,         // [num_tiles, 2]: first token, token count
    u16* __restrict__ out,                 // [T, H, D]
    int num_heads, int splits, int head_dim, int tile_tokens) {
  launch_dependents();
  wait_for_prior_grids();
  const int tile = blockIdx.y / tile_tokens, index = blockIdx.y % tile_tokens;
  if (index >= __ldcg(tiles + 2 * tile + 1)) return;
  const i64 token = __ldcg(tiles + 2 * tile) + index;
  reduce_splits_of_row<DT>(part_out, part_stats, out, token * num_heads + blockIdx.x, splits, head_dim);
}
