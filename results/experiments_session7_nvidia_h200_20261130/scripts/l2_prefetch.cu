// EXPERIMENT: pull byte ranges into L2 ahead of the kernels that will read them.
#include "common.cuh"

__global__ void __launch_bounds__(128) l2_prefetch_kernel(
    u64 p0, u64 n0, u64 p1, u64 n1, u64 p2, u64 n2, u64 p3, u64 n3, int chunk) {
  launch_dependents();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const u64 ptrs[4] = {p0, p1, p2, p3};
  const u64 sizes[4] = {n0, n1, n2, n3};
  const int thread = blockIdx.x * blockDim.x + threadIdx.x, threads = gridDim.x * blockDim.x;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const u64 n = sizes[r] & ~15ull;
    for (u64 off = (u64)thread * chunk; off < n; off += (u64)threads * chunk) {
      const u32 bytes = (u32)(n - off < (u64)chunk ? n - off : (u64)chunk);
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(ptrs[r] + off), "r"(bytes) : "memory");
    }
  }
#endif
  wait_for_prior_grids();
}
