// W4A16 product for 33-128 tokens over the fragment layout (kernels/w4_fragment_gemm.py: fragment_layout, the same
// weight form the few-token kernel w4_fragment_gemm.cu reads): out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]),
// W = (q - z) * s with integer zero points, mma.sync m16n8k16 (SM80+).
//
// Tile. A CTA of WN x WK = 4 x 2 warps owns ROWS = 16 RT WN = 128 rows and TOKENS = 8 TT = 64 tokens of the output
// and walks K in stages of BK = 64 APW WK = 256 k. Warp (wn, wk) multiplies its RT = 2 row tiles by the 2 atoms
// (128 k) wk of each stage, for all 64 tokens: each weight fragment is unpacked once and feeds TT = 8 mma, each
// ldmatrix.x4 of activations (two k16 steps of 8 tokens) feeds 2 RT = 4 mma. Unpacking is that of the few-token
// kernel (w4_fragment.cuh: one LOP3 a pair with the magic exponent, one add of the zero pair), so the tensor cores
// see (q - z) exactly; the group's fp16 scale multiplies each group's fp32 sums (`part`) into the accumulators
// (`acc`), 4 FFMA a token tile a group (at G = 128 a group is exactly a warp's atoms of a stage).
// The wide tile (WN x WK = 8 x 1, APW = 4, wgmma: kernels/w4_fragment_batch.py WIDE_WGMMA_CONFIG) owns 256 rows: two
// warpgroups side by side along N, each warp all 4 atoms of a 256-k stage, so a stage's 32 KiB of activations serve
// 32 KiB of weights (the 128-row tile's serve 16) and no K halves meet in the epilogue.
//
// Pipeline. Weights, scale entries and activations of a stage are one cp.async group of every thread in a ring of
// STAGES slots, a block barrier a stage; the first stages' weights and scales are fetched before the
// programmatic-launch wait (no earlier kernel writes them). The ring runs on across output tiles: a stage's copies
// are those of the (tile, k block) the CTA reaches STAGES - 1 iterations ahead, so the copies of the next tile are in
// flight while one tile finishes.
//
// Work split (stream-K). The work is tiles x k blocks iterations, tile-major, token blocks of one row block
// adjacent (they read the same weights, so the second read is an L2 hit); CTA c of the grid's P takes iterations
// [c T / P, (c + 1) T / P), so every CTA gets the same number of k blocks and no wave has a tail. A tile the CTA
// covers whole is written directly; a partly covered one leaves its fp32 sums in partials[c][slot] (slot 0: the
// CTA's first tile, 1: its last; a CTA's tiles between are whole), and the last of the tile's CTAs to arrive (an
// acquire-release counter) adds every part in CTA order, i.e. k order, so the bits do not depend on which CTA
// finished last.
//
// Epilogue. The two K halves of a tile (warps wk = 0, 1; WK = 2) are added in shared memory, in the ring slot the
// tile's last stage has just been read from (free until the next iteration's barrier), then bias, and the write in DT.
#include "w4_fragment.cuh"
#include "wgmma.cuh"

// The stage layout: FragTile's; with WGMMA the activations as BK / 64 blocks of TOKENS rows x 128 bytes (64 k) in
// the 128-byte swizzle (chunk c of row r at c ^ (r % 8)) that the wgmma descriptor reads, each block 1024-byte
// aligned (FragCopies steps its 8-row blocks by 8 X_ROW).
template <int RT, int TT, int WN, int WK, int APW, int GS, bool WGMMA>
struct BatchTile : FragTile<RT, TT, WN, WK, APW, GS> {};

template <int RT, int TT, int WN, int WK, int APW, int GS>
struct BatchTile<RT, TT, WN, WK, APW, GS, true> : FragTile<RT, TT, WN, WK, APW, GS> {
  using Base = FragTile<RT, TT, WN, WK, APW, GS>;
  static constexpr int X_ROW = 128;
  static constexpr int X_BLOCK = Base::TOKENS * 128;
  static_assert(Base::X_OFFSET % 1024 == 0 && Base::STAGE_BYTES % 1024 == 0, "1024-byte aligned blocks");
  static __device__ __forceinline__ int x_offset(int row, int chunk) {
    return Base::X_OFFSET + (chunk >> 3) * X_BLOCK + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
  }
};

