// W4A16 product for few tokens (1-32) over the fragment layout of kernels/w4_fragment_gemm.py: out[m, n] =
// sum_k x[m, k] * W[n, k] (+ bias[n]), W = (q - z) * s with integer zero points, mma.sync m16n8k16 (SM80+).
//
// Layout (made once per weight at load; the disk format is unchanged). The weight is cut into atoms of 16 rows x 64
// k (512 bytes): frag[row tile][atom][lane][j], one 16-byte word quadruple per lane, word j holding the lane's A
// fragment of k16 step j, so one 16-byte load serves four mma steps and no thread reads another's bytes. Lane
// (g = lane / 4, t = lane % 4), word of step j, nibble i = 4e + p (p = 0..3, e = 0..1) holds the code of
//   row 16 tile + g + 8 (p & 1), k 64 atom + 16 j + 2t + 8 (p >> 1) + e,
// i.e. register a_p of the m16n8k16 A fragment is the pair of nibbles (p, p + 4). Those come out with one LOP3 each:
//   bf16: (word >> 4p) & 0x000F000F | 0x43004300 = (128 + q) per half;
//   fp16: (word >> 8 (p >> 1)) & (p odd ? 0x00F000F0 : 0x000F000F) | 0x64006400 = 1024 + q, or 1024 + 16 q.
// One add (fp16 odd pairs: one fma with 1/16) of the zero pair -(magic + z) leaves q - z, exact in either type. The
// group scale is applied in fp32 to each group's sum, so every weight the tensor cores see is (q - z) exactly and
// the result is sum_g s_g * sum_{k in g} (q - z) x: the reference dequantizer's fp32 weights, summed in fp32.
// Scale entries sz[row tile][group][g] = (fp16 scale pair (row g, row g + 8), zero pair (row g, row g + 8) in DT).
//
// Work split. A CTA has WN x WK warps and owns ROWS = 16 RT WN rows and TOKENS = 8 TT tokens; it walks K in stages
// of BK = 64 APW WK, each a cp.async group (weights, scale entries and activations of the stage), STAGES deep. Warp
// (wn, wk) multiplies row tiles wn RT .. wn RT + RT - 1 by atoms wk APW .. wk APW + APW - 1 of every stage: its own
// weight bytes, the activations shared through shared memory (ldmatrix, 128-byte XOR swizzle). The WK partial sums
// are added in shared memory in wk order at the end; a grid z > 1 splits the stages over CTAs, whose fp32 partials
// the last CTA of a tile adds in split order. Weights and scales of the first stages are fetched before the PDL wait.
//
// ACT: -1 the product; 0 (SiLU) or 1 (GeLU-tanh): a merged gate/up weight with its rows interleaved by 8 at load
// (kernels/w4_fragment_gemm.py: interleave_gate_up), written as act(gate) * up [M, N / 2].
//
// GS: the group size in k16 steps where a group lies inside one warp's APW atoms of a stage (2: G = 32, 4: 64, 8:
// 128 with APW = 4), so the group sums are scaled at fixed steps; 0: groups span a warp's atoms (G >= 64 APW, or one
// group a row), scaled when the next stage's atoms start another group and at the end.
#include "w4_fragment.cuh"

template <int DT, int RT, int TT, int WN, int WK, int APW, int GS, int STAGES, int ACT>
__global__ void __launch_bounds__(32 * WN * WK) w4_fragment_gemm_kernel(
    const u16* __restrict__ x,       // [M, K] activations, DT
    const uint4* __restrict__ frag,  // [N_tiles, K_atoms, 32] fragment words
    const uint2* __restrict__ sz,    // [N_tiles, num_groups, 8] (fp16 scale pair, DT zero pair)
    const u16* __restrict__ bias,    // [N] DT, or null
    u16* __restrict__ out,           // [M, N] DT; with ACT >= 0 [M, N / 2]
    float* __restrict__ partials,    // split-K sums: [tiles, splits, TOKENS * ROWS] fp32
    u32* __restrict__ counters,      // [tiles], zero between launches
    int M, int N, int K, int group_shift, int num_groups) {
  using L = FragTile<RT, TT, WN, WK, APW, GS>;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int last_flag;
  launch_dependents();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wn = warp % WN, wk = warp / WN, g = lane >> 2, t = lane & 3;
  const int n_tiles = (N + 15) >> 4, k_atoms = (K + 63) >> 6;
  const int tile0 = blockIdx.x * L::TILES, tok0 = blockIdx.y * L::TOKENS;
  const int num_kb = (K + L::BK - 1) / L::BK;
  const int kb_begin = (int)(((long long)blockIdx.z * num_kb) / gridDim.z);
  const int kb_end = (int)(((long long)(blockIdx.z + 1) * num_kb) / gridDim.z);
  const int steps = kb_end - kb_begin;
  const StageGroups<L> groups(group_shift);
  const FragCopies<L> copies(frag, sz, x, tile0, tok0, n_tiles, k_atoms, M, K, num_groups, groups.count);

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s)
    if (s < steps) copies.weights(smem + s * L::STAGE_BYTES, kb_begin + s, group_shift);
  wait_for_prior_grids();
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < steps) copies.activations(smem + s * L::STAGE_BYTES, kb_begin + s);
    cp_async_commit();
  }

  float acc[RT][TT][4], part[RT][TT][4];
  zero(acc);
  zero(part);

  int read_slot = 0, fill_slot = STAGES - 1;  // the stage read now and the one refilled (step % STAGES, ...)
  for (int step = 0; step < steps; ++step) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // stage `step` landed for every thread; nobody still reads the one refilled next
    const int next = step + STAGES - 1;
    if (next < steps) {
      unsigned char* refill = smem + fill_slot * L::STAGE_BYTES;
      copies.weights(refill, kb_begin + next, group_shift);
      copies.activations(refill, kb_begin + next);
    }
    cp_async_commit();
    fill_slot = fill_slot == STAGES - 1 ? 0 : fill_slot + 1;
    const unsigned char* stage = smem + read_slot * L::STAGE_BYTES;
    read_slot = read_slot == STAGES - 1 ? 0 : read_slot + 1;
    const int k_stage = (kb_begin + step) * L::BK;

    uint4 w[APW][RT];
