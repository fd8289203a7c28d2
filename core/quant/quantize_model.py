"""Round-to-nearest quantization of a loaded model in place: every projection nn.Linear -> QuantLinear.

For EngineConfig.quantization ("w4a16" | "w3a16"): the loader calls `quantize_projections_rtn` on a
model it has loaded unquantized. Offline, `deepinfer convert` does the same once and stores the result.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.core.quant.quant_linear import QuantLinear
from deepinfer.core.quant.rtn import default_group_size, quantize_rtn

# HF's leaf names of the decoder's projections (the embedding and lm_head stay unquantized)
PROJECTION_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                    "qkv_proj", "gate_up_proj")  # the last two: merged by core/models/merged_projections.py
BITS_OF_SCHEME = {"w4a16": 4, "w3a16": 3}


@torch.no_grad()
def quantize_projections_rtn(model: nn.Module, bits: int = 4, group_size: int | None = None,
                             sym: bool = False) -> int:
    """Swap each projection for a QuantLinear on the same device; returns how many were swapped.

    group_size None: 128, or 64 / 32 for a projection whose in_features 128 does not divide.
    """
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and name.rpartition(".")[2] in PROJECTION_NAMES]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        group = group_size or default_group_size(linear.in_features)
        packed = quantize_rtn(linear.weight.float(), bits, group, sym, bias=linear.bias)
        setattr(model.get_submodule(parent_name), child, QuantLinear(packed).to(linear.weight.device))
    return len(targets)
