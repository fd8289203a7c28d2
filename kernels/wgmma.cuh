// wgmma (SM90a) with A from registers, for the W4 kernels that feed the tensor cores unpacked weights
// (kernels/w4_gemm.cu, kernels/w4_fragment_batch.cu). Built for sm_90a (kernels/compiler.py: ARCH_SPECIFIC_SOURCES),
// HAS_WGMMA is defined and wgmma_rs issues the instruction; elsewhere it traps and the callers take mma.sync.
#include "common.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define HAS_WGMMA 1
#endif

// wgmma.mma_async m64nNk16, D (fp32, N / 2 registers a thread) += A (4 registers of pairs) x B (shared memory at
// `desc`). The asm only issues the operation: D and A stay in use until wgmma_wait says the group is done.
template <int DT, int N> __device__ __forceinline__ void wgmma_rs(float* d, const u32 (&a)[4], u64 desc);

__device__ __forceinline__ void wgmma_fence() {
#ifdef HAS_WGMMA
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#ifdef HAS_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#ifdef HAS_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#endif
}
// Tells the compiler a register is read and written here, so it keeps an asynchronous operand in place until then.
__device__ __forceinline__ void hold(u32& r) { asm volatile("" : "+r"(r)::"memory"); }
__device__ __forceinline__ void hold(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// Shared-memory matrix descriptor of a K-major operand in 128-byte rows with the 128-byte swizzle: 8-row groups
// 1024 bytes apart (stride offset), the leading offset unused; `start` is 1024-byte aligned plus the k offset.
__device__ __forceinline__ u64 swizzled_desc(const void* start) {
  const u32 address = (u32)__cvta_generic_to_shared(start);
  return (u64)((address & 0x3FFFF) >> 4) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

#ifdef HAS_WGMMA
#define W4_WGMMA_RS(DT, N, TYPE, DREGS, OPERANDS, ...)                                                          \
  template <>                                                                                                   \
  __device__ __forceinline__ void wgmma_rs<DT, N>(float* d, const u32(&a)[4], u64 desc) {                       \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                                     \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " {" DREGS "}, " OPERANDS     \
                 ", p, 1, 1, 0;\n}\n"                                                                           \
                 : __VA_ARGS__                                                                                  \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));                                      \
  }
#define W4_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                 "+f"(d[i + 6]), "+f"(d[i + 7])
#define W4_REGS8(a, b, c, e, f, g, h, i) "%" #a ", %" #b ", %" #c ", %" #e ", %" #f ", %" #g ", %" #h ", %" #i
#define W4_N16_REGS W4_REGS8(0, 1, 2, 3, 4, 5, 6, 7)
#define W4_N32_REGS W4_N16_REGS ", " W4_REGS8(8, 9, 10, 11, 12, 13, 14, 15)
#define W4_N48_REGS W4_N32_REGS ", " W4_REGS8(16, 17, 18, 19, 20, 21, 22, 23)
#define W4_N64_REGS W4_N48_REGS ", " W4_REGS8(24, 25, 26, 27, 28, 29, 30, 31)
#define W4_N128_REGS W4_N64_REGS ", " W4_REGS8(32, 33, 34, 35, 36, 37, 38, 39) ", " \
                     W4_REGS8(40, 41, 42, 43, 44, 45, 46, 47) ", " W4_REGS8(48, 49, 50, 51, 52, 53, 54, 55) ", " \
                     W4_REGS8(56, 57, 58, 59, 60, 61, 62, 63)
#define W4_N256_REGS W4_N128_REGS ", " W4_REGS8(64, 65, 66, 67, 68, 69, 70, 71) ", " \
                     W4_REGS8(72, 73, 74, 75, 76, 77, 78, 79) ", " W4_REGS8(80, 81, 82, 83, 84, 85, 86, 87) ", " \
                     W4_REGS8(88, 89, 90, 91, 92, 93, 94, 95) ", " W4_REGS8(96, 97, 98, 99, 100, 101, 102, 103) ", " \
                     W4_REGS8(104, 105, 106, 107, 108, 109, 110, 111) ", " \
                     W4_REGS8(112, 113, 114, 115, 116, 117, 118, 119) ", " \
                     W4_REGS8(120, 121, 122, 123, 124, 125, 126, 127)
#define W4_D32(i) W4_D8(i), W4_D8(i + 8), W4_D8(i + 16), W4_D8(i + 24)
W4_WGMMA_RS(0, 16, "f16", W4_N16_REGS, "{%8, %9, %10, %11}, %12", W4_D8(0))
W4_WGMMA_RS(1, 16, "bf16", W4_N16_REGS, "{%8, %9, %10, %11}, %12", W4_D8(0))
W4_WGMMA_RS(0, 32, "f16", W4_N32_REGS, "{%16, %17, %18, %19}, %20", W4_D8(0), W4_D8(8))
W4_WGMMA_RS(1, 32, "bf16", W4_N32_REGS, "{%16, %17, %18, %19}, %20", W4_D8(0), W4_D8(8))
W4_WGMMA_RS(0, 48, "f16", W4_N48_REGS, "{%24, %25, %26, %27}, %28", W4_D8(0), W4_D8(8), W4_D8(16))
W4_WGMMA_RS(1, 48, "bf16", W4_N48_REGS, "{%24, %25, %26, %27}, %28", W4_D8(0), W4_D8(8), W4_D8(16))
W4_WGMMA_RS(0, 64, "f16", W4_N64_REGS, "{%32, %33, %34, %35}, %36", W4_D8(0), W4_D8(8), W4_D8(16), W4_D8(24))
W4_WGMMA_RS(1, 64, "bf16", W4_N64_REGS, "{%32, %33, %34, %35}, %36", W4_D8(0), W4_D8(8), W4_D8(16), W4_D8(24))
W4_WGMMA_RS(0, 128, "f16", W4_N128_REGS, "{%64, %65, %66, %67}, %68", W4_D32(0), W4_D32(32))
W4_WGMMA_RS(1, 128, "bf16", W4_N128_REGS, "{%64, %65, %66, %67}, %68", W4_D32(0), W4_D32(32))
W4_WGMMA_RS(0, 256, "f16", W4_N256_REGS, "{%128, %129, %130, %131}, %132", W4_D32(0), W4_D32(32), W4_D32(64),
            W4_D32(96))
W4_WGMMA_RS(1, 256, "bf16", W4_N256_REGS, "{%128, %129, %130, %131}, %132", W4_D32(0), W4_D32(32), W4_D32(64),
            W4_D32(96))
#undef W4_WGMMA_RS
#undef W4_D8
#undef W4_REGS8
#undef W4_N16_REGS
#undef W4_N32_REGS
#undef W4_N48_REGS
#undef W4_N64_REGS
#undef W4_N128_REGS
#undef W4_N256_REGS
#undef W4_D32
#else
template <int DT, int N> __device__ __forceinline__ void wgmma_rs(float*, const u32 (&)[4], u64) { __trap(); }
#endif
