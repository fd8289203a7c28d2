"""The sampling defaults a model ships: temperature, top_p, top_k, min_p, repetition_penalty, and the
presence and frequency penalties.

Where they are read from, by source kind:
- HF directory and layered checkpoint: `generation_config.json` (the converter copies an HF source's
  and writes a GGUF source's, core/weights/convert/), keys of the same names. As vLLM does, only
  these keys are read (`do_sample` is not: a file that sets a temperature gets it); HF's
  GenerationConfig has no presence or frequency penalty, so those two are deepinfer's own keys (ollama
  keeps the same two in a Modelfile);
- GGUF: llama.cpp's `general.sampling.*` metadata (gguf-py's Keys.General.SAMPLING_*): temp, top_p,
  top_k, min_p, penalty_repeat (`penalty_last_n` is not read: deepinfer's repetition penalty covers
  the whole prompt and output, as HF's does); llama.cpp defines no key for the other two penalties;
- the default model (SmolLM2-135M-Instruct, whose own generation_config.json holds none): the values
  of core/weights/default_model.py, measured on it.

A value that a request could not hold (a temperature of "hot", a negative top_p) is a ModelLoadError
naming the file. The engine layers the flags over these (core/engine/sampling_params.py SamplingDefaults).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer.core.errors import DeepInferError, ModelLoadError

GENERATION_CONFIG_FILE = "generation_config.json"
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty")
GGUF_SAMPLING_KEYS = {  # field -> llama.cpp's metadata key
    "temperature": "general.sampling.temp",
    "top_p": "general.sampling.top_p",
    "top_k": "general.sampling.top_k",
    "min_p": "general.sampling.min_p",
    "repetition_penalty": "general.sampling.penalty_repeat",
}


@dataclass(frozen=True)
class GenerationDefaults:
    """The model's own sampling defaults (any of SAMPLING_FIELDS) and what holds them."""

    values: dict[str, float | int] = field(default_factory=dict)
    source: str | None = None  # "generation_config.json", "GGUF metadata", ...; None when there are none

    def as_generation_config(self) -> dict[str, float | int]:
        """The values as generation_config.json keys (what a converted checkpoint carries)."""
        return dict(self.values)


def checked(values: dict[str, Any], source: str, where: Path | str) -> GenerationDefaults:
    """GenerationDefaults of `values`, each checked as a request's field would be."""
    from deepinfer.core.engine.sampling_params import SamplingParams

    values = {name: value for name, value in values.items() if value is not None}
    if isinstance(values.get("top_k"), float) and values["top_k"].is_integer():
        values["top_k"] = int(values["top_k"])  # JSON writers give 20.0 for 20
    try:
        params = SamplingParams(**values)
    except DeepInferError as err:
        raise ModelLoadError(f"{where}: sampling default {err}") from None
    return GenerationDefaults({name: getattr(params, name) for name in values}, source if values else None)


def read_generation_config(model_dir: Path) -> GenerationDefaults:
    """The sampling fields of `model_dir/generation_config.json`; none when there is no such file."""
    from deepinfer.core.weights.hf_safetensors import read_json

    path = model_dir / GENERATION_CONFIG_FILE
    if not path.is_file():
        return GenerationDefaults()
    config = read_json(path)
    return checked({name: config.get(name) for name in SAMPLING_FIELDS}, GENERATION_CONFIG_FILE, path)


def read_gguf_sampling(reader: Any, path: Path) -> GenerationDefaults:
    """The `general.sampling.*` metadata of an open GGUF (gguf.GGUFReader); none when it has none."""
    from deepinfer.core.weights.gguf_reader import read_field

    values = {name: read_field(reader, key) for name, key in GGUF_SAMPLING_KEYS.items()}
    return checked(values, "GGUF metadata", path)


def default_model_sampling(path: Path) -> GenerationDefaults:
    """The defaults deepinfer ships for its default model when `path` is that model's file; else none."""
    from deepinfer.core.weights.default_model import DEFAULT_MODEL_FILE, DEFAULT_MODEL_SAMPLING

    if path.name != DEFAULT_MODEL_FILE:
        return GenerationDefaults()
    return GenerationDefaults(dict(DEFAULT_MODEL_SAMPLING), "deepinfer's defaults for this model")


def gguf_generation_defaults(reader: Any, path: Path) -> GenerationDefaults:
    """A GGUF's own metadata when it has any; else deepinfer's values when it is the default model."""
    own = read_gguf_sampling(reader, path)
    return own if own.values else default_model_sampling(path)