template <int DT, int RT, int TT, int WN, int WK, int APW, int GS, int STAGES, bool WGMMA>
__global__ void __launch_bounds__(32 * WN * WK, 1) w4_fragment_batch_kernel(
    const u16* __restrict__ x,       // [M, K] activations, DT
    const uint4* __restrict__ frag,  // [N_tiles, K_atoms, 32] fragment words
    const uint2* __restrict__ sz,    // [N_tiles, num_groups, 8] (fp16 scale pair, DT zero pair)
    const u16* __restrict__ bias,    // [N] DT, or null
    u16* __restrict__ out,           // [M, N] DT
    float* __restrict__ partials,    // [P, 2, TOKENS * ROWS] fp32: the parts of tiles shared by CTAs
    u32* __restrict__ counters,      // [tiles], zero between launches
    int M, int N, int K, int group_shift, int num_groups) {
  using L = BatchTile<RT, TT, WN, WK, APW, GS, WGMMA>;
  static_assert(WK == 1 || WK == 2, "the epilogue adds at most two K halves");
  static_assert(WK == 1 || L::TOKENS * L::ROWS * 4 <= L::STAGE_BYTES, "a ring slot holds a tile's K half");
  static_assert(!WGMMA || L::THREADS == L::BK, "one pass of the CTA's activation copies a stage");
  constexpr int OUTS = L::TOKENS * L::ROWS;
  constexpr int HALF_THREADS = 32 * WN;  // the warps of K half 0 (every warp when WK = 1), which write the outputs
  extern __shared__ __align__(1024) unsigned char smem[];
  __shared__ int last_flag;
  launch_dependents();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wn = warp % WN, wk = warp / WN, g = lane >> 2, t = lane & 3;
  const int n_tiles = (N + 15) >> 4, k_atoms = (K + 63) >> 6;
  const int tok_blocks = (M + L::TOKENS - 1) / L::TOKENS;
  const int num_kb = (K + L::BK - 1) / L::BK;
  const long long total = (long long)((n_tiles + L::TILES - 1) / L::TILES) * tok_blocks * num_kb;
  const int ctas = gridDim.x, cta = blockIdx.x;
  const int begin = (int)(cta * total / ctas), end = (int)((cta + 1) * total / ctas);
  const int steps = end - begin;
  const StageGroups<L> groups(group_shift);

  float acc[RT][TT][4], part[RT][TT][4];

  // Tile `tile` of the iteration order: row block tile / tok_blocks, token block tile % tok_blocks.
  auto copies_of = [&](int tile) {
    return FragCopies<L>(frag, sz, x, (tile / tok_blocks) * L::TILES, (tile % tok_blocks) * L::TOKENS, n_tiles,
                         k_atoms, M, K, num_groups, groups.count);
  };
  // The producer's position: the (tile, k block) of the last stage it issued, stepped without a division.
  struct Position {
    int tile, kb;
  };
  auto advance = [&](Position& at, FragCopies<L>& copies) {
    if (++at.kb == num_kb) {
      at.kb = 0;
      copies = copies_of(++at.tile);
    }
  };
  const Position start{begin / num_kb, begin % num_kb};
  Position at = start;
  FragCopies<L> fill = copies_of(start.tile);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s)
    if (s < steps) {  // `at` ends on the last stage issued: the loop's first refill advances from there
      if (s > 0) advance(at, fill);
      fill.weights(smem + s * L::STAGE_BYTES, at.kb, group_shift);
    }
  wait_for_prior_grids();
  // One stage's products: the warp's RT row tiles by its APW atoms of the stage at `stage` (k offset k_stage in K),
  // each group's sums scaled into acc. tile_ends: the stage is the last of the CTA's part of its tile.
  auto multiply_stage = [&](const unsigned char* stage, int k_stage, bool tile_ends) {
    uint2 entry[RT];  // the scale entries of the current group
    if constexpr (WGMMA) {
      // The lane's fragment words of atom ai for both row tiles, loaded as the atom's first step comes (APW = 4
      // keeps 8 registers of them, not 32).
      uint4 w[RT];
      // A k16 step at a time: both row tiles' A fragments into register set s % SETS while the wgmma groups of
      // the SETS - 1 steps before run (the wait after each commit leaves SETS - 1 in flight, so the set rewritten
      // next belongs to a finished group); a group's sums are scaled into the accumulators once its groups are
      // done. Three sets, but two on the wide tile at 64 tokens (APW = 4, TT = 8), whose registers hold no more
      // (with three ptxas spilled inside the loop).
      constexpr int SETS = APW > 2 && TT > 6 ? 2 : 3;
      u32 a[SETS][RT][4];
#pragma unroll
      for (int s = 0; s < L::STEPS; ++s) {
        const int ai = s >> 2, j = s & 3;
        const int dk = (wk * APW + ai) * 64 + 16 * j;  // k offset of step s inside the stage
        if (j == 0) {
#pragma unroll
          for (int r = 0; r < RT; ++r) w[r] = L::words(stage, wn * RT + r, wk * APW + ai, lane);
        }
        if (GS == 0 ? s == 0 : s % GS == 0) {
#pragma unroll
          for (int r = 0; r < RT; ++r) entry[r] = L::entry(stage, wn * RT + r, dk >> groups.slot_shift, g);
        }
#pragma unroll
        for (int r = 0; r < RT; ++r) {
          FragDequant<DT>(entry[r].y).unpack(step_word(w[r], j), a[s % SETS][r]);
        }
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
          for (int tt = 0; tt < TT; ++tt)
#pragma unroll
            for (int e = 0; e < 4; ++e) hold(part[r][tt][e]);  // no register moves of the sums in flight
        wgmma_fence();
        const unsigned char* xb = stage + L::X_OFFSET + (dk >> 6) * L::X_BLOCK + (dk & 63) * 2;
#pragma unroll
        for (int r = 0; r < RT; ++r) wgmma_rs<DT, 8 * TT>(&part[r][0][0], a[s % SETS][r], swizzled_desc(xb));
        wgmma_commit();
        bool flush;
        if constexpr (GS > 0) {
          flush = (s + 1) % GS == 0;
        } else {
          flush = s + 1 == L::STEPS &&
                  (tile_ends || ((k_stage + L::BK) >> group_shift) != (k_stage >> group_shift));
        }
        if (flush) {
          wgmma_wait<0>();
          scale_into(acc, part, entry);
        } else {
          wgmma_wait<SETS - 1>();
#pragma unroll
          for (int r = 0; r < RT; ++r)
#pragma unroll
            for (int e = 0; e < 4; ++e) hold(a[(s + 1) % SETS][r][e]);  // step s + 1 - SETS's set: its group is done
        }
      }
      wgmma_wait<0>();
    } else {
      // Two k16 steps at a time (one ldmatrix.x4 of a token tile holds both steps' B fragments): the A
      // fragments of both steps for every row tile, then token tile by token tile, so B takes 4 registers at any TT.
      uint4 w[APW][RT];  // the lane's fragment words of the stage
#pragma unroll
      for (int ai = 0; ai < APW; ++ai)
#pragma unroll
        for (int r = 0; r < RT; ++r) w[ai][r] = L::words(stage, wn * RT + r, wk * APW + ai, lane);
#pragma unroll
      for (int s = 0; s < L::STEPS; s += 2) {
        const int ai = s >> 2;
        const int dk = (wk * APW + ai) * 64 + 16 * (s & 3);  // k offset of step s inside the stage
        if (GS == 0 ? s == 0 : s % GS == 0) {  // a new group (GS is even: groups start on even steps)
#pragma unroll
          for (int r = 0; r < RT; ++r) entry[r] = L::entry(stage, wn * RT + r, dk >> groups.slot_shift, g);
        }
        u32 a[2][RT][4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int j = (s & 3) + h;
#pragma unroll
          for (int r = 0; r < RT; ++r) {
            FragDequant<DT>(entry[r].y).unpack(step_word(w[ai][r], j), a[h][r]);
          }
        }
#pragma unroll
        for (int tt = 0; tt < TT; ++tt) {
          u32 b[4];
          L::b_fragments(b, stage, tt, dk, lane);
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int r = 0; r < RT; ++r)
              Num<DT>::mma(part[r][tt], a[h][r][0], a[h][r][1], a[h][r][2], a[h][r][3], b[2 * h], b[2 * h + 1]);
        }
        bool flush;
        if constexpr (GS > 0) {
          flush = (s + 2) % GS == 0;
        } else {  // at the stage's last steps, where the warp's next atoms lie in another group or the tile's part ends
          flush = s + 2 == L::STEPS &&
                  (tile_ends || ((k_stage + L::BK) >> group_shift) != (k_stage >> group_shift));
        }
        if (flush) scale_into(acc, part, entry);
      }
    }
  };
  // The CTA's part of tile `tile` (iterations [segment_begin, segment_end)) is done: K half 1 (if any) hands its
  // sums to half 0 through `stage`, the slot just read; a whole tile is written, a part meets the others'.
  auto finish_tile = [&](int tile, int segment_begin, int segment_end, unsigned char* stage) {
    const int tile0 = (tile / tok_blocks) * L::TILES, tok0 = (tile % tok_blocks) * L::TOKENS;
    if constexpr (WK == 2) {
      float* red = reinterpret_cast<float*>(stage);
      __syncthreads();  // every warp is done reading the slot
      if (wk == 1) {
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
          for (int tt = 0; tt < TT; ++tt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              red[((r * TT + tt) * 4 + e) * HALF_THREADS + tid - HALF_THREADS] = acc[r][tt][e];
      }
      __syncthreads();
      if (wk == 0) {
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
          for (int tt = 0; tt < TT; ++tt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[r][tt][e] += red[((r * TT + tt) * 4 + e) * HALF_THREADS + tid];
      }
    }
    const bool whole = segment_begin % num_kb == 0 && segment_end == (tile + 1) * num_kb;
    bool write = wk == 0;
    if (!whole) {
      // A part: slot 0 when this is the CTA's first tile, else 1 (its last). The tile's CTAs are those holding its
      // first and last iterations and every one between; c(i) = ((i + 1) P - 1) / T holds iteration i.
      const int first_tile = begin / num_kb;
      float* mine = partials + ((size_t)cta * 2 + (tile == first_tile ? 0 : 1)) * OUTS;
      if (wk == 0) {
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
          for (int tt = 0; tt < TT; ++tt)
#pragma unroll
            for (int e = 0; e < 4; ++e) mine[((r * TT + tt) * 4 + e) * HALF_THREADS + tid] = acc[r][tt][e];
      }
      const long long first_it = (long long)tile * num_kb, last_it = first_it + num_kb - 1;
      const int c_lo = (int)(((first_it + 1) * ctas - 1) / total), c_hi = (int)(((last_it + 1) * ctas - 1) / total);
      write = last_to_arrive(counters + tile, (u32)(c_hi - c_lo), last_flag) && write;
      if (write) {
        zero(acc);
#pragma unroll 1
        for (int c = c_lo; c <= c_hi; ++c) {
          const int c_first_tile = (int)(((long long)c * total / ctas) / num_kb);
          const float* theirs = partials + ((size_t)c * 2 + (tile == c_first_tile ? 0 : 1)) * OUTS;
#pragma unroll
          for (int r = 0; r < RT; ++r)
#pragma unroll
            for (int tt = 0; tt < TT; ++tt)
#pragma unroll
              for (int e = 0; e < 4; ++e)
                acc[r][tt][e] += __ldcg(theirs + ((r * TT + tt) * 4 + e) * HALF_THREADS + tid);
        }
        if (tid == 0) counters[tile] = 0;
      }
    }
    if (write) {
#pragma unroll
      for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {  // c0, c1: row g; c2, c3: row g + 8
          const int n = (tile0 + wn * RT + r) * 16 + g + 8 * e2;
          if (n >= N) continue;
          const float b = bias != nullptr ? Num<DT>::to_float(bias[n]) : 0.0f;
#pragma unroll
          for (int tt = 0; tt < TT; ++tt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int m = tok0 + tt * 8 + 2 * t + e;
              if (m < M) out[(size_t)m * N + n] = Num<DT>::from_float(acc[r][tt][2 * e2 + e] + b);
            }
        }
    }
    zero(acc);
  };
  at = start;
  fill = copies_of(start.tile);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < steps) {
      if (s > 0) advance(at, fill);
      fill.activations(smem + s * L::STAGE_BYTES, at.kb);
    }
    cp_async_commit();
  }

  zero(acc);
  zero(part);
  int read_slot = 0, fill_slot = STAGES - 1;  // the slot read now and the one refilled
  unsigned char* stage = smem;                // the slot read last
  for (int it = begin; it < end;) {
    // One tile's part: iterations [segment_begin, segment_end) of tile `tile`.
    const int tile = it / num_kb, segment_begin = it, segment_end = min(end, (tile + 1) * num_kb);
    int k_stage = (it - tile * num_kb) * L::BK;
    for (; it < segment_end; ++it, k_stage += L::BK) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // this stage landed for every thread; nobody still reads the one refilled next
      if (it + STAGES - 1 < end) {  // the copies STAGES - 1 iterations ahead, whatever tile they are of
        advance(at, fill);
        unsigned char* refill = smem + fill_slot * L::STAGE_BYTES;
        fill.weights(refill, at.kb, group_shift);
        fill.activations(refill, at.kb);
      }
      cp_async_commit();
      fill_slot = fill_slot == STAGES - 1 ? 0 : fill_slot + 1;
      stage = smem + read_slot * L::STAGE_BYTES;
      read_slot = read_slot == STAGES - 1 ? 0 : read_slot + 1;
      multiply_stage(stage, k_stage, it + 1 == segment_end);
    }
    finish_tile(tile, segment_begin, segment_end, stage);
  }
  cp_async_wait<0>();
}
