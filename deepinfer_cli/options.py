"""The engine flags of `chat`, `serve`, `bench concurrency` and `bench jitter`, from one table.

Every EngineConfig field (core/config.py) has one row in ENGINE_FLAGS: its flag name (the field's
name with dashes), help, and how its value is typed. `@engine_flags("serve")` adds the rows that
apply to a command as options whose default is None, and hands the command `engine: dict` holding
only what the user set; `engine_config(engine)` builds the EngineConfig from that, so EngineConfig
is the only place defaults live. A field missing from the table fails at import (and in
tests/test_cli_flags.py), so a new EngineConfig field cannot be forgotten silently.

`chat` and `serve` also get the sampling flags of SAMPLING_FLAGS (default None: the model's own
default, from its generation_config.json or GGUF metadata); those given reach EngineConfig as
`override_generation_config`, the defaults of every request that leaves the field unset.
Benchmarks have none: they sample as they always do.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass
from typing import Annotated, Any

import typer

from deepinfer.core.config import EngineConfig

ENGINE_COMMANDS = ("chat", "serve", "concurrency", "jitter")


@dataclass(frozen=True)
class EngineFlag:
    help: str
    kind: type | None = None  # the click value type; None: the field's own (int, float, str, bool)
    names: tuple[str, ...] = ()  # extra names beside --field-name
    default_text: str | None = None  # how help shows EngineConfig's default, when str(default) reads badly
    metavar: str | None = None  # None: typer's <int>, <float>, <str>
    commands: tuple[str, ...] = ENGINE_COMMANDS  # where the flag applies


_RANDOM_WEIGHT_COMMANDS = ("serve", "concurrency", "jitter")  # chat answers need real weights

ENGINE_FLAGS: dict[str, EngineFlag] = {
    "model": EngineFlag(
        "HF directory, .gguf file, deepinfer layered directory, or Hugging Face id ORG/NAME (a GGUF repo "
        "takes ORG/NAME:QUANT or ORG/NAME:FILE.gguf).", names=("-m",), default_text="SmolLM2-135M-Instruct",
        metavar="MODEL"),
    "revision": EngineFlag("Branch, tag or commit of a Hugging Face id.", default_text="main", metavar="REV"),
    "dtype": EngineFlag("auto, float32, bfloat16 or float16 (auto: float32 on the CPU, bfloat16 or float16 on "
                        "a GPU)."),
    "device": EngineFlag("auto, cpu, cuda or cuda:N."),
    "seed": EngineFlag("Seed of random weights (--dummy-weights) and of benchmark prompts.",
                       commands=_RANDOM_WEIGHT_COMMANDS),
    "block_size": EngineFlag("Tokens per KV-cache block: 8, 16, 32, 64 or 128."),
    "kv_cache_dtype": EngineFlag("auto (the model dtype), int8, fp8 (e4m3), float16, bfloat16 or float32."),
    "enable_prefix_caching": EngineFlag("Share full prompt blocks between requests.", default_text="on"),
    "num_gpu_blocks": EngineFlag("Exactly this many KV blocks; overrides every memory budget."),
    "gpu_memory_utilization": EngineFlag("Fraction of the GPU's memory deepinfer may use."),
    "reserve_memory_mb": EngineFlag("MiB kept free for other programs."),
    "kv_cache_memory": EngineFlag("KV pool size exactly, e.g. 2GiB.", kind=str, metavar="SIZE"),
    "max_vram": EngineFlag("What torch reserves (weights, activations, CUDA graphs, KV) stays inside this, e.g. "
                           "4GiB; the CUDA context comes on top.", kind=str, metavar="SIZE"),
    "cpu_kv_cache_memory": EngineFlag("KV pool size on the CPU, e.g. 2GiB.", kind=str, default_text="512MiB",
                                      metavar="SIZE"),
    "max_model_len": EngineFlag("Context length cap.", default_text="the model's"),
    "max_num_seqs": EngineFlag("Most requests running at once."),
    "max_num_batched_tokens": EngineFlag("Per-step token budget: prefill chunks + decode tokens.",
                                         commands=("chat", "serve", "concurrency")),  # jitter sweeps it
    "max_waiting_requests": EngineFlag("Bounded waiting queue; past it new requests are refused (the server "
                                       "answers HTTP 429)."),
    "tensor_parallel_size": EngineFlag("Split the model over N ranks, one process each (GPUs cuda:0..N-1 from "
                                       "--device, or the CPU): heads, MLP channels and vocabulary."),
    "attention_backend": EngineFlag("auto, torch or native (the CUDA kernels)."),
    "enforce_eager": EngineFlag("Never use CUDA graphs.", default_text="off"),
    "async_scheduling": EngineFlag("Schedule and launch each step while the previous one runs on the device "
                                   "(same tokens, one step later).", default_text="on"),
    "dummy_weights": EngineFlag("Random weights (benchmarks).", default_text="off",
                                commands=_RANDOM_WEIGHT_COMMANDS),
    "shape": EngineFlag("configs/shapes/NAME.json (or a config.json path) for --dummy-weights.",
                        commands=_RANDOM_WEIGHT_COMMANDS, metavar="NAME"),
    "tokenizer": EngineFlag("HF directory or .gguf file whose tokenizer replaces the model's (e.g. a real "
                            "vocabulary for --dummy-weights).", metavar="PATH"),
    "quantization": EngineFlag("w4a16 or w3a16: round-to-nearest weight quantization at load.",
                               names=("--quant",)),
    "convert_cache": EngineFlag("Keep the conversion of a GGUF whose Q5_K/Q6_K/... projections run as 8-bit "
                                "round-to-nearest in the deepinfer cache (converted/), read by later loads; "
                                "--no-convert-cache converts in memory and writes nothing.", default_text="on"),
    # a flag of its own for each field: SAMPLING_FLAGS
    "override_generation_config": EngineFlag("Sampling defaults over the model's.", commands=()),
}

SAMPLING_COMMANDS = ("chat", "serve")
# SamplingParams field -> (flag, type, help); the default shown is the model's (its generation config).
SAMPLING_FLAGS: dict[str, tuple[str, type, str]] = {
    "temperature": ("--temperature", float, "Sampling temperature; 0 = greedy."),
    "top_p": ("--top-p", float, "Nucleus sampling: keep the most likely tokens up to this mass."),
    "top_k": ("--top-k", int, "Keep the k most likely tokens; 0 disables."),
    "min_p": ("--min-p", float, "Drop tokens below min_p times the most likely one's probability."),
    "repetition_penalty": ("--repetition-penalty", float, "Penalty on prompt and answer tokens; 1 disables."),
    "presence_penalty": ("--presence-penalty", float, "Subtracted from a token's logit once the answer holds it."),
    "frequency_penalty": ("--frequency-penalty", float, "Subtracted from a token's logit per time the answer holds it."),
}


def check_table(config_class: type = EngineConfig) -> None:
    """Raise unless ENGINE_FLAGS has exactly one row per field of `config_class`."""
    fields = {f.name for f in dataclasses.fields(config_class)}
    if fields != ENGINE_FLAGS.keys():
        raise RuntimeError(f"deepinfer_cli/options.py ENGINE_FLAGS is out of step with EngineConfig: missing "
                           f"{sorted(fields - ENGINE_FLAGS.keys())}, unknown {sorted(ENGINE_FLAGS.keys() - fields)}")


check_table()


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def engine_fields(command: str) -> list[str]:
    """The EngineConfig fields that are flags of `command`, in EngineConfig's order."""
    return [f.name for f in dataclasses.fields(EngineConfig) if command in ENGINE_FLAGS[f.name].commands]


