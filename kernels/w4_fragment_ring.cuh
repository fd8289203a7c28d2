// The warp-specialized weight stream of the 33-128-token W4 kernel (kernels/w4_fragment_batch.cu with RING, SM90):
// one producer warp fills a ring of STAGES shared-memory slots, the consumer warps (the wgmma warpgroups) read
// them. Each slot has two mbarriers:
//
// - full[s]: 33 arrivals a phase. Lane 0 arrives with the byte count of the slot's bulk copies (expect_tx); each of
//   the 32 lanes arrives once more when its own cp.async copies have landed (cp.async.mbarrier.arrive.noinc). The
//   phase completes when all arrived and the bulk bytes are in: the slot holds its stage.
// - empty[s]: one arrival a consumer warp, once the warp's reads of the slot are done (its wgmma waited for): the
//   producer may refill it.
//
// What the producer copies of a stage (the FragTile layout, kernels/w4_fragment.cuh): the weights and scale entries
// by cp.async.bulk, one copy of each per row tile (lane i < TILES: row tile tile0 + i). The fragment layout keeps a
// row tile's atoms along k contiguous (kernels/w4_fragment_gemm.py: frag [N_tiles, K_atoms, 32, 4]), so a stage's
// ATOMS atoms of one row tile are one run of ATOMS x 512 bytes, stored in the slot as that tile's run; its group
// entries likewise (sz [N_tiles, num_groups, 8, 2]: 64 bytes a group). The activations by cp.async, 16 bytes each
// (the wgmma operand is 128-byte swizzled: a token row's 16-byte chunks are permuted, which a 1D bulk copy cannot
// do), zero-filled past M and K. Weights and scale entries are no earlier kernel's output, so the first STAGES
// stages' bulk copies go out before the programmatic-launch wait; activations only after it.
//
// What is not copied and why that is safe: atoms past K keep stale weight words, which the unpacking turns into
// finite values, multiplied by zero-filled activations; row tiles past N keep stale words and entries, whose rows
// are never written. Group slots of a stage past the weight's last group are read, so they are zero-filled
// (scale 0, zero pair 0: finite operands), as the cp.async path does.
#include "w4_fragment.cuh"

__device__ __forceinline__ u32 shared_address(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// Built where wgmma is (sm_90a: the ring feeds the wgmma warpgroups); elsewhere these compile to nothing and the
// wgmma they feed traps.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define W4_RING_ASM 1
#endif

__device__ __forceinline__ void barrier_init(u64* bar, u32 arrivals) {
#ifdef W4_RING_ASM
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(arrivals) : "memory");
#endif
}

// Makes the initialized barriers visible to the bulk-copy engine (the async proxy) before any copy uses them.
__device__ __forceinline__ void barrier_init_fence() {
#ifdef W4_RING_ASM
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// Arrives once and expects `bytes` more of bulk copies before the phase completes.
__device__ __forceinline__ void barrier_arrive_expect_bytes(u64* bar, u32 bytes) {
#ifdef W4_RING_ASM
  asm volatile("{\n .reg .b64 state;\n mbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}"
               ::"r"(shared_address(bar)), "r"(bytes) : "memory");
#endif
}

__device__ __forceinline__ void barrier_arrive(u64* bar) {
#ifdef W4_RING_ASM
  asm volatile("{\n .reg .b64 state;\n mbarrier.arrive.shared::cta.b64 state, [%0];\n}"
               ::"r"(shared_address(bar)) : "memory");
#endif
}

// Arrives once when every cp.async this thread issued before has landed (the arrival is counted in the barrier's
// init count: .noinc).
__device__ __forceinline__ void barrier_arrive_on_copies(u64* bar) {
#ifdef W4_RING_ASM
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(shared_address(bar)) : "memory");
#endif
}

// Waits until the barrier's phase of parity `parity` (0 for its first phase, then alternating) has completed.
__device__ __forceinline__ void barrier_wait(u64* bar, u32 parity) {
#ifdef W4_RING_ASM
  asm volatile(
      "{\n .reg .pred done;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT;\n}" ::"r"(shared_address(bar)), "r"(parity) : "memory");
#endif
}

// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to shared memory; the copy's
// completion counts its bytes on `bar`.
__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, u32 bytes, u64* bar) {
#ifdef W4_RING_ASM
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(shared_address(dst)), "l"(src), "r"(bytes), "r"(shared_address(bar)) : "memory");
#endif
}

// Register budgets of warpgroups (setmaxnreg: every warp of the warpgroup executes it): the producer warpgroup
// gives registers back so that the consumer warpgroups' accumulators fit without spilling.
template <u32 REGISTERS>
__device__ __forceinline__ void release_registers() {
#ifdef W4_RING_ASM
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(REGISTERS));
#endif
}
template <u32 REGISTERS>
__device__ __forceinline__ void claim_registers() {
#ifdef W4_RING_ASM
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(REGISTERS));
#endif
}

// The ring's barriers: full[STAGES] then empty[STAGES], in static shared memory (one set a CTA).
template <int STAGES>
__device__ __forceinline__ u64* ring_barriers() {
  __shared__ u64 barriers[2 * STAGES];
  return barriers;
}

template <int STAGES>
struct Ring {
  static constexpr u32 FULL_ARRIVALS = 33;  // lane 0's expect_tx arrival and the 32 lanes' cp.async arrivals
  u64* full;
  u64* empty;
  __device__ __forceinline__ Ring() : full(ring_barriers<STAGES>()), empty(ring_barriers<STAGES>() + STAGES) {}
  // By thread 0, before the CTA's first barrier.
  __device__ __forceinline__ void init(u32 consumer_warps) const {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      barrier_init(full + s, FULL_ARRIVALS);
      barrier_init(empty + s, consumer_warps);
    }
    barrier_init_fence();
  }
};