#pragma unroll
    for (int ai = 0; ai < APW; ++ai)
#pragma unroll
      for (int r = 0; r < RT; ++r) w[ai][r] = L::words(stage, wn * RT + r, wk * APW + ai, lane);

    uint2 entry[RT];  // the scale entries of the current group
    u32 b[TT][4];     // B fragments of steps s and s + 1 (s even): b0, b1 of s, then of s + 1
#pragma unroll
    for (int s = 0; s < L::STEPS; ++s) {
      const int ai = s >> 2, j = s & 3;
      const int dk = (wk * APW + ai) * 64 + 16 * j;  // k offset of the step inside the stage
      if (GS == 0 ? s == 0 : s % GS == 0) {  // a new group: its scale entries
#pragma unroll
        for (int r = 0; r < RT; ++r) entry[r] = L::entry(stage, wn * RT + r, dk >> groups.slot_shift, g);
      }
      if ((s & 1) == 0) {
#pragma unroll
        for (int tt = 0; tt < TT; ++tt) L::b_fragments(b[tt], stage, tt, dk, lane);
      }
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        u32 a[4];
        FragDequant<DT>(entry[r].y).unpack(step_word(w[ai][r], j), a);
#pragma unroll
        for (int tt = 0; tt < TT; ++tt)
          Num<DT>::mma(part[r][tt], a[0], a[1], a[2], a[3], b[tt][2 * (s & 1)], b[tt][2 * (s & 1) + 1]);
      }
      bool flush;
      if constexpr (GS > 0) {
        flush = (s + 1) % GS == 0;
      } else {  // at the stage's last step, where the warp's next atoms lie in another group or this split ends
        flush = s == L::STEPS - 1 &&
                (step + 1 == steps || ((k_stage + L::BK) >> group_shift) != (k_stage >> group_shift));
      }
      if (flush) scale_into(acc, part, entry);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the pipeline's shared memory holds the warps' sums below

  // The WK warps' sums of each output, added in wk order: red[wk][token][row].
  float* red = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int tt = 0; tt < TT; ++tt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = (wn * RT + r) * 16 + g + 8 * (e >> 1), token = tt * 8 + 2 * t + (e & 1);
        red[(wk * L::TOKENS + token) * L::ROWS + row] = acc[r][tt][e];
      }
  __syncthreads();
  constexpr int OUTS = L::TOKENS * L::ROWS;
  constexpr int PER_THREAD = (OUTS + L::THREADS - 1) / L::THREADS;
  float v[PER_THREAD];
#pragma unroll
  for (int i = 0; i < PER_THREAD; ++i) {
    const int idx = tid + i * L::THREADS;
    float sum = 0.0f;
    if (idx < OUTS) {
#pragma unroll
      for (int w = 0; w < WK; ++w) sum += red[w * OUTS + idx];
    }
    v[i] = sum;
  }
  const int splits = gridDim.z;
  if (splits > 1) {
    const int tile = blockIdx.y * gridDim.x + blockIdx.x;
    float* mine = partials + ((size_t)tile * splits + blockIdx.z) * OUTS;
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i)
      if (tid + i * L::THREADS < OUTS) mine[tid + i * L::THREADS] = v[i];
    if (!last_to_arrive(counters + tile, (u32)(splits - 1), last_flag)) return;
    const float* all = partials + (size_t)tile * splits * OUTS;
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) v[i] = 0.0f;
#pragma unroll 1
    for (int z = 0; z < splits; ++z)
#pragma unroll
      for (int i = 0; i < PER_THREAD; ++i)
        if (tid + i * L::THREADS < OUTS) v[i] += __ldcg(all + (size_t)z * OUTS + tid + i * L::THREADS);
    if (tid == 0) counters[tile] = 0;
  }
#pragma unroll
  for (int i = 0; i < PER_THREAD; ++i) {
    const int idx = tid + i * L::THREADS;
    const int token = idx / L::ROWS, row = idx % L::ROWS;
    const int m = tok0 + token, n = tile0 * 16 + row;
    if constexpr (ACT >= 0) {
      // Gate/up rows interleaved at load: row 16 t + j is gate row 8 t + j, row 16 t + 8 + j its up row. Output
      // (token, 16 t + j) lies 8 lanes below (token, 16 t + 8 + j) (OUTS is a multiple of THREADS, so every lane
      // takes part), and act_and_mul_kernel's arithmetic on the two DT-rounded products gives the unfused bits.
      const float value = v[i] + (bias != nullptr && n < N ? Num<DT>::to_float(bias[n]) : 0.0f);
      const float up = __shfl_down_sync(0xffffffffu, value, 8);
      const int inner = N >> 1, feature = (n >> 4) * 8 + (row & 7);
      if (idx < OUTS && m < M && (row & 8) == 0 && feature < inner)
        out[(size_t)m * inner + feature] = gate_times_up<DT, ACT>(value, up);
    } else if (idx < OUTS && m < M && n < N) {
      const float b = bias != nullptr ? Num<DT>::to_float(bias[n]) : 0.0f;
      out[(size_t)m * N + n] = Num<DT>::from_float(v[i] + b);
    }
  }
}
