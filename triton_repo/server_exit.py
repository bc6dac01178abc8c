"""A tritonserver's end, as its token model sees it. Triton waits up to its exit timeout for every model to unload and
then exits with them loaded, which crashes and may leave it hung with its stubs; so the token model ends the requests
still in flight shortly before that timeout. When the process that launched the server dies (`camshaft serve`
killed outright: the kernel sends tritonserver SIGTERM), the token model takes the launcher's part: it ends the
requests in time and kills the server if it still overstays."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

SHM_PREFIX = "triton_python_backend_shm_region_"
TRITON_EXIT_TIMEOUT_S = 30.0  # tritonserver's --exit-timeout-secs default
DRAIN_BEFORE_S = 3.0  # before the exit timeout: requests still running are ended
KILL_AFTER_S = 15.0  # after it: a tritonserver still running is killed
LAUNCHER_ENV = "CAMSHAFT_TRITON_LAUNCHER"  # the pid of the process that started tritonserver (TritonServer)


def exit_timeout_s(server_pid: int | None = None) -> float:
    """The server's --exit-timeout-secs, read from its command line (this stub's parent's by default)."""
    with contextlib.suppress(OSError):
        args = Path(f"/proc/{server_pid or os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
        for i, arg in enumerate(args):
            value = arg.partition("=")[2] if arg.startswith("--exit-timeout-secs=") else (
                args[i + 1] if arg == "--exit-timeout-secs" and i + 1 < len(args) else None)
            if value is not None:
                with contextlib.suppress(ValueError):
                    return max(0.0, float(value))
    return TRITON_EXIT_TIMEOUT_S


def drain_s(server_pid: int | None = None) -> float:
    """How long requests in flight may go on once the server is stopping."""
    return max(0.0, exit_timeout_s(server_pid) - DRAIN_BEFORE_S)


def watch_launcher(end_requests: Callable[[], None]) -> None:
    """When the launcher named in the environment dies, end the requests in flight before the exit timeout and
    kill the server (its process group: it and its stubs) if it is still running well after it."""
    pid = os.environ.get(LAUNCHER_ENV, "")
    if not pid.isdigit():
        return
    server = os.getppid()

    def watch() -> None:
        try:
            fd = os.pidfd_open(int(pid))
        except OSError:  # gone already
            fd = None
        if fd is not None:
            select.select([fd], [], [])
            os.close(fd)
        timeout = exit_timeout_s(server)
        time.sleep(max(0.0, timeout - DRAIN_BEFORE_S))
        end_requests()
        time.sleep(DRAIN_BEFORE_S + KILL_AFTER_S)
        # still there (a client's open gRPC stream keeps a model loaded): its group, which TritonServer made its own
        if os.getppid() == server and os.getpgid(server) == server:
            for name in shm_regions(group(server)):  # unlinked first: the mappings last until the processes end
                Path("/dev/shm", name).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                os.killpg(server, signal.SIGKILL)

    threading.Thread(target=watch, name="camshaft-launcher-watch", daemon=True).start()


def group(pgid: int) -> list[psutil.Process]:
    """The live processes of process group `pgid` (Triton's stubs, also once Triton itself has exited)."""
    members = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(proc.pid) == pgid:
                members.append(proc)
    return members


def shm_regions(processes: list[psutil.Process]) -> set[str]:
    """The python backend's shared memory regions `processes` map."""
    names: set[str] = set()
    for proc in processes:
        with contextlib.suppress(psutil.Error):
            names |= {Path(m.path).name for m in proc.memory_maps() if SHM_PREFIX in m.path}
    return names
