// What the W4 kernels over the fragment layout share (kernels/w4_fragment_gemm.cu for 1-32 tokens,
// kernels/w4_fragment_batch.cu for 33-128): the unpacking of a lane's fragment words, ldmatrix, a CTA's stage
// layout in shared memory and the reads of a warp's words, scale entries and B fragments from it, the cp.async
// copies of one stage, the scaling of each group's sums into the accumulators, the fused gate/up arithmetic (the
// few-token kernel's) and the arrival count of split or stream-K parts. The layout itself is described in
// kernels/w4_fragment_gemm.py and at the top of w4_fragment_gemm.cu.
#include "common.cuh"

template <int DT> struct FragDequant;

template <> struct FragDequant<1> {  // bf16: the zero pairs of rows g (lo) and g + 8 (hi)
  u32 lo, hi;
  __device__ __forceinline__ explicit FragDequant(u32 zeros)
      : lo(__byte_perm(zeros, 0, 0x1010)), hi(__byte_perm(zeros, 0, 0x3232)) {}
  template <u32 MASK>
  static __device__ __forceinline__ u32 codes(u32 bits) {
    u32 out;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(out) : "r"(bits), "r"(MASK), "r"(0x43004300u));
    return out;
  }
  // The step's A fragment from its word: a_p = nibbles (p, p + 4) minus the row's (128 + z).
  __device__ __forceinline__ void unpack(u32 w, u32 (&a)[4]) const {
    a[0] = Num<1>::fma(codes<0x000F000Fu>(w), 0x3F803F80u, lo);
    a[1] = Num<1>::fma(codes<0x000F000Fu>(w >> 4), 0x3F803F80u, hi);
    a[2] = Num<1>::fma(codes<0x000F000Fu>(w >> 8), 0x3F803F80u, lo);
    a[3] = Num<1>::fma(codes<0x000F000Fu>(w >> 12), 0x3F803F80u, hi);
  }
};

template <> struct FragDequant<0> {  // fp16: row g's -(1024 + z) pair, row g + 8's -(64 + z) pair
  u32 lo, hi;
  __device__ __forceinline__ explicit FragDequant(u32 zeros)
      : lo(__byte_perm(zeros, 0, 0x1010)) {
    u32 h;
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(h) : "r"(__byte_perm(zeros, 0, 0x3232)), "r"(0x63806380u));  // + 960
    hi = h;
  }
  template <u32 MASK>
  static __device__ __forceinline__ u32 codes(u32 bits) {
    u32 out;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(out) : "r"(bits), "r"(MASK), "r"(0x64006400u));
    return out;
  }
  static __device__ __forceinline__ u32 add(u32 a, u32 b) {
    u32 d;
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
  }
  __device__ __forceinline__ void unpack(u32 w, u32 (&a)[4]) const {
    const u32 w8 = w >> 8;
    a[0] = add(codes<0x000F000Fu>(w), lo);                               // (1024 + q) - (1024 + z)
    a[1] = Num<0>::fma(codes<0x00F000F0u>(w), 0x2C002C00u, hi);          // (1024 + 16 q) / 16 - (64 + z)
    a[2] = add(codes<0x000F000Fu>(w8), lo);
    a[3] = Num<0>::fma(codes<0x00F000F0u>(w8), 0x2C002C00u, hi);
  }
};

__device__ __forceinline__ float fp16_bits_to_float(u32 bits) { return half_bits_to_float((u16)bits); }

