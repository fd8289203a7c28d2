"""Compile kernels/*.cu for the running GPU with NVRTC (cupy.RawModule) and cache the results.

A kernel is one template instantiation, named by its C++ name expression
(`"quant_mma_kernel<0,4,1,0>"`); each is compiled on first use, for the architecture of the device
it runs on. `#include "common.cuh"` is inlined, so the source hash covers the headers too. The
in-process cache is keyed by (device, source hash, arch, options, name); CuPy also keeps the
cubin on disk (~/.cupy/kernel_cache) under a hash of the same inputs, so a second process skips NVRTC.

Every launch asks for its kernel, so a loaded kernel is found by (source, name, device) alone, one
dict lookup: the sources are read and hashed once per process (they do not change under it).
"""

from __future__ import annotations

import hashlib
import multiprocessing
import re
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from functools import cache
from pathlib import Path

SOURCE_DIR = Path(__file__).parent
_INCLUDE = re.compile(r'^#include "([\w.]+)"\s*$', re.MULTILINE)

_kernels: dict[tuple, object] = {}  # (device, source, source hash, arch, options, name) -> kernel
_loaded: dict[tuple[str, str, int], object] = {}  # (source, name, device) -> kernel: the launch-time lookup
_lock = threading.Lock()


@cache
def source_text(filename: str) -> str:
    """The source of kernels/<filename> with its local includes inlined (each once)."""
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        text = (SOURCE_DIR / name).read_text()
        return _INCLUDE.sub(lambda match: expand(match.group(1)), text)

    return expand(filename)


@cache
def source_hash(filename: str) -> str:
    return hashlib.sha256(source_text(filename).encode()).hexdigest()[:16]


# Sources that use an architecture's own instructions (wgmma on SM90) build for its "a" target there; elsewhere
# they build for the plain architecture and compile those paths out.
ARCH_SPECIFIC_SOURCES = frozenset({"w4_gemm.cu", "w4_fragment_batch.cu", "w8_gemm.cu"})
_ARCH_SPECIFIC = frozenset({"90"})


def compile_options(arch: str, filename: str = "") -> tuple[str, ...]:
    suffix = "a" if filename in ARCH_SPECIFIC_SOURCES and arch in _ARCH_SPECIFIC else ""
    return ("-std=c++17", f"--gpu-architecture=sm_{arch}{suffix}")


@cache
def device_arch(device_index: int) -> str:
    """'90' for an H100/H200, '86' for an RTX 30xx."""
    import cupy

    return cupy.cuda.Device(device_index).compute_capability


def get_kernel(filename: str, name_expression: str, device_index: int):
    """The compiled cupy.RawKernel of one template instantiation, for one device."""
    kernel = _loaded.get((filename, name_expression, device_index))
    if kernel is not None:
        return kernel
    arch = device_arch(device_index)
    options = compile_options(arch, filename)
    key = (device_index, filename, source_hash(filename), arch, options, name_expression)
    with _lock:
        kernel = _kernels.get(key)
        if kernel is None:
            import cupy

            with cupy.cuda.Device(device_index):
                module = cupy.RawModule(code=source_text(filename), options=options,
                                        name_expressions=[name_expression])
                kernel = module.get_function(name_expression)
                kernel.compile()  # compile and load now, never inside a CUDA-graph capture
            _kernels[key] = kernel
        _loaded[(filename, name_expression, device_index)] = kernel
    return kernel


def compiled_kernels() -> list[dict]:
    """What this process has compiled: for reports."""
    return [{"device": key[0], "source": key[1], "source_hash": key[2], "arch": f"sm_{key[3]}", "kernel": key[5]}
            for key in _kernels]


def _compile_job(job: tuple[str, str, int]) -> tuple[str, str, str | None, float]:
    from cupy.cuda.compiler import CompileException

    filename, name, device_index = job
    start = time.perf_counter()
    try:
        get_kernel(filename, name, device_index)
        error = None
    except (CompileException, RuntimeError, OSError) as err:
        error = f"{type(err).__name__}: {err}"
    return filename, name, error, time.perf_counter() - start


def precompile(jobs: list[tuple[str, str]], device_index: int, workers: int = 8) -> list[dict]:
    """Compile (source, name expression) pairs in `workers` processes, filling CuPy's on-disk cache,
    then load each in this process (a disk-cache hit). One record per kernel: error (None if it
    compiled) and the compile seconds."""
    job_args = [(filename, name, device_index) for filename, name in jobs]
    if workers > 1 and len(jobs) > 1:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            compiled = list(pool.map(_compile_job, job_args))
    else:
        compiled = [_compile_job(job) for job in job_args]
    records = []
    for filename, name, error, seconds in compiled:
        if error is None:
            error = _compile_job((filename, name, device_index))[2]
        records.append({"source": filename, "kernel": name, "error": error, "seconds": round(seconds, 3)})
    return records
