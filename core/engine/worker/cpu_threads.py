"""How many threads torch runs CPU ops with: the cores this process may use, not the machine's.

torch's default follows the machine (or the affinity mask), not a container's CPU quota: a process
limited to 1 CPU on a 16-core host runs 16 threads that the kernel throttles in turn, and the
threads of a step wait for each other. The count here is the smaller of the affinity mask
(`os.sched_getaffinity`) and the cgroup quota (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` /
`cpu.cfs_period_us`), rounded down, at least 1; an explicit count overrides both.
"""

from __future__ import annotations

import os
from pathlib import Path

CPU_THREADS_ENV = "DEEPINFER_CPU_THREADS"


def parse_cpu_max(text: str) -> float | None:
    """cgroup v2 `cpu.max` ("QUOTA PERIOD" or "max PERIOD") -> CPUs, None without a quota."""
    quota, _, period = text.strip().partition(" ")
    if quota == "max" or not period:
        return None
    return int(quota) / int(period)


def parse_cfs(quota_text: str, period_text: str) -> float | None:
    """cgroup v1 `cpu.cfs_quota_us` and `cpu.cfs_period_us` -> CPUs, None without a quota (-1)."""
    quota, period = int(quota_text), int(period_text)
    return None if quota <= 0 or period <= 0 else quota / period


def cgroup_cpu_quota(cgroup_root: Path = Path("/sys/fs/cgroup"),
                     proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup, in CPUs; None when there is none or it cannot be read.

    Looked up where /proc/self/cgroup places the process, then at the mount's root (inside a container
    the mount is the container's own cgroup while the listed path is the host's)."""
    try:  # lines "ID:CONTROLLERS:PATH"; cgroup v2's has no controllers
        places = [line.split(":", 2)[1:] for line in proc_cgroup.read_text().splitlines() if line.count(":") >= 2]
    except OSError:
        places = []
    v2 = [cgroup_root / path.lstrip("/") for names, path in places if names == ""] + [cgroup_root]
    v1 = [cgroup_root / names / path.lstrip("/") for names, path in places if "cpu" in names.split(",")]
    v1 += [cgroup_root / "cpu,cpuacct", cgroup_root / "cpu"]
    for directory in v2:
        try:
            return parse_cpu_max((directory / "cpu.max").read_text())
        except (OSError, ValueError):
            continue
    for directory in v1:
        try:
            return parse_cfs((directory / "cpu.cfs_quota_us").read_text(), (directory / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
    return None


def choose_cpu_threads(affinity_cores: int, quota_cpus: float | None, override: int | None = None) -> tuple[int, str]:
    """(thread count, why) from the cores the process may run on, its cgroup quota and an explicit count."""
    if override is not None:
        if override < 1:
            raise ValueError(f"the CPU thread count must be >= 1, got {override}")
        return override, f"set by --cpu-threads / {CPU_THREADS_ENV}"
    cores = f"{affinity_cores} core{'s' if affinity_cores != 1 else ''} this process may run on"
    if quota_cpus is not None and quota_cpus < affinity_cores:
        return max(1, int(quota_cpus)), f"its cgroup's CPU quota of {quota_cpus:g} CPUs (of the {cores})"
    return max(1, affinity_cores), f"the {cores}"


def set_cpu_threads(override: int | None = None) -> str:
    """Set torch's intra-op thread count as chosen above; returns the line that says so."""
    import torch

    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    count, why = choose_cpu_threads(affinity, cgroup_cpu_quota(), override)
    torch.set_num_threads(count)
    return f"running on the CPU with {count} torch thread{'s' if count != 1 else ''} ({why})"
