"""The tensors a weight file declares, checked against the model its config describes, before the
model is allocated.

Config numbers within their sane maxima (core/models/spec.py) can still describe a model far
larger than the file: 1024 layers of hidden size 65536 from a 1 MB file would allocate terabytes
before the first missing tensor is noticed. Comparing the declared names and shapes (read from
the file's header, no data) with the parameters of the decoder the spec builds (on the meta
device, so no memory either) bounds the allocation by what the file really holds.
"""

from __future__ import annotations

import re
from typing import Any

from deepinfer.core.errors import ModelLoadError

# Tensors checkpoints carry that the model derives itself (the decoder ignores them too).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def expected_tensor_shapes(spec: Any) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every parameter of the decoder `spec` describes (built on the meta device)."""
    import torch

    from deepinfer.core.models.decoder import DecoderModel

    model = DecoderModel(spec, dtype=torch.float32, device="meta", max_positions=2)
    return {name: tuple(param.shape) for name, param in model.named_parameters()}


def check_tensors_match_spec(spec: Any, shapes: dict[str, tuple[int, ...]], where: str,
                             layers_field: str = "num_hidden_layers") -> None:
    """`shapes` (HF name -> shape, as the file declares them) hold exactly the parameters of `spec`'s
    model: no missing or surplus layer, no unknown name, every shape equal. `layers_field` names the
    config field that gave the layer count (GGUF and HF call it differently)."""
    present_layers = {int(match.group(1)) for name in shapes if (match := _LAYER_INDEX.match(name))}
    layers_with_tensors = len(present_layers)
    if present_layers and (max(present_layers) >= spec.num_layers or layers_with_tensors < spec.num_layers):
        raise ModelLoadError(f"{where}: {layers_field} is {spec.num_layers}, but the file holds tensors of "
                             f"{layers_with_tensors} layers (indices up to {max(present_layers)})")
    expected = expected_tensor_shapes(spec)
    for name, shape in shapes.items():
        if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and spec.tie_word_embeddings):
            continue
        if name not in expected:
            raise ModelLoadError(f"{where}: tensor {name!r} has no place in the {spec.family} model its config "
                                 f"describes")
        if tuple(shape) != expected[name]:
            raise ModelLoadError(f"{where}: tensor {name!r} has shape {tuple(shape)}, the model expects "
                                 f"{expected[name]} (from the config's sizes)")
    missing = [name for name in expected if name not in shapes]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ModelLoadError(f"{where}: lacks {len(missing)} tensor(s) the model its config describes needs: {shown}")