// A slot of the ring and the parity of its current use, stepped one stage at a time.
template <int STAGES>
struct RingPosition {
  int slot = 0;
  u32 phase = 0;
  __device__ __forceinline__ void step() {
    if (++slot == STAGES) {
      slot = 0;
      phase ^= 1;
    }
  }
};

// The producer warp's copies of one (row block, token block) tile: lane i < TILES owns row tile tile0 + i's bulk
// copies; every lane copies activation chunks of rows lane % 8 + 8 i, chunks lane / 8 + 4 j (so its swizzle takes
// two values and its offsets step by constants, as FragCopies' do).
template <class L>
struct RingCopies {
  static constexpr int CHUNKS = L::BK / 8;  // 16-byte chunks of a token row a stage
  static constexpr int X_CHUNK_PASSES = CHUNKS / 4;
  static constexpr int X_ROW_PASSES = L::TOKENS / 8;
  static_assert(L::TILES <= 32 && CHUNKS % 4 == 0, "a lane a row tile; 4 chunk columns of lanes");

  const unsigned char* w_src;  // the lane's row tile at atom 0
  const unsigned char* s_src;  // the lane's row tile at group 0
  int valid_tiles;             // row tiles of the tile inside N
  const u16* x_src;            // row tok0 + lane % 8, chunk lane / 8 at k 0
  size_t x_block;              // elements between 8-row blocks
  u32 x_valid;                 // bit i: block i's row is inside M
  int x_row, x_chunk;
  int k_atoms, K, num_groups, stage_groups;

  __device__ __forceinline__ RingCopies(const uint4* __restrict__ frag, const uint2* __restrict__ sz,
                                        const u16* __restrict__ x, int tile0, int tok0, int n_tiles, int k_atoms_,
                                        int M, int K_, int num_groups_, int stage_groups_)
      : k_atoms(k_atoms_), K(K_), num_groups(num_groups_), stage_groups(stage_groups_) {
    const int lane = threadIdx.x & 31;
    const int tile = min(tile0 + lane, n_tiles - 1);
    valid_tiles = min(L::TILES, n_tiles - tile0);
    w_src = reinterpret_cast<const unsigned char*>(frag) + (size_t)tile * k_atoms * 512;
    s_src = reinterpret_cast<const unsigned char*>(sz) + (size_t)tile * num_groups * 64;
    x_row = lane & 7;
    x_chunk = lane >> 3;
    x_src = x + (size_t)min(tok0 + x_row, M - 1) * K + x_chunk * 8;
    x_block = (size_t)8 * K;
    x_valid = 0;
#pragma unroll
    for (int i = 0; i < X_ROW_PASSES; ++i) x_valid |= (u32)(tok0 + x_row + 8 * i < M) << i;
  }

  // Weights and scale entries of stage kb into `stage`, counted on `full` (no earlier kernel writes them).
  __device__ __forceinline__ void weights(unsigned char* stage, u64* full, int kb, int group_shift) const {
    const int lane = threadIdx.x & 31;
    const u32 w_bytes = (u32)min(L::ATOMS, k_atoms - kb * L::ATOMS) * 512u;
    const int group0 = (kb * L::BK) >> group_shift;
    const int groups = max(0, min(stage_groups, num_groups - group0));  // the slots the weight has entries for
    const u32 s_bytes = (u32)groups * 64u;
    if (lane == 0) barrier_arrive_expect_bytes(full, (u32)valid_tiles * (w_bytes + s_bytes));
    __syncwarp();
    if (lane < valid_tiles) {
      bulk_copy_to_shared(stage + L::W_OFFSET + lane * (L::ATOMS * 512),
                          w_src + (size_t)kb * (L::ATOMS * 512), w_bytes, full);
      if (s_bytes > 0)
        bulk_copy_to_shared(stage + L::S_OFFSET + lane * (L::MAX_GROUPS * 64), s_src + (size_t)group0 * 64, s_bytes,
                            full);
      // the stage's slots past the last group: zero-filled, 16 bytes a cp.async (arrived on with the activations)
      for (int slot = groups; slot < stage_groups; ++slot)
#pragma unroll
        for (int q = 0; q < 4; ++q)
          cp_async16(stage + L::S_OFFSET + (lane * L::MAX_GROUPS + slot) * 64 + q * 16, s_src, false);
    }
  }

  // Activations of stage kb (an earlier kernel's output: only after the PDL wait); then this lane's arrival on
  // `full` once all its copies of the stage have landed.
  __device__ __forceinline__ void activations(unsigned char* stage, u64* full, int kb) const {
    const u16* src = x_src + (size_t)kb * L::BK;
#pragma unroll
    for (int j = 0; j < X_CHUNK_PASSES; ++j) {
      const int chunk = x_chunk + 4 * j;
      const bool k_valid = kb * L::BK + chunk * 8 < K;
      unsigned char* dst = stage + L::x_offset(x_row, chunk);
      const u16* row_src = src + 32 * j;
#pragma unroll
      for (int i = 0; i < X_ROW_PASSES; ++i) {
        // row 8 i + lane % 8 keeps its swizzle: 8 rows further on is 8 X_ROW bytes on
        cp_async16(dst + i * 8 * L::X_ROW, row_src, k_valid && ((x_valid >> i) & 1));
        row_src += x_block;
      }
    }
    barrier_arrive_on_copies(full);
  }
};
