"""Finding the tritonserver bundled in nvidia-pytriton and what it needs to run: a backends directory of symlinks,
the environment of its python stub, free loopback ports."""

from __future__ import annotations

import ctypes
import importlib.util
import ipaddress
import os
import signal
import socket
import sys
import sysconfig
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from camshaft.errors import CamshaftError, needs_extra
from camshaft.ports import listening_sockets


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
    return free_ports(host, 1)[0]


def free_ports(host: str, count: int, taken: Iterable[int] = ()) -> list[int]:
    """`count` different free ports, none of those `taken`: each is held until all are chosen (the system may hand
    out a port it just freed again, and tritonserver refuses HTTP and metrics on one port)."""
    taken, held, ports = set(taken), [], []
    try:
        while len(ports) < count:  # a port of `taken` stays bound too, so the system does not hand it out again
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)
            sock.bind((host, 0))
            if sock.getsockname()[1] not in taken:
                ports.append(sock.getsockname()[1])
        return ports
    finally:
        for sock in held:
            sock.close()


def ipv4_address(host: str) -> str:
    """The IPv4 address tritonserver is given for `host`: its HTTP and metrics servers take only an address (a name
    such as localhost binds them to 255.255.255.255, where nothing reaches them), so a name is resolved here."""
    if ":" in host:
        raise CamshaftError(f"--host {host}: tritonserver takes IPv4 addresses here; pass 127.0.0.1 (this machine "
                            "only) or 0.0.0.0 (every interface)")
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else "not a host name"
        raise CamshaftError(f"--host {host} is no address of this machine ({reason}); pass an address such as "
                            "127.0.0.1 or 0.0.0.0") from None


def check_port(host: str, port: int) -> None:
    """Refuse a host and port tritonserver could not listen on, saying why (CamshaftError)."""
    if not 0 <= port <= 65535:
        raise CamshaftError(f"port {port} is not a port number (0-65535)")
    for sock in listening_sockets(ipv4_address(host), port, "--port / --grpc-port / --metrics-port"):
        sock.close()


PR_SET_PDEATHSIG = 1


def stop_with(parent: int) -> Callable[[], None]:
    """A preexec_fn: the child gets SIGTERM when the thread that started it (`parent`'s) dies, however that dies
    (SIGKILL, the OOM killer, a closed terminal), so no orphaned tritonserver keeps serving and holding its ports."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: no dynamic loading in the forked child

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # SIGTERM: Triton unloads its models and ends its stubs
        if os.getppid() != parent:  # the parent died before the line above took effect (a handler may catch SIGTERM)
            os._exit(1)
    return arm
