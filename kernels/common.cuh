// Shared device helpers for deepinfer's kernels. No CUDA headers are included: 16-bit floats
// travel as raw `u16` bits and every conversion or packed op is one PTX instruction, so the
// sources compile the same under any NVRTC (no cuda_fp16.h / cuda_bf16.h include paths needed).
//
// DT selects the activation type: 0 = float16, 1 = bfloat16. A "pair" is a u32 holding two
// 16-bit values of type DT (low half = first element), the operand type of mma.sync.
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

template <int DT> struct Num;

template <> struct Num<0> {  // float16
  static __device__ __forceinline__ float to_float(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
  }
  static __device__ __forceinline__ u16 from_float(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
  }
  // (lo, hi) floats -> one pair, rounded to nearest even
  static __device__ __forceinline__ u32 pack(float lo, float hi) {
    u32 p;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(p) : "f"(hi), "f"(lo));
    return p;
  }
  // (1024 + c) for a code c < 1024 placed in the low mantissa bits of each half
  static constexpr u32 MAGIC = 0x64006400u;
  static __device__ __forceinline__ u32 sub(u32 a, u32 b) {
    u32 d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
  }
  static __device__ __forceinline__ u32 mul(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
  }
  static __device__ __forceinline__ u32 fma(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
  }
  static __device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};

template <> struct Num<1> {  // bfloat16
  static __device__ __forceinline__ float to_float(u16 h) { return __uint_as_float(((u32)h) << 16); }
  static __device__ __forceinline__ u16 from_float(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
  }
  static __device__ __forceinline__ u32 pack(float lo, float hi) {
    u32 p;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(p) : "f"(hi), "f"(lo));
    return p;
  }
  // (128 + c) for a code c < 128
  static constexpr u32 MAGIC = 0x43004300u;
  // sub.bf16x2 needs sm_90; a - b = fma(a, 1, -b) is exact wherever the difference is representable
  static __device__ __forceinline__ u32 sub(u32 a, u32 b) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(0x3F803F80u), "r"(b ^ 0x80008000u));
    return d;
  }
  static __device__ __forceinline__ u32 fma(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
  }
  static __device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};

// the two elements of a pair as floats
template <int DT>
__device__ __forceinline__ float pair_lo(u32 p) { return Num<DT>::to_float((u16)(p & 0xFFFFu)); }
template <int DT>
__device__ __forceinline__ float pair_hi(u32 p) { return Num<DT>::to_float((u16)(p >> 16)); }

__device__ __forceinline__ float half_bits_to_float(u16 h) { return Num<0>::to_float(h); }

// RoPE on one rotation pair (x1 = element i, x2 = element i + D/2 of a head, both DT values as floats) with the
// position's cos/sin of i (DT values): HF's rotate-half in DT arithmetic, x1*cos and x2*sin each rounded to DT,
// then their difference (sum) rounded. rope_cache_kernel and quant_tc_rope_kernel both rotate with it.
template <int DT>
__device__ __forceinline__ void rotate_pair(float& x1, float& x2, float c, float s) {
  const float x1c = Num<DT>::to_float(Num<DT>::from_float(x1 * c));
  const float x2s = Num<DT>::to_float(Num<DT>::from_float(x2 * s));
  const float x2c = Num<DT>::to_float(Num<DT>::from_float(x2 * c));
  const float x1s = Num<DT>::to_float(Num<DT>::from_float(x1 * s));
  x1 = Num<DT>::to_float(Num<DT>::from_float(x1c - x2s));
  x2 = Num<DT>::to_float(Num<DT>::from_float(x2c + x1s));
}

// The gated MLP's activation of the gate in fp32: ACT 0 = SiLU (x / (1 + e^-x)), 1 = GeLU tanh approximation.
// act_and_mul_kernel and quant_tcs_act_kernel both apply it (then round to DT), so their results are the same bits.
template <int ACT>
__device__ __forceinline__ float gate_activation(float x) {
  if constexpr (ACT == 0) {
    return x / (1.0f + expf(-x));
  } else {
    const float inner = 0.7978845608028654f * (x + 0.044715f * x * x * x);  // sqrt(2/pi)
    return 0.5f * x * (1.0f + tanhf(inner));
  }
}

// Thread-block clusters (SM90+): a CTA reads another CTA's shared memory of its cluster (distributed shared memory)
// through the address `mapa` gives for that rank; the barrier's release / acquire order those accesses.
// RELEASE: the CTA's shared-memory writes before the barrier are visible to the cluster's reads after it (a
// fence); without it the barrier only waits for every rank to arrive (the reads before it are complete).
template <bool RELEASE>
__device__ __forceinline__ void cluster_barrier() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (RELEASE) {
    asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
  } else {
    asm volatile("barrier.cluster.arrive.relaxed;\n\tbarrier.cluster.wait;" ::: "memory");
  }
#endif
}

__device__ __forceinline__ u32 cluster_address(const void* shared, int rank) {
  u32 remote = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const u32 local = (u32)__cvta_generic_to_shared(shared);
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
#endif
  return remote;
}

__device__ __forceinline__ float4 cluster_load4(u32 address) {
  float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(address) : "memory");
#endif
  return v;
}

__device__ __forceinline__ float cluster_load(u32 address) {
  float v = 0.0f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(address) : "memory");
#endif
  return v;
}

// Pairs (a.lo, b.lo) and (a.hi, b.hi) of two pairs: the element-wise interleave mma operands need.
__device__ __forceinline__ u32 pair_of_los(u32 a, u32 b) { return __byte_perm(a, b, 0x5410); }
__device__ __forceinline__ u32 pair_of_his(u32 a, u32 b) { return __byte_perm(a, b, 0x7632); }

// Four signed int8 values (one u32, byte i = element i) -> fp16 pairs (e0, e1) and (e2, e3), exact.
__device__ __forceinline__ void int8x4_to_halves(u32 w, u32& p01, u32& p23) {
  // flip the sign bit: byte u = e + 128; half (0x64 << 8 | u) = 1024 + u; minus 1152 = e
  const u32 u = w ^ 0x80808080u;
  p01 = Num<0>::sub(__byte_perm(u, 0x64646464u, 0x4140), 0x64806480u);
  p23 = Num<0>::sub(__byte_perm(u, 0x64646464u, 0x4342), 0x64806480u);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
  return v;
}

// Asynchronous global -> shared copies (sm_80+), 16 bytes each, through L2 only (.cg). An invalid source copies
// nothing and zero-fills the 16 bytes. Groups of copies are committed and waited for in order: wait_group<N>
// returns once at most N of the thread's committed groups are still in flight.
__device__ __forceinline__ void cp_async16(void* shared, const void* global, bool valid) {
  const u32 address = (u32)__cvta_generic_to_shared(shared);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(address), "l"(global), "r"(valid ? 16 : 0)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Programmatic dependent launch (sm_90+; kernels/launch.py sets the launch attribute). A kernel first lets
// the next kernel of the stream launch (its CTAs then start as soon as they fit, while this grid runs), and
// reads nothing an earlier grid wrote before `wait_for_prior_grids` returns, i.e. before that grid has
// completed and its writes are visible. Every kernel waits, in every CTA, before its first such read and
// before its first write, so a grid never completes before the one it follows: ordering stays transitive
// along the stream. Before the wait a kernel may only touch what no kernel writes (its weights).
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
