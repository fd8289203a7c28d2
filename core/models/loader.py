"""load_model: the one place a model is built. Read it, quantize it, merge its projections, compact it.

`load_model(config, device, dtype) -> LoadedModel`, ready to run:
1. read (`read_model`): find out what the model path is and read it as its source holds it
   (HF names, projections separate). Sources, in the order they are recognized:
   - `dummy_weights`: the shape of `configs/shapes/<shape>.json` (an HF config.json; or the config
     of `model` when no shape is given), random weights. Tokenizer: the model's own when `model`
     has one, else the default model's if it is already on disk, else a ByteTokenizer.
   Any source's tokenizer gives way to `config.tokenizer` when it is set.
   - no `model`: the default GGUF (fetched once, see core/weights/default_model.py).
   - a `.gguf` file (or a directory holding exactly one): GGUF, run directly (core/models/direct_load.py:
     Q4_0 / Q4_1 / Q4_K projections re-packed exactly to W4A16, Q8_0 to W8A16, other quantized types
     round-to-nearest to W8A16 and cached); dequantized to the model dtype instead (the reference path)
     under DEEPINFER_CPU_WEIGHTS=dense on the CPU, and when `config.quantization` re-quantizes it.
   - a GPTQ or AWQ directory (config.json's quantization_config, or quantize_config.json /
     quant_config.json): run directly, every projection re-packed exactly at load (direct_load.py).
   - a directory whose manifest.json says `"format": "deepinfer-layered"` (core/weights/layered.py):
     its packed W4A16/W3A16 projections become QuantLinears as each layer's file is read, on a model
     built on the meta device, so no unquantized copy of them is ever made.
   - a directory with config.json: HF safetensors.
2. quantize (`config.quantization`, core/quant/quantize_model.py): the model is read on the host
   and its projections quantized one at a time on the target device, so the device never holds the
   unquantized model. Dummy weights with a shape are not read at all: the model is built on the meta
   device and each projection gets random packed codes made on the target device (speed does not
   depend on weight values), so a 7B body never exists in fp16 anywhere and loads in seconds.
3. merge q/k/v and gate/up into one product each (core/models/merged_projections.py).
4. on a GPU, compact: re-lay the weights in fresh allocator segments when the merge left holes
   between them (core/models/compaction.py).
5. on a GPU, lay out the W4 GEMM's scale pairs and the fragment kernel's copies of the projections they serve
   (core/ops/quant_matmul.py: prepare_products; no fragment copies under --max-vram or where they would
   take more than 5% of the device), so they are in place before
   the engine measures its memory and captures its graphs.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deepinfer.core.config import EngineConfig
from deepinfer.core.distributed.parallel_context import ParallelContext
from deepinfer.core.distributed.shard_weights import shard_model
from deepinfer.core.errors import ModelLoadError, UnsupportedModelError
from deepinfer.core.models.assembly import check_complete, put_dense, put_layer
from deepinfer.core.models.compaction import compact_weights
from deepinfer.core.models.decoder import DecoderModel
from deepinfer.core.models.direct_load import (
    build_from_source,
    load_progress,
    open_direct_source,
    plan_direct_load,
    say,
)
from deepinfer.core.models.layers import GatedMLP
from deepinfer.core.models.merged_projections import merge_projections
from deepinfer.core.models.spec import ModelSpec
from deepinfer.core.ops.gate_up_activation import fused_activation
from deepinfer.core.ops.quant_matmul import prepare_products, prepared_bytes
from deepinfer.core.ops.quant_matmul_cpu import cpu_weights_mode
from deepinfer.core.quant.packed import PackedWeight
from deepinfer.core.quant.quant_linear import QuantLinear
from deepinfer.core.quant.quantize_model import BITS_OF_SCHEME, quantize_projections
from deepinfer.core.tokenizer import ByteTokenizer, Tokenizer
from deepinfer.core.weights import hf_safetensors, layered
from deepinfer.core.weights.convert import cache as convert_cache
from deepinfer.core.weights.convert.detect import detect_source as detect_checkpoint_kind
from deepinfer.core.weights.default_model import default_model_path
from deepinfer.core.weights.generation_defaults import (
    GenerationDefaults,
    gguf_generation_defaults,
    read_generation_config,
)
from deepinfer.core.weights.gguf_reader import gguf_spec, iter_gguf_weights, open_gguf, read_field
from deepinfer.core.weights.hub import parse_hub_id, resolve_model

logger = logging.getLogger(__name__)

SHAPES_DIR = Path(str(files("deepinfer.configs") / "shapes"))
FRAGMENT_COPY_SHARE = 0.05  # of the device's memory, at most, for the fragment kernel's weight copies


@dataclass
class LoadedModel:
    spec: ModelSpec
    model: DecoderModel
    tokenizer: Tokenizer | ByteTokenizer
    source_kind: str  # "hf" | "gguf" | "layered" | "dummy"
    name: str
    # The model's own sampling defaults (generation_config.json, GGUF metadata; none for dummy weights).
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)


def load_model(config: EngineConfig, device: torch.device | str, dtype: torch.dtype,
               parallel: ParallelContext | None = None) -> LoadedModel:
    """The model `config` names, ready to run on `device` (see the module docstring); with `parallel`, a
    tensor-parallel rank's shard of it, cut from what was read (core/distributed/shard_weights.py)."""
    device = torch.device(device)
    if config.quantization is None:
        loaded = read_model(config, device, dtype)
    else:
        start = time.perf_counter()
        loaded = _read_quantized(config, device, dtype)
        logger.info("quantized %s to %s in %.1f s", loaded.name, config.quantization, time.perf_counter() - start)
    if config.tokenizer is not None:
        loaded = dataclasses.replace(loaded, tokenizer=load_given_tokenizer(Path(config.tokenizer).expanduser(),
                                                                            loaded.spec))
    if parallel is not None:
        shard_model(loaded.model, parallel)
    merge_projections(loaded.model)  # q/k/v and gate/up: one product each
    if device.type == "cuda":
        compact_weights(loaded.model, device)
        weights, gate_ups = packed_weights(loaded.model)
        prepare_products(weights, dtype, fragments=_room_for_fragment_copies(weights, dtype, gate_ups, config, device),
                         gate_ups=gate_ups)
    return loaded