// Four 8x8 b16 matrices from shared memory: lane i supplies the address of row i % 8 of matrix i / 8.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* row) {
  const u32 address = (u32)__cvta_generic_to_shared(row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

template <int RT, int TT, int WN, int WK, int APW, int GS>
struct FragTile {
  static constexpr int THREADS = 32 * WN * WK;
  static constexpr int TILES = RT * WN;  // 16-row tiles a CTA
  static constexpr int ROWS = 16 * TILES;
  static constexpr int TOKENS = 8 * TT;
  static constexpr int ATOMS = APW * WK;  // atoms of each tile a stage
  static constexpr int BK = 64 * ATOMS;
  static constexpr int STEPS = 4 * APW;   // k16 steps of a warp a stage
  static constexpr int MAX_GROUPS = GS > 0 ? BK / (16 * GS) : WK;  // a stage's groups (GS 0: G >= 64 APW)
  static constexpr int X_ROW = BK * 2;    // bytes of a token's activations a stage
  static constexpr int W_OFFSET = 0;
  static constexpr int X_OFFSET = W_OFFSET + TILES * ATOMS * 512;
  static constexpr int S_OFFSET = X_OFFSET + TOKENS * X_ROW;
  static constexpr int STAGE_BYTES = S_OFFSET + TILES * MAX_GROUPS * 64;
  static_assert(GS == 0 || STEPS % GS == 0, "a group inside a warp's atoms divides them");
  static_assert(THREADS % (BK / 8) == 0 || (BK / 8) % THREADS == 0, "activation copies");
  // 16-byte chunk c (8 k) of token row r: XOR-swizzled over 8 rows, so ldmatrix's 8 rows hit 8 bank groups
  static __device__ __forceinline__ int x_offset(int row, int chunk) {
    return X_OFFSET + row * X_ROW + ((chunk ^ (row & 7)) << 4);
  }
  // A lane's 16-byte fragment words of atom `atom` (of the stage's ATOMS) of the CTA's row tile `tile`.
  static __device__ __forceinline__ uint4 words(const unsigned char* stage, int tile, int atom, int lane) {
    return *reinterpret_cast<const uint4*>(stage + W_OFFSET + ((tile * ATOMS + atom) * 32 + lane) * 16);
  }
  // Row g's scale entry (scale pair, zero pair) of row tile `tile` in the stage's group slot `slot`.
  static __device__ __forceinline__ uint2 entry(const unsigned char* stage, int tile, int slot, int g) {
    return *reinterpret_cast<const uint2*>(stage + S_OFFSET + ((tile * MAX_GROUPS + slot) * 8 + g) * 8);
  }
  // B fragments of two k16 steps (k offset dk inside the stage) of token tile tt: ldmatrix.x4, lane i giving the
  // address of token 8 tt + i % 8 at k chunk dk / 8 + i / 8.
  static __device__ __forceinline__ void b_fragments(u32 (&b)[4], const unsigned char* stage, int tt, int dk,
                                                     int lane) {
    ldmatrix_x4(b, stage + x_offset(tt * 8 + (lane & 7), (dk >> 3) + (lane >> 3)));
  }
};

// Word j (k16 step j of its atom) of a lane's fragment words.
__device__ __forceinline__ u32 step_word(const uint4& w, int j) {
  return j == 0 ? w.x : j == 1 ? w.y : j == 2 ? w.z : w.w;
}

// How a stage's k maps to its scale-entry slots: slot_shift (a k offset inside the stage >> slot_shift is its group
// minus the stage's first; 31 where the stage lies in one group) and the stage's groups.
template <class L>
struct StageGroups {
  int slot_shift, count;
  __device__ __forceinline__ explicit StageGroups(int group_shift)
      : slot_shift(group_shift < 30 && (1 << group_shift) < L::BK ? group_shift : 31),
        count(slot_shift == 31 ? 1 : L::BK >> group_shift) {}
};

template <int RT, int TT>
__device__ __forceinline__ void zero(float (&a)[RT][TT][4]) {
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int tt = 0; tt < TT; ++tt)
#pragma unroll
      for (int e = 0; e < 4; ++e) a[r][tt][e] = 0.0f;
}

