"""PackedWeight: a weight-only quantized linear weight (3, 4 or 8 bits) as deepinfer stores and runs it.

One layout for every source (GPTQ, AWQ, GGUF, round-to-nearest), shared by the torch reference
(core/quant) and the CUDA kernels (kernels/), so conversion is the only place formats differ.

For a linear `y = x @ W.T` with W: [out_features N, in_features K] and group size G (G = K means
per-channel):

    qweight: int32 [N, K * bits // 32]   row n holds the K codes of output channel n, packed along K:
             bits=4: 8 codes per word, code j of word w is k = 8w + j, at bits 4j..4j+3;
             bits=3: 32 codes per 3 consecutive words (a 96-bit little-endian run), code j at bit 3j;
             bits=8: 4 codes per word, code j of word w is k = 4w + j, at bits 8j..8j+7.
             Codes are unsigned, 0 .. 2**bits - 1.
    scales:  [N, K // G] float16 (float32 only where a source's scales are not fp16-exact)
    zeros:   [N, K // G] same dtype as scales: a float zero point.
    zero_mode "zero": W[n, k] = (q - zeros[n, g]) * scales[n, g]       GPTQ, AWQ, Q4_0, Q8_0, RTN
              "min":  W[n, k] = q * scales[n, g] + zeros[n, g]          GGUF Q4_1, Q4_K (zeros hold the min)
    g = k // G, after the optional input permutation:
    input_perm: int32 [K] or None. GPTQ act-order (desc_act) checkpoints are re-sorted at conversion
             so groups are contiguous; the layer then computes W' @ x[input_perm].
    bias: [N] or None, in the model dtype.

The CUDA kernels (kernels/) take 3, 4 and 8 bits: 8-bit weights (GGUF Q8_0 kept exactly, a GGUF's other
types converted to 8 bits, `deepinfer convert --keep-8bit` / `--bits 8`) on kernels/w8_gemm.cu.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

SUPPORTED_BITS = (3, 4, 8)


@dataclass
class PackedWeight:
    qweight: torch.Tensor  # int32 [N, K * bits // 32]
    scales: torch.Tensor  # [N, K // group_size]
    zeros: torch.Tensor  # [N, K // group_size]
    bits: int  # 4, 3 or 8
    group_size: int  # 32, 64, 128 or K (per-channel)
    in_features: int  # K
    out_features: int  # N
    zero_mode: str = "zero"  # "zero" | "min"
    input_perm: torch.Tensor | None = None  # int32 [K]
    bias: torch.Tensor | None = None  # [N]
    # Every zero point a whole number (GPTQ, AWQ, Q4_0, RTN): then q - z is exact in fp16/bf16 and the
    # tensor-core GEMV can scale each group's sum once instead of every weight (kernels/quant_matmul.cu).
    integer_zeros: bool = field(init=False)

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be 3, 4 or 8, got {self.bits}")
        if self.zero_mode not in ("zero", "min"):
            raise ValueError(f"zero_mode must be 'zero' or 'min', got {self.zero_mode!r}")
        if self.in_features % self.group_size or self.in_features % 32:
            raise ValueError(f"in_features {self.in_features} must be a multiple of 32 and of the group size {self.group_size}")
        expected = {
            "qweight": (self.out_features, self.in_features * self.bits // 32),
            "scales": (self.out_features, self.in_features // self.group_size),
            "zeros": (self.out_features, self.in_features // self.group_size),
        }
        for name, shape in expected.items():
            actual = tuple(getattr(self, name).shape)
            if actual != shape:
                raise ValueError(f"{name} has shape {actual}, expected {shape}")
        self.integer_zeros = bool(torch.equal(self.zeros, torch.round(self.zeros)))