def packed_weights(model: nn.Module) -> tuple[list[PackedWeight], frozenset[int]]:
    """(every packed weight of the model, the ids of its merged gate/up weights whose activation the fused epilogues
    have): what prepare_products lays out, and prepared_bytes counts."""
    weights = [m.packed for m in model.modules() if isinstance(m, QuantLinear)]
    gate_ups = frozenset(id(m.gate_up_proj.packed) for m in model.modules()
                         if isinstance(m, GatedMLP) and isinstance(m.gate_up_proj, QuantLinear)
                         and fused_activation(m.hidden_act))
    return weights, gate_ups


def _room_for_fragment_copies(weights: list, dtype: torch.dtype, gate_ups: frozenset[int], config: EngineConfig,
                              device: torch.device) -> bool:
    """The fragment kernel reads its own copy of each W4 weight it serves, beside the packed codes the other
    kernels read: under a memory budget (--max-vram), or where the copies would take more than
    FRAGMENT_COPY_SHARE of the device (a small card, whose memory is better spent on KV blocks), each weight
    keeps one form and its products run on the next kernel of the table. The count is all that prepare_products
    would make (one fragment layout a weight, the W4 GEMM's scale pairs)."""
    copies = prepared_bytes(weights, dtype, gate_ups)
    if not copies:
        return False
    room = config.max_vram is None and copies <= FRAGMENT_COPY_SHARE * torch.cuda.get_device_properties(
        device).total_memory
    if not room:
        logger.info("W4 weights keep one form (%.2f GiB of fragment copies and scale pairs do not fit the budget): "
                    "few-token products run without the fragment kernel", copies / 2**30)
    return room


