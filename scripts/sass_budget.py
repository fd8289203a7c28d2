"""The W4 kernels' instruction budget, from their SASS, on a machine without a GPU.

Streaming 4-bit weights at HBM speed on an H200 needs about 17.8 bytes a cycle an SM; at 4 warp-instructions a
cycle an SM, every instruction spent unpacking and scaling weights is issue time the weight stream cannot hide. This
script compiles each kernel below with nvcc for sm_90a and sm_80 (the same source text and -std/-arch flags as
kernels/compiler.py gives NVRTC), disassembles the cubin (cuobjdump, which runs nvdisasm), finds each kernel's main
loop (the backward branch whose body holds the most tensor-core instructions) and sorts the body's instructions:

- tensor: HMMA (mma.sync), HGMMA and WARPGROUP (wgmma);
- copies: global and shared loads and stores, cp.async and its waits, barriers, mbarrier operations;
- spills: local-memory loads and stores (LDL / STL: registers ptxas spilled), which a gated kernel's loop must not have;
- other: everything else (unpacking, zero points, scales, addresses, loop control).

The weight bytes a warp multiplies in one trip of the loop are 128 bytes (a 16 x 16 tile of 4-bit codes; 256 of 8-bit
codes) per HMMA over the number of HMMA that share one weight fragment (the kernel's 8-token tiles), and 128 bytes per HGMMA (a
warpgroup's 64 x 16 tile over its 4 warps, all tokens in one instruction). "other per weight byte" is the budget:
the kernels marked `gated` fail the run above BUDGET, or with any spill inside their main loop.

    python3 scripts/sass_budget.py [--json PATH] [--keep DIR]

nvcc must be on PATH (CUDA 12.8+ for sm_90a); cuobjdump and nvdisasm on PATH, in the CUDA toolkit or from the
pip wheels nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm (found in the running Python's site-packages).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

from deepinfer.kernels import w4_fragment_batch as batch
from deepinfer.kernels import w4_fragment_gemm as fragment
from deepinfer.kernels import w8_gemm as w8
from deepinfer.kernels.compiler import compile_options, source_text

BUDGET = 0.15  # "other" warp-instructions per weight byte of the main loop, for the gated kernels
ARCHS = ("90", "80")
TENSOR = re.compile(r"^(HMMA|HGMMA|WARPGROUP|IMMA)\b")
COPIES = re.compile(r"^(LDG|STG|LDS|LDSM|STS|LD|ST|LDGSTS|LDGDEPBAR|DEPBAR|BAR|SYNCS|UTMALDG|UTMAPF|UBLKCP|"
                    r"ARRIVES|MEMBAR|CCTL|ERRBAR)\b")
SPILLS = re.compile(r"^(LDL|STL)\b")
INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*?);")
FUNCTION = re.compile(r"^\s*Function : (\S+)")


@dataclass(frozen=True)
class Kernel:
    label: str  # how the table names it
    source: str  # kernels/<source>
    name: str  # the template instantiation, as the launcher names it
    reuse: int  # HMMA per weight fragment (8-token tiles); 1 for wgmma
    gated: bool  # fails the run above BUDGET or with spills in its main loop
    archs: tuple[str, ...] = ARCHS
    tile_bytes: int = 128  # weight bytes of one HMMA's 16 x 16 tile (256 for 8-bit codes)


KERNELS = (
    # the few-token kernel over the fragment layout at each launch shape it has, bf16 and fp16, gated at G = 128 (the
    # products of bench gemv); at G = 64 and 32 the fp32 scaling of each group (4 FFMA a token tile) is reported
    *(Kernel(f"fragment {c.label} G={g} {'bf16' if dt else 'fp16'}", "w4_fragment_gemm.cu",
             c.name(dt, c.group_steps(g, 4096)), c.tt, g == 128)
      for c in fragment.CONFIGS for g in (128, 64, 32) for dt in (1, 0)),
    # the 33-128-token kernel: each weight fragment feeds its 8 token tiles (TT mma); reported, not gated (the budget
    # is the few-token kernels': at 64 tokens a weight byte carries 8 token tiles of mma.sync, so the issue slots
    # left to the tensor cores are not what bounds it)
    *(Kernel(f"fragment {batch.CONFIG.label} G={g} {'bf16' if dt else 'fp16'}", "w4_fragment_batch.cu",
             batch.CONFIG.name(dt, batch.CONFIG.group_steps(g, 4096)), batch.CONFIG.tt, False)
      for g in (128, 64, 32) for dt in (1, 0)),
    *(Kernel(f"fragment {config.label} G={g} {'bf16' if dt else 'fp16'}", "w4_fragment_batch.cu",
             config.name(dt, config.group_steps(g, 4096)), 1, False, ("90",))
      for config in batch.CONFIGS if config.wgmma for g in (128, 64, 32) for dt in (1, 0)),
    Kernel("w4_gemm mma<4,2,4,4> (17-32 tokens, SM80-89)", "w4_gemm.cu", "w4_gemm_kernel<1,0,false,4,2,4,4>", 4, False),
    Kernel("w4_gemm wgmma<1,1,32,4> (17-32 tokens, SM90)", "w4_gemm.cu", "w4_gemm_kernel<1,0,true,1,1,32,4>", 1, False,
           ("90",)),
    Kernel("tc TT=4 (up to 32 tokens)", "quant_matmul.cu", "quant_tc_gemv_kernel<1,4,0,0>", 4, False),
    Kernel("tcs TT=4 (wide, up to 32 tokens)", "quant_matmul.cu", "quant_tcs_kernel<1,4,0,0>", 4, False),
    # the W8 product (whole zero points, as Q8_0's) at the launches its table row serves (1-32 tokens)
    *(Kernel(f"w8_gemm TT={tt} RW={w8.LAUNCHES[tt][0]} bf16", "w8_gemm.cu",
             f"w8_gemm_kernel<1,{tt},{w8.LAUNCHES[tt][0]},0,0>", tt, False, tile_bytes=256)
      for tt in (1, 2, 4)),
    # its wgmma path (SM90, 17-64 tokens): each HGMMA multiplies a warp's 16 x 16 codes by all the tokens
    *(Kernel(f"w8_wgmma TOK={tok} bf16", "w8_gemm.cu", f"w8_wgmma_kernel<1,{tok},0,0>", 1, False, ("90",),
             tile_bytes=256) for tok in (32, 48, 64)),
)


def tool(name: str) -> str:
    """A CUDA tool on PATH, else in the NVIDIA pip wheels of this Python."""
    found = shutil.which(name)
    if found:
        return found
    wheel = Path(sysconfig.get_paths()["purelib"]) / "nvidia"
    for candidate in sorted(wheel.glob(f"*/bin/{name}")):
        return str(candidate)
    raise SystemExit(f"{name} not found: install the CUDA toolkit or `pip install nvidia-cuda-{name}`")


def compile_sass(source: str, names: list[str], arch: str, workdir: Path) -> str:
    """SASS of the named instantiations of kernels/<source> for sm_<arch>."""
    # host-side references to the kernels make nvcc instantiate the templates, as NVRTC's name expressions do
    keep = ",\n    ".join(f"(void*)&{name}" for name in names)
    text = source_text(source) + f"\nvoid* const sass_budget_kernels[] = {{\n    {keep}}};\n"
    stem = f"{Path(source).stem}_sm{arch}"
    cu = workdir / f"{stem}.cu"
    cu.write_text(text)
    cubin = workdir / f"{stem}.cubin"
    options = [o.replace("--gpu-architecture=", "-arch=") for o in compile_options(arch, source)]
    subprocess.run([tool("nvcc"), *options, "-cubin", "-w", "-o", str(cubin), str(cu)], check=True)
    env = dict(os.environ, PATH=f"{Path(tool('nvdisasm')).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    return subprocess.run([tool("cuobjdump"), "-sass", str(cubin)], check=True, capture_output=True, text=True,
                          env=env).stdout


def functions(sass: str) -> dict[str, list[tuple[int, str, str]]]:
    """Mangled name -> [(address, opcode, operands)] of each function in cuobjdump's listing."""
    out: dict[str, list[tuple[int, str, str]]] = {}
    current = None
    for line in sass.splitlines():
        match = FUNCTION.match(line)
        if match:
            current = out.setdefault(match.group(1), [])
            continue
        match = INSTRUCTION.match(line)
        if match and current is not None:
            current.append((int(match.group(1), 16), match.group(3), match.group(4).strip()))
    return out


