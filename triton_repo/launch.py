"""Finding the tritonserver bundled in nvidia-pytriton and what it needs to run: a backends directory of symlinks,
the environment of its python stub, free loopback ports."""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from camshaft.errors import CamshaftError, needs_extra


@dataclass(frozen=True)
class Endpoints:
    host: str
    http_port: int
    grpc_port: int
    metrics_port: int

    @property
    def http(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"


def tritonserver_root() -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise CamshaftError(needs_extra("serving on Triton (tritonserver, shipped in nvidia-pytriton)", "serve"))
    root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    if not (root / "bin" / "tritonserver").is_file():
        raise CamshaftError(f"{root} holds no bin/tritonserver; reinstall nvidia-pytriton")
    return root


def make_backends_dir(out: Path) -> Path:
    """out/python/ with symlinks (their $ORIGIN rpath must resolve inside the pytriton package)."""
    root = tritonserver_root()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise CamshaftError(f"nvidia-pytriton has no python backend stub for Python {version}; use Python 3.10-3.13")
    python = out / "python"
    python.mkdir(parents=True, exist_ok=True)
    for source in (root / "backends/python/libtriton_python.so",
                   root / "backends/python/triton_python_backend_utils.py", stub):
        link = python / source.name
        if not link.exists():
            link.symlink_to(source)
    return out


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
    env.pop("PYTHONPATH", None)  # the stub ignores it; camshaft comes from the interpreter's site-packages
    return env


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