// acc += s * part for the rows' group scales (c0, c1: row g; c2, c3: row g + 8), then part = 0.
template <int RT, int TT>
__device__ __forceinline__ void scale_into(float (&acc)[RT][TT][4], float (&part)[RT][TT][4], const uint2 (&entry)[RT]) {
#pragma unroll
  for (int r = 0; r < RT; ++r) {
    const float s_lo = fp16_bits_to_float(entry[r].x & 0xFFFFu), s_hi = fp16_bits_to_float(entry[r].x >> 16);
#pragma unroll
    for (int tt = 0; tt < TT; ++tt) {
      acc[r][tt][0] = fmaf(s_lo, part[r][tt][0], acc[r][tt][0]);
      acc[r][tt][1] = fmaf(s_lo, part[r][tt][1], acc[r][tt][1]);
      acc[r][tt][2] = fmaf(s_hi, part[r][tt][2], acc[r][tt][2]);
      acc[r][tt][3] = fmaf(s_hi, part[r][tt][3], acc[r][tt][3]);
#pragma unroll
      for (int e = 0; e < 4; ++e) part[r][tt][e] = 0.0f;
    }
  }
}

// The fused gate/up output from a gate sum and its up sum (bias added): act_and_mul_kernel's arithmetic on the two
// DT-rounded products, so the bits are those of the product followed by act_and_mul.
template <int DT, int ACT>
__device__ __forceinline__ u16 gate_times_up(float gate, float up) {
  const float gate_r = Num<DT>::to_float(Num<DT>::from_float(gate));
  const float up_r = Num<DT>::to_float(Num<DT>::from_float(up));
  const float act = Num<DT>::to_float(Num<DT>::from_float(gate_activation<ACT>(gate_r)));
  return Num<DT>::from_float(act * up_r);
}

// Whether this CTA is the last of `others` + 1 to leave its part of a tile (the tile's counter, acquire-release):
// every thread's part is written before thread 0 counts, and the last CTA's threads read the others' after it.
__device__ __forceinline__ bool last_to_arrive(u32* counter, u32 others, int& flag) {
  __syncthreads();
  if (threadIdx.x == 0) {
    u32 arrived;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(arrived) : "l"(counter) : "memory");
    flag = arrived == others;
  }
  __syncthreads();
  return flag;
}

// The cp.async copies of one stage, with every address that does not change from stage to stage worked out once a
// thread. Chunk c = tid + i THREADS of each kind: weights (c = (tile, atom, lane), THREADS a multiple of 32 ATOMS,
// so a thread keeps one atom and steps over tiles), activations (c = (token row, 16-byte chunk)), scale entries
// (c = (tile, slot, quarter), MAX_GROUPS slots a tile, those past the stage's groups left alone). Activations go
// by 8-row blocks: a thread keeps row tid % 8 of each block, so its swizzle and its shared-memory offsets are
// constants apart (chunk tid / 8 + j THREADS / 8 of row 8 i + tid % 8).
template <class L>
struct FragCopies {
  static constexpr int W_TILES_PASS = L::THREADS / (32 * L::ATOMS);
  static constexpr int W_PASSES = L::TILES / W_TILES_PASS;
  static constexpr int CHUNKS = L::BK / 8;  // 16-byte chunks of a token row
  static constexpr int X_CHUNKS_PASS = L::THREADS / 8;
  static constexpr int X_CHUNK_PASSES = CHUNKS / X_CHUNKS_PASS;
  static constexpr int X_ROW_PASSES = L::TOKENS / 8;
  static constexpr int S_COPIES = L::TILES * L::MAX_GROUPS * 4;
  static constexpr int S_PASSES = (S_COPIES + L::THREADS - 1) / L::THREADS;
  static_assert(L::THREADS % (32 * L::ATOMS) == 0 && L::TILES % W_TILES_PASS == 0, "weight copy passes");
  static_assert(CHUNKS % X_CHUNKS_PASS == 0, "activation copy passes");

  const uint4* w_src;  // pass 0's atom at stage 0
  size_t w_pass;       // uint4 between passes
  u32 w_valid;         // bit i: pass i's tile is inside N
  int w_atom;
  const u16* x_src;   // row tid % 8, chunk tid / 8 at stage 0
  size_t x_block;      // elements between 8-row blocks
  u32 x_valid;         // bit i: block i's row is inside M
  int x_dst;           // shared-memory offset of block 0, chunk pass 0
  int x_k;             // the thread's k offset in a stage (chunk pass 0)
  const uint2* s_src[S_PASSES];
  u32 s_used;          // bit i: pass i copies an entry of the stage's groups
  int s_slot[S_PASSES];
  int k_atoms, K, num_groups;