def main_loop(code: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """The instructions of the loop (backward branch target .. branch) with the most tensor-core instructions,
    the innermost of equals."""
    best, best_key = [], None
    for address, opcode, operands in code:
        if not opcode.startswith("BRA"):
            continue
        target = re.search(r"0x([0-9a-f]+)", operands)
        if target is None or int(target.group(1), 16) > address:
            continue
        body = [ins for ins in code if int(target.group(1), 16) <= ins[0] <= address]
        tensor = sum(bool(TENSOR.match(op)) for _, op, _ in body)
        key = (tensor, -len(body))
        if tensor and (best_key is None or key > best_key):
            best, best_key = body, key
    return best


def classify(body: list[tuple[int, str, str]]) -> dict[str, int]:
    counts = {"tensor": 0, "hmma": 0, "hgmma": 0, "copies": 0, "spills": 0, "other": 0}
    other_ops: dict[str, int] = {}
    for _, opcode, _ in body:
        base = opcode.split(".")[0]
        if TENSOR.match(opcode):
            counts["tensor"] += 1
            counts["hmma"] += base == "HMMA"
            counts["hgmma"] += base == "HGMMA"
        elif COPIES.match(opcode):
            counts["copies"] += 1
        elif SPILLS.match(opcode):
            counts["spills"] += 1
        else:
            counts["other"] += 1
            other_ops[base] = other_ops.get(base, 0) + 1
    counts["other_ops"] = dict(sorted(other_ops.items(), key=lambda item: -item[1]))
    return counts


def mangled_matches(mangled: str, name: str) -> bool:
    """Whether an Itanium-mangled kernel name is this instantiation (template name and integer arguments)."""
    base, args = name.split("<", 1)
    values = [a.strip() for a in args.rstrip(">").split(",")]
    pieces = []
    for value in values:
        if value in ("true", "false"):
            pieces.append(f"Lb{int(value == 'true')}E")
        else:
            pieces.append(f"Li{value.replace('-', 'n')}E")
    return mangled.startswith(f"_Z{len(base)}{base}I{''.join(pieces)}E")


def measure(kernels: tuple[Kernel, ...], workdir: Path) -> list[dict]:
    records = []
    for arch in ARCHS:
        by_source: dict[str, list[Kernel]] = {}
        for kernel in kernels:
            if arch in kernel.archs:
                by_source.setdefault(kernel.source, []).append(kernel)
        for source, group in by_source.items():
            code = functions(compile_sass(source, [k.name for k in group], arch, workdir))
            for kernel in group:
                mangled = next((m for m in code if mangled_matches(m, kernel.name)), None)
                if mangled is None:
                    raise SystemExit(f"{kernel.name} not found in the SASS of {source} for sm_{arch}")
                body = main_loop(code[mangled])
                counts = classify(body)
                weight_bytes = kernel.tile_bytes * (counts["hgmma"] + counts["hmma"] / kernel.reuse)
                records.append({
                    "kernel": kernel.label, "name": kernel.name, "arch": f"sm_{arch}", "gated": kernel.gated,
                    "budget": BUDGET if kernel.gated else None,
                    "loop_instructions": len(body), "weight_bytes_per_warp": weight_bytes,
                    "other_per_weight_byte": round(counts["other"] / weight_bytes, 4) if weight_bytes else None,
                    **counts})
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the records here")
    parser.add_argument("--keep", type=Path, help="keep the generated sources and cubins here")
    args = parser.parse_args(argv)
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        records = measure(KERNELS, args.keep)
    else:
        with tempfile.TemporaryDirectory() as workdir:
            records = measure(KERNELS, Path(workdir))
    print(f"{'kernel':<52} {'arch':<7} {'loop':>5} {'tensor':>6} {'copies':>6} {'spills':>6} {'other':>6} {'B/warp':>7} "
          f"{'other/B':>8}  top other opcodes")
    failed = []
    for r in records:
        top = ", ".join(f"{op} {n}" for op, n in list(r["other_ops"].items())[:6])
        ratio = r["other_per_weight_byte"]
        mark = ""
        if r["gated"]:
            ok = ratio is not None and ratio <= BUDGET and r["spills"] == 0
            mark = " ok" if ok else " OVER" if r["spills"] == 0 else " SPILLS"
            if not ok:
                failed.append(f"{r['kernel']} {r['arch']}")
        print(f"{r['kernel']:<52} {r['arch']:<7} {r['loop_instructions']:>5} {r['tensor']:>6} {r['copies']:>6} "
              f"{r['spills']:>6} {r['other']:>6} {r['weight_bytes_per_warp']:>7.0f} {ratio:>8.3f}{mark}  {top}")
    if args.json:
        args.json.write_text(json.dumps({"budget": BUDGET, "records": records},
                                        indent=2) + "\n")
    if failed:
        print(f"over the budget of other instructions per weight byte, or spilling in the main loop: "
              f"{'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
