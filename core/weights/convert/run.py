"""convert_checkpoint: any supported source -> a deepinfer layered checkpoint, one layer at a time.

While it runs in the main thread, SIGTERM and SIGHUP raise ConversionError (SIGINT raises
KeyboardInterrupt as always), so the writer removes its temp directory whichever way the run is
stopped short of kill -9; what a kill -9 leaves, the next conversion into the same OUT removes
(core/weights/convert/staging.py).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from deepinfer.core.errors import ConversionError
from deepinfer.core.models.spec import ModelSpec
from deepinfer.core.weights.convert.awq import AWQSource
from deepinfer.core.weights.convert.detect import detect_source
from deepinfer.core.weights.convert.gguf import GGUFSource
from deepinfer.core.weights.convert.gptq import GPTQSource
from deepinfer.core.weights.convert.hf import HFSource
from deepinfer.core.weights.convert.source import ConversionSource, ConvertOptions
from deepinfer.core.weights.convert.summary import ConversionSummary
from deepinfer.core.weights.generation_defaults import GENERATION_CONFIG_FILE
from deepinfer.core.weights.layered import CONFIG_FILE, LayeredWriter

_SOURCES: dict[str, type[ConversionSource]] = {"gptq": GPTQSource, "awq": AWQSource, "gguf": GGUFSource,
                                               "hf": HFSource}

# progress(done, total, what): called before the first step and after each one
ProgressCallback = Callable[[int, int, str], None]


def open_source(src: str | os.PathLike, options: ConvertOptions) -> ConversionSource:
    kind, path = detect_source(Path(src))
    return _SOURCES[kind](path, options)


def convert_checkpoint(src: str | os.PathLike, out: str | os.PathLike, options: ConvertOptions | None = None,
                       progress: ProgressCallback | None = None) -> ConversionSummary:
    """Convert `src` into the new directory `out`; on any error nothing is left at `out`."""
    report = progress or (lambda done, total, what: None)
    check_output(Path(out))
    with _termination_raises(Path(out)), LayeredWriter(out) as writer:  # refuses an existing `out` first
        source = open_source(src, options or ConvertOptions())
        try:
            spec = ModelSpec.from_hf_config(source.config)  # an unsupported model fails before any work
            summary = ConversionSummary(source.kind)
            total = spec.num_layers + 2
            report(0, total, "config and tokenizer")
            writer.write_json(CONFIG_FILE, source.config)
            source.save_tokenizer(writer.directory)
            generation = source.generation_defaults()
            if generation.values:  # what the loader reads back as the model's sampling defaults
                writer.write_json(GENERATION_CONFIG_FILE, generation.as_generation_config())
            report(1, total, "embeddings")
            writer.write_embeddings(source.convert_embeddings(summary))
            for index in range(spec.num_layers):
                report(2 + index, total, f"layer {index}")
                layer = source.convert_layer(index, summary)
                writer.write_layer(index, layer.dense, layer.packed)
            report(total, total, "done")
            writer.finish({
                "num_layers": spec.num_layers,
                "architecture": (source.config.get("architectures") or [spec.family])[0],
                "source": {"kind": source.kind, "path": str(Path(src).absolute()), "quant_scheme": source.quant_scheme},
                "tokenizer": (writer.directory / "tokenizer.json").is_file()
                or (writer.directory / "tokenizer_config.json").is_file(),
                "bytes_before": summary.bytes_before,
                "bytes_after": summary.bytes_after,
                "tensors": summary.to_manifest(),
            })
        finally:
            source.close()
    return summary


def check_output(out: Path) -> None:
    """Refuse, before any work, an `out` that the final rename would fail on: a symbolic link, even one
    whose target does not exist (`exists()` follows it and says no); the writer refuses the rest."""
    if out.is_symlink():
        raise ConversionError(f"output {out} is a symbolic link (to {os.readlink(out)}); give a new directory "
                              f"(nothing was written)")


@contextmanager
def _termination_raises(out: Path) -> Iterator[None]:
    """SIGTERM / SIGHUP raise ConversionError inside the block (once: a second signal during the
    cleanup is ignored), so `with` blocks clean up; outside the main thread signals cannot be caught."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = (signal.SIGTERM, signal.SIGHUP)

    def stop(signum: int, frame: object) -> None:
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)
        raise ConversionError(f"conversion stopped by {signal.Signals(signum).name}: nothing was written "
                              f"to {out}, its temp directory was removed")

    previous = {sig: signal.signal(sig, stop) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
