"""The machine and software a measurement ran on, as benchmark reports record it."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path

VERSIONS = ("camshaft", "onnxruntime", "onnxruntime-genai", "torch", "transformers", "numpy")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine_info() -> dict:
    try:
        import psutil

        physical = psutil.cpu_count(logical=False)
        memory_gb = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        physical, memory_gb = None, None
    return {
        "cpu": cpu_model(),
        "logical_cores": os.cpu_count(),
        "physical_cores": physical,
        "available_cores": len(os.sched_getaffinity(0)),
        "memory_gb": memory_gb,
        "python": platform.python_version(),
        "versions": {name: version(name) for name in VERSIONS},
    }
