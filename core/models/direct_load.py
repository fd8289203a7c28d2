"""Direct load: a GPTQ or AWQ directory or a GGUF file runs on the packed path without `deepinfer convert`.

The loader converts it into memory through the converters themselves (core/weights/convert: the same
ConversionSource that `deepinfer convert` writes from), layer by layer into a model built on the meta
device (core/models/assembly.py), with a progress bar. What each projection becomes:

    GPTQ 3/4-bit (v1, v2, act-order, sym or asym), AWQ GEMM    W4A16 / W3A16, re-packed exactly
    GGUF Q4_0, Q4_1, Q4_K                                       W4A16, re-packed exactly
    GGUF Q8_0                                                   W8A16, re-packed exactly
    GGUF Q5_K, Q6_K (the more-bits tensors of a Q4_K_M file),   W8A16, round-to-nearest, group 32: never
         Q5_0, Q5_1, Q2_K, Q3_K ... (every other quantized type)   fewer bits than stored
    GGUF F32, F16, BF16                                          dense, in the model dtype

An exact conversion costs about what reading the file costs and is made at every load. One with a
round-to-nearest tensor is lossy and slower, so its result is kept in the conversion cache
(core/weights/convert/cache.py) and later loads read that (EngineConfig.convert_cache off: converted in
memory every time, nothing written). One line at load says what the checkpoint runs as.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepinfer.core.models.assembly import check_complete, put_dense, put_layer
from deepinfer.core.models.decoder import DecoderModel
from deepinfer.core.models.spec import ModelSpec
from deepinfer.core.weights.convert.gguf import EXACT_8BIT_TYPES, EXACT_TYPES, FLOAT_TYPES
from deepinfer.core.weights.convert.run import open_source
from deepinfer.core.weights.convert.source import LINEAR_NAMES, ConversionSource, ConvertOptions
from deepinfer.core.weights.convert.summary import ConversionSummary

# The options every direct load converts with: GGUF at no fewer bits than stored (GPTQ and AWQ take none).
GGUF_DIRECT_OPTIONS = ConvertOptions(keep_8bit=True, dense_float=True)
# Bytes per weight in the converted form (codes, plus fp32 scale and zero per group of 32 at most).
_PACKED_BYTES_PER_WEIGHT = {4: 0.5 + 8 / 32, 8: 1 + 8 / 32}
_DENSE_BYTES_PER_WEIGHT = 4  # dense tensors of a GGUF are kept float32 (GGUFSource with dense_float)


@dataclass(frozen=True)
class DirectPlan:
    """What a direct load does with one checkpoint."""

    options: ConvertOptions
    runs_as: str  # one line: what every projection becomes
    lossy: bool  # some projection is round-to-nearest: the conversion is worth caching
    converted_bytes: int  # about what the converted checkpoint takes (cache entry, free-space check)


def open_direct_source(kind: str, path: Path) -> ConversionSource:
    """The conversion source a direct load of `path` (a "gptq" | "awq" | "gguf" checkpoint) reads."""
    return open_source(path, GGUF_DIRECT_OPTIONS if kind == "gguf" else ConvertOptions())


def plan_direct_load(source: ConversionSource, name: str) -> DirectPlan:
    if source.kind == "gguf":
        return _gguf_plan(source, name)
    scheme = source.quant_scheme
    bits = int(scheme["bits"])
    group = "per-channel" if int(scheme["group_size"]) == -1 else f"group {scheme['group_size']}"
    details = [source.kind.upper(), f"{bits}-bit", group]
    if scheme.get("desc_act"):
        details.append("act-order")
    if source.kind == "gptq":
        details += ["sym" if scheme.get("sym") else "asym", str(scheme.get("checkpoint_format"))]
    else:
        details.append("zero point" if scheme.get("zero_point") else "sym")
    runs_as = f"{name} runs as W{bits}A16 ({', '.join(details)}: re-packed exactly at load)"
    return DirectPlan(ConvertOptions(), runs_as, lossy=False, converted_bytes=0)


def _gguf_plan(source: Any, name: str) -> DirectPlan:
    """Counts of the GGUF's projections by stored type, and what each type becomes."""
    types: Counter[str] = Counter()
    converted = 0.0
    for hf_name, tensor in source.tensors.items():
        module, _, kind = hf_name.rpartition(".")
        numel = int(tensor.n_elements)
        if kind == "weight" and module.rpartition(".")[2] in LINEAR_NAMES:
            type_name = tensor.tensor_type.name
            types[type_name] += 1
            bits = 4 if type_name in EXACT_TYPES else None if type_name in FLOAT_TYPES else 8
            converted += numel * (_DENSE_BYTES_PER_WEIGHT if bits is None else _PACKED_BYTES_PER_WEIGHT[bits])
        else:
            converted += numel * _DENSE_BYTES_PER_WEIGHT
    parts, lossy = [], False
    for type_name, count in sorted(types.items(), key=lambda item: -item[1]):
        if type_name in EXACT_TYPES:
            target = "W4A16, exact"
        elif type_name in EXACT_8BIT_TYPES:
            target = "W8A16, exact"
        elif type_name in FLOAT_TYPES:
            target = "dense"
        else:
            target = "W8A16, round-to-nearest group 32"
            lossy = True
        parts.append(f"{count} {type_name} -> {target}")
    runs_as = f"{name} runs as: projections {'; '.join(parts)}; embeddings and norms dense"
    return DirectPlan(GGUF_DIRECT_OPTIONS, runs_as, lossy, int(converted))


@torch.no_grad()
def build_from_source(source: ConversionSource, spec: ModelSpec, dtype: torch.dtype, device: Any,
                      max_positions: int, progress: Callable[[int, int, str], None], where: str) -> DecoderModel:
    """The model `source` converts to, converted into memory layer by layer on `device`."""
    summary = ConversionSummary(source.kind)  # the converters record what they did; nothing reads it here
    model = DecoderModel.on_meta(spec, dtype, device, max_positions)
    total = spec.num_layers + 1
    progress(0, total, "embeddings")
    put_dense(model, source.convert_embeddings(summary), device)
    for index in range(spec.num_layers):
        progress(1 + index, total, f"layer {index}")
        layer = source.convert_layer(index, summary)
        put_layer(model, layer.dense, layer.packed, device, dtype)
    progress(total, total, "done")
    check_complete(model, where)
    model.requires_grad_(False)
    return model.eval()


@contextmanager
def load_progress(description: str) -> Iterator[Callable[[int, int, str], None]]:
    """A progress bar on stderr (drawn on a terminal only) and the callback that moves it."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    columns = (TextColumn(f"{description} " + "{task.description:<12}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("", total=None)
        yield lambda done, total, what: bar.update(task, completed=done, total=total, description=what)


def say(line: str) -> None:
    """One line on stderr: what a checkpoint runs as, where its conversion went."""
    from rich.console import Console

    Console(stderr=True, soft_wrap=True).print(line, markup=False, highlight=False)
