"""The CPU thread count `serve` picks, from hand-made affinity counts, quotas and cgroup trees."""

from __future__ import annotations

import pytest

from deepinfer.core.engine.worker.cpu_threads import (
    cgroup_cpu_quota,
    choose_cpu_threads,
    parse_cfs,
    parse_cpu_max,
)


@pytest.mark.parametrize(("affinity", "quota", "override", "expected"), [
    (16, None, None, 16),  # no quota: every core the process may run on
    (16, 2.0, None, 2),  # docker --cpus=2 on a 16-core host
    (16, 1.5, None, 1),  # a partial CPU would be throttled: rounded down
    (16, 0.25, None, 1),  # never below one
    (2, 8.0, None, 2),  # a quota above the affinity mask changes nothing
    (16, 2.0, 6, 6),  # an explicit count wins
])
def test_the_choice(affinity, quota, override, expected):
    count, why = choose_cpu_threads(affinity, quota, override)
    assert count == expected
    assert ("quota" in why) == (override is None and quota is not None and quota < affinity)


def test_an_explicit_count_below_one_is_refused():
    with pytest.raises(ValueError, match=">= 1"):
        choose_cpu_threads(4, None, 0)


def test_the_cgroup_files():
    assert parse_cpu_max("max 100000\n") is None
    assert parse_cpu_max("150000 100000\n") == 1.5
    assert parse_cfs("-1\n", "100000\n") is None
    assert parse_cfs("200000\n", "100000\n") == 2.0


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_quota_is_read_where_the_process_is_placed(tmp_path):
    proc = tmp_path / "proc-cgroup"
    root = tmp_path / "cgroup"
    write(proc, "0::/system.slice/serve.service\n")
    write(root / "system.slice/serve.service/cpu.max", "300000 100000\n")
    write(root / "cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(root, proc) == 3.0


def test_the_quota_falls_back_to_the_mount_root_and_to_cgroup_v1(tmp_path):
    proc = tmp_path / "proc-cgroup"
    root = tmp_path / "cgroup"
    write(proc, "0::/docker/abc\n")  # the host's path; inside the container the mount root is its cgroup
    write(root / "cpu.max", "50000 100000\n")
    assert cgroup_cpu_quota(root, proc) == 0.5
    v1 = tmp_path / "v1"
    write(proc, "4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n")
    write(v1 / "cpu,cpuacct/cpu.cfs_quota_us", "400000\n")
    write(v1 / "cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(v1, proc) == 4.0
    assert cgroup_cpu_quota(tmp_path / "nothing", tmp_path / "missing") is None
