"""Programmatic dependent launch: the driver structures against cuda.h's layout, the argument buffer
against hand-packed bytes, the switch, and the kernel-side rule that makes it safe (every kernel waits)."""

import ctypes
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from deepinfer.kernels import programmatic_launch
from deepinfer.kernels.launch import f32, i32, i64

KERNELS = Path(__file__).resolve().parents[1] / "kernels"


def test_launch_structures_have_cuda_h_layout():
    # cuda.h (CUDA 12/13): CUlaunchAttribute = {CUlaunchAttributeID id; char pad[4]; union (64 bytes) value};
    # CUlaunchConfig = 7 unsigned ints, then CUstream, CUlaunchAttribute*, unsigned int numAttrs (x86-64)
    assert ctypes.sizeof(programmatic_launch.LaunchAttribute) == 72
    assert programmatic_launch.LaunchAttribute.value.offset == 8
    config = programmatic_launch.LaunchConfig
    assert ctypes.sizeof(config) == 56
    assert (config.sharedMemBytes.offset, config.hStream.offset, config.attrs.offset, config.numAttrs.offset) == \
        (24, 32, 40, 48)


def test_arguments_pack_into_8_byte_slots():
    args = (np.uint64(0x1122334455667788), i32(-5), i64(7), f32(0.5))
    buffer = bytearray(32)
    struct.pack_into(programmatic_launch.slot_format(args), buffer, 0, *args)
    assert bytes(buffer) == (bytes.fromhex("8877665544332211") + bytes.fromhex("fbffffff") + bytes(4)
                             + (7).to_bytes(8, "little") + bytes.fromhex("0000003f") + bytes(4))


def test_switch_follows_capability_and_environment(monkeypatch):
    monkeypatch.delenv("DEEPINFER_PDL", raising=False)
    assert [programmatic_launch.enabled(cc) for cc in ("75", "86", "89", "90", "100", "120")] == \
        [False, False, False, True, True, True]
    monkeypatch.setenv("DEEPINFER_PDL", "0")
    assert not programmatic_launch.enabled("90")


def function_bodies(text, qualifier):
    """(name, body) of each `qualifier` function of a source ("__global__ void", or "__device__ __forceinline__ void")."""
    for match in re.finditer(qualifier + r" (?:__launch_bounds__\([^)]*\) )?(\w+)\(", text):
        start = text.index("{", match.end())
        depth, end = 0, start
        for end in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                break
        yield match.group(1), text[start:end + 1]


WRITES = r"(\bout|partials|counters|sink|_out|_cache)\s*\[|\*\s*reinterpret_cast<(uint4|float4)\*>"


def test_every_kernel_waits_for_the_previous_grid_before_its_writes():
    # Launched with the attribute, a kernel that never waited could complete before the kernel it follows,
    # and the one after it would read stale data: every kernel must let dependents launch and then wait,
    # before anything but loads of its own weights. A kernel may wait inside a helper that waits (tcs_sums).
    common = (KERNELS / "common.cuh").read_text()
    found = 0
    for source in sorted(KERNELS.glob("*.cu")):
        text = source.read_text()
        waiting_helpers = {name: body for name, body in function_bodies(common + text, "__device__ __forceinline__ void")
                           if "wait_for_prior_grids();" in body and name != "wait_for_prior_grids"}
        for name, body in waiting_helpers.items():
            assert not re.search(WRITES, body[:body.index("wait_for_prior_grids();")]), name
        for name, body in function_bodies(text, "__global__ void"):
            found += 1
            assert body.count("launch_dependents();") == 1, name
            waits = [body.index(call) for call in ["wait_for_prior_grids();"] + [h + "<" for h in waiting_helpers]
                     if call in body]
            assert waits, name
            assert not re.search(WRITES, body[:min(waits)]), name
    assert found >= 16


@pytest.mark.parametrize("launch_arg", [0.5, 3])
def test_bare_python_scalars_have_no_slot(launch_arg):
    with pytest.raises(KeyError):
        programmatic_launch.slot_format((launch_arg,))


class _FakeDriver:
    """libcuda's cuLaunchKernelEx, recording the attributes of each launch config."""

    def __init__(self):
        self.launches = []

    def cuLaunchKernelEx(self, config, function, params, extra):  # the driver's name
        cfg = config._obj
        attrs = [(cfg.attrs[i].id, tuple(cfg.attrs[i].value[:3])) for i in range(cfg.numAttrs)]
        self.launches.append(((cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ), (cfg.blockDimX,), attrs))
        return 0


class _FakeKernel:
    class kernel:  # cupy.RawKernel's attribute
        ptr = 1234


def test_launch_attributes_carry_pdl_and_cluster_dimensions(monkeypatch):
    # cuda.h: CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4 with value.clusterDim {x, y, z};
    # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6 with value.programmaticStreamSerializationAllowed = 1
    driver = _FakeDriver()
    monkeypatch.setattr(programmatic_launch, "_driver", lambda: driver)
    args = (i32(1),)
    programmatic_launch.launch(_FakeKernel, (2, 3, 4), (256, 1, 1), args, 0, 0)
    programmatic_launch.launch(_FakeKernel, (2, 3, 4), (256, 1, 1), args, 0, 0, cluster=(1, 1, 4))
    programmatic_launch.launch(_FakeKernel, (2, 3, 4), (256, 1, 1), args, 0, 0, programmatic=False, cluster=(1, 1, 4))
    assert [attrs for *_, attrs in driver.launches] == [
        [(6, (1, 0, 0))],
        [(6, (1, 0, 0)), (4, (1, 1, 4))],
        [(4, (1, 1, 4))],
    ]
    assert driver.launches[0][:2] == ((2, 3, 4), (256,))