def _value_type(field: dataclasses.Field) -> type:
    flag = ENGINE_FLAGS[field.name]
    if flag.kind is not None:
        return flag.kind
    hint = str(field.type)
    for kind in (bool, int, float, str):
        if hint.split("|")[0].strip() == kind.__name__:
            return kind
    raise TypeError(f"EngineConfig.{field.name}: cannot make a flag of type {hint}")


def _option(field: dataclasses.Field) -> Any:
    """Annotated[T | None, typer.Option(...)] for one field; the default is None (= EngineConfig's)."""
    flag = ENGINE_FLAGS[field.name]
    kind = _value_type(field)
    name = flag_name(field.name)
    decls = [f"{name}/--no-{name[2:]}" if kind is bool else name, *flag.names]
    default = field.default if field.default is not dataclasses.MISSING else None
    shown = flag.default_text or (None if default is None else str(default))
    help_text = flag.help + (f"  [default: {shown}]" if shown else "")
    return Annotated[kind | None, typer.Option(*decls, help=help_text, show_default=False, metavar=flag.metavar)]


def _sampling_option(name: str) -> Any:
    flag, kind, help_text = SAMPLING_FLAGS[name]
    return Annotated[kind | None, typer.Option(flag, help=f"{help_text}  [default: the model's]",
                                               show_default=False)]


FIRST_FIELDS = ("model", "revision")  # shown before a command's own options; the other engine flags after them


def engine_flags(command: str):
    """Decorate a Typer command: add the engine flags of `command` to its own parameters (--model and
    --revision first, the rest after them).

    The command declares `*, engine: dict` last and receives {field: value} for the flags given.
    """
    config_fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    names = engine_fields(command)

    def decorate(func):
        signature = inspect.signature(func, eval_str=True)
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in signature.parameters.values()
               if p.name != "engine"]
        added = {n: inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None,
                                      annotation=_option(config_fields[n])) for n in names}
        first = [added.pop(n) for n in FIRST_FIELDS if n in added]
        sampling = {n: inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None,
                                         annotation=_sampling_option(n))
                    for n in (SAMPLING_FLAGS if command in SAMPLING_COMMANDS else ())}

        @functools.wraps(func)
        def command_with_engine_flags(**kwargs):
            given = {n: kwargs.pop(n, None) for n in names}
            engine = {n: value for n, value in given.items() if value is not None}
            overrides = {n: value for n in sampling if (value := kwargs.pop(n, None)) is not None}
            if overrides:
                engine["override_generation_config"] = overrides
            return func(**kwargs, engine=engine)

        parameters = first + own + list(sampling.values()) + list(added.values())
        command_with_engine_flags.__signature__ = signature.replace(parameters=parameters)
        command_with_engine_flags.__annotations__ = {p.name: p.annotation for p in parameters}
        del command_with_engine_flags.__wrapped__  # typer and get_type_hints read this function, not `func`
        return command_with_engine_flags

    return decorate


def resolve_model_flag(engine: dict) -> None:
    """Replace a Hugging Face id in engine["model"] by its local snapshot path (downloading it once);
    with no model, make sure the default model is on disk, so its download shows before loading."""
    from deepinfer.core.weights.hub import resolve_model

    model = engine.get("model")
    if model is not None:
        engine["model"] = str(resolve_model(model, engine.get("revision")))
    elif not engine.get("dummy_weights"):
        from deepinfer.core.weights.default_model import default_model_path

        default_model_path()


def engine_config(engine: dict, **overrides: Any) -> EngineConfig:
    """The EngineConfig of the flags the user set plus the command's own `overrides`; a Hub id in
    --model is resolved to its cached snapshot first."""
    options = {**engine, **overrides}
    resolve_model_flag(options)
    return EngineConfig(**options)
