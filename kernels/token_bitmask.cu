// Structured outputs' token mask applied in place to fp32 logits: logits[rows[c], v] = -inf wherever bit
// v % 32 of bitmask[c][v / 32] is clear (llguidance's layout: bit j of word w allows token 32 w + j).
// grid (ceil(vocab / TOKENS_PER_CTA), C), 256 threads; a thread takes 4 tokens 256 apart, so a warp's 32
// lanes read one mask word (a broadcast) and store to 32 consecutive logits. Allowed logits are neither
// read nor written, and rows not in `rows` are untouched.
#include "common.cuh"

constexpr int TOKENS_PER_CTA = 1024;

__global__ void __launch_bounds__(256) token_bitmask_kernel(
    float* __restrict__ logits,       // [N, vocab] fp32, rows logits_stride apart
    const int* __restrict__ rows,     // [C] the masked rows of logits
    const u32* __restrict__ bitmask,  // [C, words], words >= ceil(vocab / 32)
    int vocab, int words, i64 logits_stride) {
  launch_dependents();
  wait_for_prior_grids();  // rows and bitmask come from a copy queued before this step's forward
  const int c = blockIdx.y;
  float* row = logits + (i64)rows[c] * logits_stride;
  const u32* mask = bitmask + (i64)c * words;
#pragma unroll
  for (int k = 0; k < TOKENS_PER_CTA / 256; ++k) {
    const int v = blockIdx.x * TOKENS_PER_CTA + k * 256 + threadIdx.x;
    if (v < vocab && !((mask[v >> 5] >> (v & 31)) & 1u)) row[v] = -INFINITY;
  }
}