def read_model(config: EngineConfig, device: torch.device | str, dtype: torch.dtype) -> LoadedModel:
    """The model as its source holds it: HF names, projections separate, packed ones only where the
    source stores them packed (layered checkpoints). A Hugging Face id (`ORG/NAME`) that is no local path is
    resolved into the HF cache first (core/weights/hub.py), and the model is then named by it."""
    hub_name = None
    if config.model and not Path(config.model).expanduser().exists() and parse_hub_id(config.model):
        hub_name = config.model.split(":")[0]
        config = dataclasses.replace(config, model=str(resolve_model(config.model, config.revision)))
    if config.dummy_weights:
        loaded = _read_dummy(config, device, dtype)
    else:
        path = Path(config.model).expanduser() if config.model else default_model_path()
        if path.is_symlink() and path.is_file():
            # a model file the user names through a link of their own is the file it points to (links inside a
            # model directory must stay inside it: core/weights/file_checks.py)
            path = path.resolve()
        kind = detect_source(path)
        if kind == "layered":
            loaded = _read_layered(path, config, device, dtype)
        elif kind == "gguf" and _runs_gguf_directly(config, device):
            loaded = _read_direct("gguf", _gguf_file(path), config, device, dtype)
        elif kind == "gguf":
            loaded = _read_gguf(_gguf_file(path), config, device, dtype)
        elif kind in ("gptq", "awq"):
            loaded = _read_direct(kind, path, config, device, dtype)
        else:
            loaded = _read_hf(path, config, device, dtype)
    return loaded if hub_name is None else dataclasses.replace(loaded, name=hub_name)


def load_given_tokenizer(path: Path, spec: ModelSpec) -> Tokenizer:
    """config.tokenizer: an HF tokenizer directory or a GGUF's vocabulary, in place of the model's."""
    if not path.exists():
        raise ModelLoadError(f"tokenizer {path}: no such file or directory")
    if path.is_file():
        tokenizer = Tokenizer.from_pretrained(path.parent, gguf_file=path.name, eos_token_ids=spec.eos_token_ids,
                                              bos_token_id=spec.bos_token_id)
    else:
        tokenizer = Tokenizer.from_pretrained(path, eos_token_ids=spec.eos_token_ids, bos_token_id=spec.bos_token_id)
    return _checked_tokenizer(tokenizer, spec, path)


def detect_source(path: Path) -> str:
    """"hf" | "gptq" | "awq" | "gguf" | "layered" for an existing path; ModelLoadError saying what is wrong
    otherwise."""
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if path.is_file():
        if path.suffix.lower() == ".gguf" or _has_gguf_magic(path):
            return "gguf"
        raise ModelLoadError(f"{path} is neither a .gguf file nor a model directory")
    manifest = path / layered.MANIFEST_FILE
    if manifest.is_file() and hf_safetensors.read_json(manifest).get("format") == layered.FORMAT_NAME:
        return "layered"
    if hf_safetensors.is_hf_directory(path):
        return detect_checkpoint_kind(path)[0]  # "hf", or a quantizer's export: "gptq" | "awq"
    if len(list(path.glob("*.gguf"))) == 1:
        return "gguf"
    raise ModelLoadError(f"no model in {path}: expected config.json + *.safetensors, one .gguf file, "
                         f"or a deepinfer layered manifest.json")


def _read_hf(model_dir: Path, config: EngineConfig, device: Any, dtype: torch.dtype) -> LoadedModel:
    spec = ModelSpec.from_hf_config(hf_safetensors.read_hf_config(model_dir))
    files = hf_safetensors.safetensors_files(model_dir)
    hf_safetensors.check_safetensors_match_spec(spec, files)  # before the model is allocated
    model = _build_model(spec, config, device, dtype)
    model.load_weights(hf_safetensors.iter_safetensors(files))
    tokenizer = _checked_tokenizer(Tokenizer.from_pretrained(
        model_dir, eos_token_ids=spec.eos_token_ids, bos_token_id=spec.bos_token_id), spec, model_dir)
    return LoadedModel(spec, model, tokenizer, "hf", model_dir.name, read_generation_config(model_dir))


def _read_gguf(path: Path, config: EngineConfig, device: Any, dtype: torch.dtype) -> LoadedModel:
    reader = open_gguf(path)
    spec = gguf_spec(reader)
    model = _build_model(spec, config, device, dtype)
    model.load_weights(iter_gguf_weights(reader, spec))
    tokenizer = _checked_tokenizer(Tokenizer.from_pretrained(
        path.parent, gguf_file=path.name, eos_token_ids=spec.eos_token_ids, bos_token_id=spec.bos_token_id),
        spec, path)
    return LoadedModel(spec, model, tokenizer, "gguf", path.stem, gguf_generation_defaults(reader, path))


def _runs_gguf_directly(config: EngineConfig, device: Any) -> bool:
    """A GGUF runs directly unless it is to be re-quantized or the CPU is told to keep weights dense."""
    return config.quantization is None and not (torch.device(device).type == "cpu" and cpu_weights_mode() == "dense")