  __device__ __forceinline__ FragCopies(const uint4* __restrict__ frag, const uint2* __restrict__ sz,
                                        const u16* __restrict__ x, int tile0, int tok0, int n_tiles, int k_atoms_,
                                        int M, int K_, int num_groups_, int stage_groups)
      : k_atoms(k_atoms_), K(K_), num_groups(num_groups_) {
    const int tid = threadIdx.x;
    w_atom = (tid >> 5) % L::ATOMS;
    const int w_tile = tid / (32 * L::ATOMS);
    w_src = frag + ((size_t)min(tile0 + w_tile, n_tiles - 1) * k_atoms + w_atom) * 32 + (tid & 31);
    w_pass = (size_t)W_TILES_PASS * k_atoms * 32;
    w_valid = 0;
#pragma unroll
    for (int i = 0; i < W_PASSES; ++i) w_valid |= (u32)(tile0 + w_tile + i * W_TILES_PASS < n_tiles) << i;
    const int x_row = tid & 7, chunk = tid >> 3;
    x_k = chunk * 8;
    x_src = x + (size_t)min(tok0 + x_row, M - 1) * K + x_k;
    x_block = (size_t)8 * K;
    x_valid = 0;
#pragma unroll
    for (int i = 0; i < X_ROW_PASSES; ++i) x_valid |= (u32)(tok0 + x_row + 8 * i < M) << i;
    x_dst = L::x_offset(x_row, chunk);
    s_used = 0;
#pragma unroll
    for (int i = 0; i < S_PASSES; ++i) {
      const int c = tid + i * L::THREADS;
      const int tile = c / (L::MAX_GROUPS * 4), slot = (c >> 2) % L::MAX_GROUPS;
      s_slot[i] = slot;
      s_used |= (u32)(c < S_COPIES && tile0 + tile < n_tiles && slot < stage_groups) << i;
      s_src[i] = sz + ((size_t)min(tile0 + tile, n_tiles - 1) * num_groups + slot) * 8 + 2 * (c & 3);
    }
  }

  // Weights and scale entries of stage kb (no earlier kernel writes them).
  __device__ __forceinline__ void weights(unsigned char* stage, int kb, int group_shift) const {
    const bool atom_valid = kb * L::ATOMS + w_atom < k_atoms;
    const uint4* src = w_src + (size_t)kb * (L::ATOMS * 32);
#pragma unroll
    for (int i = 0; i < W_PASSES; ++i)
      cp_async16(stage + L::W_OFFSET + (threadIdx.x + i * L::THREADS) * 16, src + i * w_pass,
                 atom_valid && ((w_valid >> i) & 1));
    const int group0 = (kb * L::BK) >> group_shift;
#pragma unroll
    for (int i = 0; i < S_PASSES; ++i)
      if ((s_used >> i) & 1)
        cp_async16(stage + L::S_OFFSET + (threadIdx.x + i * L::THREADS) * 16, s_src[i] + (size_t)group0 * 8,
                   group0 + s_slot[i] < num_groups);
  }

  // Activations of stage kb (an earlier kernel's output: only after the PDL wait).
  __device__ __forceinline__ void activations(unsigned char* stage, int kb) const {
    const u16* src = x_src + (size_t)kb * L::BK;
#pragma unroll
    for (int j = 0; j < X_CHUNK_PASSES; ++j) {
      const bool k_valid = kb * L::BK + x_k + j * X_CHUNKS_PASS * 8 < K;
      const u16* row_src = src + j * X_CHUNKS_PASS * 8;
#pragma unroll
      for (int i = 0; i < X_ROW_PASSES; ++i) {
        // row 8 i + tid % 8 keeps its swizzle, chunk + j X_CHUNKS_PASS its offset: constant steps
        cp_async16(stage + x_dst + i * 8 * L::X_ROW + j * X_CHUNKS_PASS * 16, row_src, k_valid && ((x_valid >> i) & 1));
        row_src += x_block;
      }
    }
  }
};
