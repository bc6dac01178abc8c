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


@pytest.mark.parametrize(("files", "cores"), [
    ({"cpu.max": "200000 100000\n"}, 2),
    ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 cores: rounded up
    ({"cpu.max": "50000 100000\n"}, 1),
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3),  # cgroup v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({"cpu.max": "garbage"}, None),
    ({}, None),
])
def test_cpu_quota_in_whole_cores(tmp_path, files, cores):
    assert cpu_quota_cores(write(tmp_path, files)) == cores


def test_threads_never_exceed_the_quota_or_the_affinity(tmp_path):
    unlimited = physical_cores(tmp_path)
    assert 1 <= unlimited <= len(os.sched_getaffinity(0))
    assert physical_cores(write(tmp_path, {"cpu.max": "100000 100000\n"})) == 1
    assert physical_cores(write(tmp_path, {"cpu.max": "6400000 100000\n"})) == unlimited  # 64 cores: no limit here
    assert session_options(None, True).intra_op_num_threads == physical_cores()
    assert session_options(3, True).intra_op_num_threads == 3
