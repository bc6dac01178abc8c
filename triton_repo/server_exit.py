"""A tritonserver's end, as its token model sees it. Triton waits up to its exit timeout for every model to unload and
then exits with them loaded, which crashes and may leave it hung with its stubs; so the token model ends the requests
still in flight shortly before that timeout. When the process that launched the server dies (`camshaft serve`
killed outright: the kernel sends tritonserver SIGTERM), the models take the launcher's part: the token model ends
the requests in time, and the last stub left kills the server if it still overstays."""

from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
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
LAUNCHER_ENV = "CAMSHAFT_TRITON_LAUNCHER"  # the pid of the process that started tritonserver (TritonServer),
TERM_SUFFIX = ":term"  # and this where the kernel does not send the server SIGTERM when it dies (PR_SET_PDEATHSIG)
LOOP_FAILED = "camshaft: the batch loop failed"  # the token model's line in Triton's log (exit_failed)


def exit_timeout_s(server_pid: int | None = None) -> float:
    """The server's --exit-timeout-secs as tritonserver reads its command line (this stub's parent's by default):
    the last one given wins, and getopt takes a prefix of the name (--exit-timeout=5)."""
    found = TRITON_EXIT_TIMEOUT_S
    with contextlib.suppress(OSError):
        args = Path(f"/proc/{server_pid or os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
        for i, arg in enumerate(args):
            name, equals, value = arg.partition("=")
            if len(name) >= len("--exit-t") and "--exit-timeout-secs".startswith(name):
                value = value if equals else (args[i + 1] if i + 1 < len(args) else "")
                if number := re.match(r"\s*[+-]?\d+", value):  # its leading integer, as std::stoi reads it ("4s")
                    found = max(0.0, float(int(number.group())))
    return found


def drain_s(server_pid: int | None = None) -> float:
    """How long requests in flight may go on once the server is stopping."""
    return max(0.0, exit_timeout_s(server_pid) - DRAIN_BEFORE_S)


def _parent_of(pid: int) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    return None


def watch_launcher(end_requests: Callable[[], None], channel_dir: Path) -> None:
    """When the process that started this tritonserver (TritonServer: named in the environment, and the server's
    parent) dies, end the requests in flight before the exit timeout and kill the server (its process group: it and
    its stubs) if it is still running well after it. Every model's stub watches: the last one left does it."""
    launcher, server = os.environ.get(LAUNCHER_ENV, ""), os.getppid()
    term = launcher.endswith(TERM_SUFFIX)
    launcher = launcher.removesuffix(TERM_SUFFIX)
    if not launcher.isdigit() or _parent_of(server) != int(launcher):  # not started by TritonServer, or long ago
        return
    try:
        fd = os.pidfd_open(int(launcher))
    except OSError:
        return

    def watch() -> None:
        select.select([fd], [], [])
        os.close(fd)
        if term and os.getppid() == server:  # started off the main thread: stop it as the kernel would have
            with contextlib.suppress(OSError):
                os.kill(server, signal.SIGTERM)
        time.sleep(drain_s(server))
        end_requests()
        time.sleep(DRAIN_BEFORE_S + KILL_AFTER_S)
        # still there (a client's open gRPC stream keeps a model loaded): its group, which TritonServer made its own
        if os.getppid() == server and os.getpgid(server) == server:
            for name in shm_regions(group(server)):  # unlinked first: the mappings last until the processes end
                Path("/dev/shm", name).unlink(missing_ok=True)
            shutil.rmtree(channel_dir, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.killpg(server, signal.SIGKILL)

    threading.Thread(target=watch, name="camshaft-launcher-watch", daemon=True).start()


def exit_failed(failure: BaseException, log_error: Callable[[str], None]) -> None:
    """The token model's batch loop failed: Triton would go on answering ready with every request refused, so its
    process exits, and camshaft serve (watching it) stops with exit 1 for a supervisor to restart the server."""
    log_error(f"{LOOP_FAILED} ({failure!r}; its traceback is above): this model's process exits, the server is to "
              "be restarted")
    time.sleep(1.0)  # the log message reaches Triton first (exiting at once left the model unable to unload: 16 s)
    os._exit(1)


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
