"""Load-time weight-only quantization: EngineConfig.quantization = "w4a16" | "w3a16".

Every projection of every decoder layer (q/k/v/o_proj, gate/up/down_proj) becomes a QuantLinear
(core/quant/quant_linear.py); embeddings, norms and an untied LM head stay in the model dtype.

- Real weights: round-to-nearest (core/quant/rtn.py: asymmetric, group 128, or 64/32 where 128
  does not divide the input features). The model is loaded on the host and quantized one
  projection at a time on the target device, so the device never holds the unquantized model.
- Dummy weights with a shape: no RTN. The model is built on the meta device and each projection
  gets random packed codes made directly on the target device (speed does not depend on weight
  values), so a 7B body never exists in fp16 anywhere and loads in seconds.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch
from torch import nn

from deepinfer.core.config import EngineConfig
from deepinfer.core.errors import ModelLoadError
from deepinfer.core.quant.packed import PackedWeight
from deepinfer.core.quant.quant_linear import QuantLinear
from deepinfer.core.quant.rtn import default_group_size, quantize_rtn

logger = logging.getLogger(__name__)

QUANT_BITS = {"w4a16": 4, "w3a16": 3}
RTN_GROUP_SIZE = 128
DUMMY_WEIGHT_STD = 0.02  # what DecoderModel.init_dummy_weights draws dense weights with


def load_quantized_model(config: EngineConfig, device: torch.device, dtype: torch.dtype):
    """-> core.models.loader.LoadedModel with QuantLinear projections on `device`."""
    from deepinfer.core.models.loader import load_model

    bits = QUANT_BITS[config.quantization]
    start = time.perf_counter()
    if config.dummy_weights and config.shape is not None:
        loaded = _load_dummy_quantized(config, device, dtype, bits)
    else:
        loaded = load_model(config, torch.device("cpu"), dtype)
        quantize_linears(loaded.model, bits, device, dtype, random_codes=config.dummy_weights, seed=config.seed)
        loaded.model.to(device)
    logger.info("quantized %s to %s in %.1f s", loaded.name, config.quantization, time.perf_counter() - start)
    return loaded


@torch.no_grad()
def quantize_linears(model: nn.Module, bits: int, device: torch.device, dtype: torch.dtype,
                     random_codes: bool = False, seed: int = 0) -> int:
    """Replace every nn.Linear of the decoder layers by a QuantLinear on `device`, one at a time (the
    rest of the model stays where it is). random_codes: dummy weights, codes drawn at random and
    biases zero (as DecoderModel.init_dummy_weights makes them), the linears' own tensors unread, so
    they may be on the meta device. Returns how many were replaced (linears that are already
    QuantLinear, e.g. from a layered checkpoint, stay as they are)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    count = 0
    for index, layer in enumerate(model.model.layers):
        for name, parent, child, linear in _linears(layer):
            try:
                if random_codes:
                    bias = None if linear.bias is None else torch.zeros(linear.out_features, dtype=dtype, device=device)
                    packed = random_packed_weight(linear.out_features, linear.in_features, bits, device,
                                                  generator, bias)
                else:
                    bias = None if linear.bias is None else linear.bias.to(device=device, dtype=dtype)
                    group_size = default_group_size(linear.in_features, RTN_GROUP_SIZE)
                    packed = quantize_rtn(linear.weight.to(device), bits, group_size, bias=bias)
            except ValueError as err:
                raise ModelLoadError(f"cannot quantize model.layers.{index}.{name}: {err}") from None
            setattr(parent, child, QuantLinear(packed))
            count += 1
    return count


def random_packed_weight(out_features: int, in_features: int, bits: int, device: torch.device,
                         generator: torch.Generator, bias: torch.Tensor | None = None) -> PackedWeight:
    """Uniform random codes with one scale, zero point mid-range: dequantized values have mean ~0
    and std DUMMY_WEIGHT_STD, like the dense dummy weights."""
    group_size = default_group_size(in_features, RTN_GROUP_SIZE)
    groups = in_features // group_size
    words = in_features * bits // 32
    qweight = torch.randint(-2**31, 2**31, (out_features, words), dtype=torch.int32, device=device,
                            generator=generator)
    code_std = ((4**bits - 1) / 12) ** 0.5  # std of a uniform code in [0, 2**bits)
    scales = torch.full((out_features, groups), DUMMY_WEIGHT_STD / code_std, dtype=torch.float16, device=device)
    zeros = torch.full((out_features, groups), 2 ** (bits - 1), dtype=torch.float16, device=device)
    return PackedWeight(qweight, scales, zeros, bits, group_size, in_features, out_features, bias=bias)


def _linears(layer: nn.Module) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    """(qualified name, parent, attribute, linear) of every nn.Linear inside `layer`."""
    found = []
    for parent_name, parent in layer.named_modules():
        for child, module in parent.named_children():
            if isinstance(module, nn.Linear):
                found.append((f"{parent_name}.{child}".lstrip("."), parent, child, module))
    return found


@torch.no_grad()
def _load_dummy_quantized(config: EngineConfig, device: torch.device, dtype: torch.dtype, bits: int):
    from deepinfer.core.models.decoder import DecoderModel
    from deepinfer.core.models.loader import LoadedModel, dummy_tokenizer, shape_file_path
    from deepinfer.core.models.spec import ModelSpec
    from deepinfer.core.weights.hf_safetensors import read_json

    shape_file = shape_file_path(config.shape)
    spec = ModelSpec.from_hf_config(read_json(shape_file))
    max_positions = max(config.max_model_len or 0, spec.max_position_embeddings)
    model = DecoderModel(spec, dtype=dtype, device="meta", max_positions=max_positions)
    # Derived buffers (rotary tables, embedding scale) from a layer-less twin built on the device.
    twin_spec = replace(spec, num_layers=0, sliding_windows=(), vocab_size=1, tie_word_embeddings=True)
    twin = DecoderModel(twin_spec, dtype=dtype, device=device, max_positions=max_positions)
    for name, buffer in twin.named_buffers():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        module.register_buffer(attr, buffer, persistent=attr not in module._non_persistent_buffers_set)
    quantize_linears(model, bits, device, dtype, random_codes=True, seed=config.seed)
    for module in model.modules():  # what is left on meta: embedding, norms, untied head
        for attr, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                setattr(module, attr, nn.Parameter(torch.empty_like(param, device=device), requires_grad=False))
    model.init_dummy_weights(config.seed)
    model.requires_grad_(False)
    return LoadedModel(spec, model.eval(), dummy_tokenizer(spec), "dummy", f"dummy-{shape_file.stem}")
