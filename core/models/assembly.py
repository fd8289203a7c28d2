"""Filling a model built on the meta device, one part at a time: dense tensors and packed projections.

Layered checkpoints (read file by file) and direct loads of GPTQ / AWQ / GGUF checkpoints (converted
layer by layer into memory, core/models/direct_load.py) both build their model this way, so no
unquantized copy of a packed projection is ever made.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deepinfer.core.errors import ModelLoadError
from deepinfer.core.models.decoder import DecoderModel
from deepinfer.core.quant.packed import PackedWeight
from deepinfer.core.quant.quantize_model import put_quant_linear


def put_dense(model: DecoderModel, tensors: dict[str, torch.Tensor], device: Any) -> None:
    """Replace the model's (meta) parameters by `tensors` (HF names), each cast to its dtype after a shape check."""
    for name, tensor in tensors.items():
        if name == "lm_head.weight" and model.lm_head is None:
            continue  # tied: the head is the embedding
        try:
            current = model.get_parameter(name)
        except AttributeError:
            raise ModelLoadError(f"checkpoint tensor {name!r} has no place in the model") from None
        if tuple(current.shape) != tuple(tensor.shape):
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(current.shape)}")
        module_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module_name), attr,
                nn.Parameter(tensor.to(device=device, dtype=current.dtype), requires_grad=False))


def put_layer(model: DecoderModel, dense: dict[str, torch.Tensor], packed: dict[str, PackedWeight], device: Any,
              dtype: torch.dtype) -> None:
    """One decoder layer's tensors: dense ones by HF name, packed projections by module name (bias in `dtype`)."""
    put_dense(model, dense, device)
    for name, weight in packed.items():
        if weight.bias is not None:
            weight.bias = weight.bias.to(dtype)
        put_quant_linear(model, name, weight, device)


def check_complete(model: DecoderModel, where: str) -> None:
    """ModelLoadError naming the tensors the checkpoint did not fill (still on the meta device)."""
    missing = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{where}: checkpoint lacks {len(missing)} tensor(s) the model needs: {shown}")
