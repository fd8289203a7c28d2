"""A model's projections as QuantLinears, in place: the one nn.Linear -> QuantLinear swap.

`put_quant_linear` is the swap; every path that quantizes a model goes through it:
- `quantize_projections`: quantization at load time (EngineConfig.quantization "w4a16" | "w3a16",
  core/models/loader.py): round-to-nearest (core/quant/rtn.py: asymmetric, group 128, or 64 / 32
  where 128 does not divide the input features), or random codes for dummy weights;
- the packed weights a layered checkpoint stores (core/models/layered_model.py).
Embeddings, norms and an untied LM head stay in the model dtype. Offline, `deepinfer convert`
quantizes once and stores the result.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.core.errors import ModelLoadError
from deepinfer.core.quant.packed import PackedWeight
from deepinfer.core.quant.quant_linear import QuantLinear
from deepinfer.core.quant.rtn import default_group_size, quantize_rtn

# HF's leaf names of the decoder's projections (the embedding and lm_head stay unquantized)
PROJECTION_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                    "qkv_proj", "gate_up_proj")  # the last two: merged by core/models/merged_projections.py
BITS_OF_SCHEME = {"w4a16": 4, "w3a16": 3}
RTN_GROUP_SIZE = 128
DUMMY_WEIGHT_STD = 0.02  # what DecoderModel.init_dummy_weights draws dense weights with


def put_quant_linear(model: nn.Module, name: str, packed: PackedWeight, device: torch.device | str) -> None:
    """Replace the nn.Linear `name` (e.g. "model.layers.0.self_attn.q_proj") by a QuantLinear of
    `packed` on `device`. ModelLoadError when the model has no such linear or its shape or bias
    presence differs from `packed`'s."""
    parent_name, _, child = name.rpartition(".")
    try:
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, child)
    except AttributeError:
        raise ModelLoadError(f"quantized linear {name!r} has no place in the model") from None
    if not isinstance(linear, nn.Linear):
        raise ModelLoadError(f"{name!r} is not a linear layer of the model")
    if (linear.in_features, linear.out_features) != (packed.in_features, packed.out_features):
        raise ModelLoadError(f"quantized linear {name!r} is {packed.out_features}x{packed.in_features}, "
                             f"the model expects {linear.out_features}x{linear.in_features}")
    if (linear.bias is None) != (packed.bias is None):
        raise ModelLoadError(f"quantized linear {name!r}: bias present in one of checkpoint and model only")
    setattr(parent, child, QuantLinear(packed).to(device))


@torch.no_grad()
def quantize_projections(model: nn.Module, bits: int, *, group_size: int | None = None, sym: bool = False,
                         device: torch.device | None = None, dtype: torch.dtype | None = None,
                         random_codes: bool = False, seed: int = 0) -> int:
    """Swap every projection nn.Linear (PROJECTION_NAMES) for a QuantLinear, one at a time, so the
    device never holds more than one unquantized projection it did not hold before; returns how many
    were swapped (projections that already are QuantLinears, e.g. from a layered checkpoint, stay).

    device: where the QuantLinears go (None: where each linear is); dtype: their bias dtype (None:
    the linear's). group_size None: RTN_GROUP_SIZE, or 64 / 32 where it does not divide in_features.
    random_codes: dummy weights, codes drawn at random from `seed` and biases zero (as
    DecoderModel.init_dummy_weights makes them), the linears' own tensors unread, so they may be on
    the meta device (then `device` and `dtype` are needed)."""
    generator = torch.Generator(device=device or "cpu").manual_seed(seed) if random_codes else None
    # Names, not modules: a swapped linear's dense weight is freed at once.
    names = [name for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and name.rpartition(".")[2] in PROJECTION_NAMES]
    for name in names:
        linear = model.get_submodule(name)
        target = device or linear.weight.device
        try:
            group = group_size or default_group_size(linear.in_features, RTN_GROUP_SIZE)
            if random_codes:
                bias = None if linear.bias is None else torch.zeros(linear.out_features, dtype=dtype, device=target)
                packed = random_packed_weight(linear.out_features, linear.in_features, bits, group, target,
                                              generator, bias)
            else:
                bias = None if linear.bias is None else linear.bias.to(device=target, dtype=dtype or linear.bias.dtype)
                packed = quantize_rtn(linear.weight.to(target), bits, group, sym, bias=bias)
        except ValueError as err:
            raise ModelLoadError(f"cannot quantize {name}: {err}") from None
        put_quant_linear(model, name, packed, target)
    return len(names)


def random_packed_weight(out_features: int, in_features: int, bits: int, group_size: int, device: torch.device,
                         generator: torch.Generator, bias: torch.Tensor | None = None) -> PackedWeight:
    """Uniform random codes with one scale, zero point mid-range: dequantized values have mean ~0
    and std DUMMY_WEIGHT_STD, like the dense dummy weights."""
    if in_features % group_size:
        raise ValueError(f"group size {group_size} does not divide the {in_features} input features")
    groups = in_features // group_size
    words = in_features * bits // 32
    qweight = torch.randint(-2**31, 2**31, (out_features, words), dtype=torch.int32, device=device,
                            generator=generator)
    code_std = ((4**bits - 1) / 12) ** 0.5  # std of a uniform code in [0, 2**bits)
    scales = torch.full((out_features, groups), DUMMY_WEIGHT_STD / code_std, dtype=torch.float16, device=device)
    zeros = torch.full((out_features, groups), 2 ** (bits - 1), dtype=torch.float16, device=device)
    return PackedWeight(qweight, scales, zeros, bits, group_size, in_features, out_features, bias=bias)