def _read_direct(kind: str, path: Path, config: EngineConfig, device: Any, dtype: torch.dtype) -> LoadedModel:
    """A GPTQ / AWQ directory or a GGUF file converted at load (core/models/direct_load.py); a lossy
    conversion is read from, or first written to, the conversion cache unless config.convert_cache is off."""
    name = path.stem if kind == "gguf" else path.name
    source = open_direct_source(kind, path)
    try:
        spec = ModelSpec.from_hf_config(source.config, where=str(path))
        plan = plan_direct_load(source, path.name)
        say(plan.runs_as)
        if plan.lossy and config.convert_cache:
            cached = convert_cache.cached_entry(path, plan.options)
            if cached is None:
                source.close()
                with load_progress(f"converting {path.name}") as progress:
                    cached = convert_cache.convert_into_cache(path, plan.options, plan.converted_bytes, progress)
                if cached is None:
                    say(f"not enough free space in {convert_cache.converted_dir()} for the conversion "
                        f"(~{plan.converted_bytes / 2**30:.1f} GiB): converting in memory, nothing written")
                    source = open_direct_source(kind, path)
                else:
                    say(f"conversion cached in {cached} (later loads read it; delete it to convert again)")
            if cached is not None:
                loaded = _read_layered(cached, config, device, dtype)
                return dataclasses.replace(loaded, source_kind=kind, name=name)
        with load_progress(f"loading {path.name}") as progress:
            model = build_from_source(source, spec, dtype, device, _max_positions(spec, config), progress, str(path))
        if kind == "gguf" and read_field(source.reader, "tokenizer.ggml.model") is not None:
            tokenizer = Tokenizer.from_pretrained(path.parent, gguf_file=path.name, eos_token_ids=spec.eos_token_ids,
                                                  bos_token_id=spec.bos_token_id)
            generation = source.generation_defaults()
        elif kind == "gguf":  # a GGUF without a vocabulary
            tokenizer, generation = ByteTokenizer(spec.vocab_size), source.generation_defaults()
        elif (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
            tokenizer = Tokenizer.from_pretrained(path, eos_token_ids=spec.eos_token_ids, bos_token_id=spec.bos_token_id)
            generation = read_generation_config(path)
        else:  # an export without a tokenizer, as its conversion would be: token ids in, token ids out
            tokenizer, generation = ByteTokenizer(spec.vocab_size), read_generation_config(path)
    finally:
        source.close()
    if isinstance(tokenizer, Tokenizer):
        tokenizer = _checked_tokenizer(tokenizer, spec, path)
    return LoadedModel(spec, model, tokenizer, kind, name, generation)


@torch.no_grad()
def _read_layered(path: Path, config: EngineConfig, device: Any, dtype: torch.dtype) -> LoadedModel:
    """Layer by layer, each file's sha256 checked as it is read, so peak host memory stays near one layer."""
    manifest = layered.read_manifest(path)
    layered.verify_small_files(path, manifest)  # config, tokenizer, template: checked before any is read
    spec = ModelSpec.from_hf_config(hf_safetensors.read_hf_config(path), where=str(path / layered.CONFIG_FILE))
    if spec.num_layers != manifest["num_layers"]:
        raise ModelLoadError(f"{path}: config.json has {spec.num_layers} layers, the manifest {manifest['num_layers']}")
    model = DecoderModel.on_meta(spec, dtype, device, _max_positions(spec, config))
    put_dense(model, layered.read_embeddings(path, manifest), device)
    for index in range(spec.num_layers):
        put_layer(model, *layered.read_layer(path, index, manifest), device, dtype)
    check_complete(model, str(path))
    model.requires_grad_(False)
    if manifest.get("tokenizer"):
        tokenizer = _checked_tokenizer(Tokenizer.from_pretrained(
            path, eos_token_ids=spec.eos_token_ids, bos_token_id=spec.bos_token_id), spec, path)
    else:  # the source had no tokenizer: token ids in, token ids out
        tokenizer = ByteTokenizer(spec.vocab_size)
    # generation_config.json was verified with the other small files above
    return LoadedModel(spec, model.eval(), tokenizer, "layered", path.name, read_generation_config(path))


def _read_dummy(config: EngineConfig, device: Any, dtype: torch.dtype) -> LoadedModel:
    spec, name, tokenizer = _dummy_spec(config)
    model = _build_model(spec, config, device, dtype)
    model.init_dummy_weights(config.seed)
    return LoadedModel(spec, model, tokenizer or dummy_tokenizer(spec), "dummy", name)


def _dummy_spec(config: EngineConfig) -> tuple[ModelSpec, str, Tokenizer | None]:
    """(spec, name, the model's own tokenizer or None) of a dummy-weight run."""
    if config.shape is not None:
        shape_file = shape_file_path(config.shape)
        return ModelSpec.from_hf_config(hf_safetensors.read_json(shape_file)), f"dummy-{shape_file.stem}", None
    path = Path(config.model).expanduser()
    kind = detect_source(path)
    if kind == "gguf":
        return gguf_spec(open_gguf(_gguf_file(path))), f"dummy-{path.stem}", None
    if kind in ("hf", "gptq", "awq"):  # a quantizer's export has an HF config.json too
        spec = ModelSpec.from_hf_config(hf_safetensors.read_hf_config(path))
        return spec, f"dummy-{path.stem}", Tokenizer.from_pretrained(path, eos_token_ids=spec.eos_token_ids)
    raise UnsupportedModelError("dummy weights need an HF or GGUF model config, or --shape")


def _read_quantized(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    bits = BITS_OF_SCHEME[config.quantization]
    if config.dummy_weights and config.shape is not None:
        return _read_dummy_quantized(config, device, dtype, bits)
    loaded = read_model(config, torch.device("cpu"), dtype)
    quantize_projections(loaded.model, bits, device=device, dtype=dtype, random_codes=config.dummy_weights,
                         seed=config.seed)
    loaded.model.to(device)
    return loaded


@torch.no_grad()
def _read_dummy_quantized(config: EngineConfig, device: torch.device, dtype: torch.dtype, bits: int) -> LoadedModel:
    spec, name, _ = _dummy_spec(config)
    model = DecoderModel.on_meta(spec, dtype, device, _max_positions(spec, config))
    quantize_projections(model, bits, device=device, dtype=dtype, random_codes=True, seed=config.seed)
    for module in model.modules():  # what is left on meta: embedding, norms, untied head
        for attr, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                setattr(module, attr, nn.Parameter(torch.empty_like(param, device=device), requires_grad=False))
    model.init_dummy_weights(config.seed)
    model.requires_grad_(False)
    return LoadedModel(spec, model.eval(), dummy_tokenizer(spec), "dummy", name)


def _max_positions(spec: ModelSpec, config: EngineConfig) -> int:
    """Rotary table length: the model's context, or more where max_model_len asks for it."""
    return max(config.max_model_len or 0, spec.max_position_embeddings)


def _build_model(spec: ModelSpec, config: EngineConfig, device: Any, dtype: torch.dtype) -> DecoderModel:
    model = DecoderModel(spec, dtype=dtype, device=device, max_positions=_max_positions(spec, config))
    model.requires_grad_(False)
    return model.eval()


def dummy_tokenizer(spec: ModelSpec) -> Tokenizer | ByteTokenizer:
    """The default model's tokenizer when it is on disk and fits the vocab, else one id per byte."""
    default = default_model_path(download=False)
    if default.is_file():
        tokenizer = Tokenizer.from_pretrained(default.parent, gguf_file=default.name)
        if tokenizer.vocab_size <= spec.vocab_size:
            return tokenizer
    return ByteTokenizer(spec.vocab_size)


def _checked_tokenizer(tokenizer: Tokenizer, spec: ModelSpec, where: Path) -> Tokenizer:
    if tokenizer.vocab_size > spec.vocab_size:
        raise ModelLoadError(f"tokenizer of {where} has {tokenizer.vocab_size} tokens, "
                             f"more than the model's vocab_size {spec.vocab_size}")
    return tokenizer


def shape_file_path(shape: str) -> Path:
    """The config.json behind `--shape`: a name under configs/shapes/ or a path to a .json file."""
    candidate = Path(shape).expanduser()
    if candidate.suffix == ".json" and candidate.is_file():
        return candidate
    shape_file = SHAPES_DIR / f"{shape}.json"
    if not shape_file.is_file():
        known = ", ".join(sorted(p.stem for p in SHAPES_DIR.glob("*.json")))
        raise ModelLoadError(f"unknown shape {shape!r}; known shapes: {known}")
    return shape_file


def _gguf_file(path: Path) -> Path:
    return path if path.is_file() else next(path.glob("*.gguf"))


def _has_gguf_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == b"GGUF"
    except OSError:
        return False
