"""onnxruntime's intra-op threads: the cores this process may keep busy, a container's CPU quota included."""

from __future__ import annotations

import os

import pytest

from camshaft.runtime.backends.onnxruntime import cpu_quota_cores, physical_cores, session_options


def write(root, files: dict[str, str]):
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


V2, V1 = "0::/\n", "4:cpu,cpuacct:/\n"  # /proc/self/cgroup of a process at the mount's root


@pytest.mark.parametrize(("files", "cores"), [
    ({"cpu.max": "200000 100000\n", "self": V2}, 2),
    ({"cpu.max": "150000 100000\n", "self": V2}, 2),  # 1.5 cores: rounded up
    ({"cpu.max": "50000 100000\n", "self": V2}, 1),
    ({"cpu.max": "max 100000\n", "self": V2}, None),
    ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n", "self": V1}, 3),  # cgroup v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n", "self": V1}, None),
    ({"cpu.max": "garbage", "self": V2}, None),
    ({"self": V2}, None),
    ({"cpu.max": "200000 100000\n"}, 2),  # /proc/self/cgroup unreadable: both mount roots
    ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3),
])
def test_cpu_quota_in_whole_cores(tmp_path, files, cores):
    assert cpu_quota_cores(write(tmp_path, files), tmp_path / "self") == cores


@pytest.mark.parametrize(("files", "cores"), [
    # a systemd service (CPUQuota=) below a slice with its own quota, no cgroup namespace: the tightest counts
    ({"self": "0::/system.slice/app.service\n", "system.slice/cpu.max": "300000 100000\n",
      "system.slice/app.service/cpu.max": "max 100000\n"}, 3),
    ({"self": "0::/system.slice/app.service\n", "system.slice/cpu.max": "300000 100000\n",
      "system.slice/app.service/cpu.max": "100000 100000\n"}, 1),
    # a `docker --cpus=2` container on a cgroup v1 host whose cgroup is not the mount's root
    ({"self": "11:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n", "cpu/docker/abc/cpu.cfs_quota_us": "200000\n",
      "cpu/docker/abc/cpu.cfs_period_us": "100000\n", "cpu/cpu.cfs_quota_us": "-1\n",
      "cpu/cpu.cfs_period_us": "100000\n"}, 2),
    # the v1 hierarchy mounted by its joined name only, no "cpu" link to it
    ({"self": "4:cpu,cpuacct:/docker/abc\n", "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "200000\n",
      "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"}, 2),
])
def test_the_quota_of_the_process_own_cgroup_and_its_ancestors_counts(tmp_path, files, cores):
    assert cpu_quota_cores(write(tmp_path, files), tmp_path / "self") == cores
    assert physical_cores(tmp_path, tmp_path / "self") <= cores


def test_threads_never_exceed_the_quota_or_the_affinity(tmp_path):
    self_cgroup = write(tmp_path, {"self": V2}) / "self"
    unlimited = physical_cores(tmp_path, self_cgroup)
    assert 1 <= unlimited <= len(os.sched_getaffinity(0))
    assert physical_cores(write(tmp_path, {"cpu.max": "100000 100000\n"}), self_cgroup) == 1
    assert physical_cores(write(tmp_path, {"cpu.max": "6400000 100000\n"}), self_cgroup) == unlimited  # 64 cores
    assert session_options(None, True).intra_op_num_threads == physical_cores()
    assert session_options(3, True).intra_op_num_threads == 3
