"""Pack, unpack and dequantize PackedWeight codes: the torch reference every other path is checked against.

Codes are packed as one little-endian bit stream along the packed dimension, cut into 32-bit words:
bits=4 puts 8 codes in each word (code j at bits 4j..4j+3), bits=8 puts 4 (code j at bits 8j..8j+7);
bits=3 puts 32 codes in 3 words, two of which straddle a word boundary (codes 10 and 21). GPTQ packs its int32 words the same way, only
along a different dimension, so its converter reuses these with a transpose.
"""

from __future__ import annotations

import torch

from deepinfer.core.quant.packed import PackedWeight

_WORD_MASK = 0xFFFFFFFF


def codes_per_run(bits: int) -> tuple[int, int]:
    """(codes, words) of the shortest run of codes that fills whole int32 words: (8, 1), (32, 3) or (4, 1)."""
    if bits in (4, 8):
        return 32 // bits, 1
    if bits == 3:
        return 32, 3
    raise ValueError(f"bits must be 3, 4 or 8, got {bits}")


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> the int32 with the same 32 bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., L] integers in [0, 2**bits) -> int32 [..., L * bits // 32], packed along the last dim."""
    run_codes, run_words = codes_per_run(bits)
    length = codes.shape[-1]
    if length % run_codes:
        raise ValueError(f"cannot pack {length} codes of {bits} bits: need a multiple of {run_codes}")
    codes = codes.to(torch.int64)
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= 2**bits):
        raise ValueError(f"codes must lie in [0, {2**bits}) for {bits}-bit packing")
    runs = codes.reshape(*codes.shape[:-1], length // run_codes, run_codes)  # [..., R, run_codes]
    if run_words == 1:  # codes never straddle words: shift each into place and add (bits are disjoint)
        shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=codes.device)
        return _to_int32((runs << shifts).sum(dim=-1))
    words = torch.zeros(*runs.shape[:-1], run_words, dtype=torch.int64, device=codes.device)  # [..., R, run_words]
    for j in range(run_codes):
        word, shift = divmod(bits * j, 32)
        code = runs[..., j]
        words[..., word] |= (code << shift) & _WORD_MASK
        if shift + bits > 32:  # the code's high bits spill into the next word
            words[..., word + 1] |= code >> (32 - shift)
    return _to_int32(words.reshape(*codes.shape[:-1], length * bits // 32))


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., W] -> codes int32 [..., W * 32 // bits]; the inverse of pack_codes."""
    run_codes, run_words = codes_per_run(bits)
    num_words = packed.shape[-1]
    if num_words % run_words:
        raise ValueError(f"cannot unpack {num_words} words of {bits}-bit codes: need a multiple of {run_words}")
    mask = 2**bits - 1
    if run_words == 1:  # codes never straddle words: one shift per code position, in int32
        shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
        codes = (packed.to(torch.int32)[..., None] >> shifts) & mask  # [..., W, 32 // bits]
        return codes.reshape(*packed.shape[:-1], num_words * run_codes)
    words = packed.to(torch.int64) & _WORD_MASK
    words = words.reshape(*packed.shape[:-1], num_words // run_words, run_words)  # [..., R, run_words]
    codes = torch.empty(*words.shape[:-1], run_codes, dtype=torch.int64, device=packed.device)
    for j in range(run_codes):
        word, shift = divmod(bits * j, 32)
        code = words[..., word] >> shift
        if shift + bits > 32:
            code = code | (words[..., word + 1] << (32 - shift))
        codes[..., j] = code & mask
    return codes.reshape(*packed.shape[:-1], num_words * 32 // bits).to(torch.int32)


def pack_weight(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    zero_mode: str = "zero",
    input_perm: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> PackedWeight:
    """codes [N, K] (already in input_perm order), scales/zeros [N, K // G] -> PackedWeight."""
    out_features, in_features = codes.shape
    num_groups = scales.shape[-1]
    if num_groups == 0 or in_features % num_groups:
        raise ValueError(f"{num_groups} groups do not divide {in_features} input features")
    return PackedWeight(
        qweight=pack_codes(codes, bits),
        scales=scales.contiguous(),
        zeros=zeros.to(scales.dtype).contiguous(),
        bits=bits,
        group_size=in_features // num_groups,
        in_features=in_features,
        out_features=out_features,
        zero_mode=zero_mode,
        input_perm=None if input_perm is None else input_perm.to(torch.int32).contiguous(),
        bias=bias,
    )


def dequantize(packed: PackedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """PackedWeight -> W [N, K] in the original input order, so that y = x @ W.T (+ bias).

    Computed in float32 with the same operations in the same order as the sources' own formulas
    ((q - z) * s for GPTQ/AWQ/Q4_0/Q8_0, q * s + m for Q4_1/Q4_K), so a converted weight equals the
    source's dequantized weight bit for bit; only then cast to `dtype`.
    """
    num_groups = packed.in_features // packed.group_size
    codes = unpack_codes(packed.qweight, packed.bits).to(torch.float32)
    codes = codes.reshape(packed.out_features, num_groups, packed.group_size)  # [N, G, group]
    scales = packed.scales.to(torch.float32)[..., None]  # [N, G, 1]
    zeros = packed.zeros.to(torch.float32)[..., None]
    if packed.zero_mode == "zero":
        weight = (codes - zeros) * scales
    else:
        weight = codes * scales + zeros
    weight = weight.reshape(packed.out_features, packed.in_features)
    if packed.input_perm is not None:
        # column j of the stored weight multiplies x[input_perm[j]]; put it back at input_perm[j]
        unpermuted = torch.empty_like(weight)
        unpermuted[:, packed.input_perm.long()] = weight
        weight = unpermuted
    return weight.to(dtype)
