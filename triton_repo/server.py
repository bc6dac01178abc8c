"""The tritonserver bundled in nvidia-pytriton, started on a camshaft model repository.

Recipe: a backends directory of symlinks to the python backend and the stub for this Python, PATH led by
this interpreter's bin (the stub runs its python from there), LD_LIBRARY_PATH = this Python's LIBDIR, free ports,
and a readiness poll that fails fast when the process exits (a broken stub makes loading hang forever).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

from camshaft.errors import CamshaftError
from camshaft.triton_repo.channel import channel_path
from camshaft.triton_repo.deploy import TOKEN_MODEL, check_path
from camshaft.triton_repo.launch import (
    Endpoints,
    check_port,
    free_ports,
    ipv4_address,
    make_backends_dir,
    server_env,
    stop_with,
    tritonserver_root,
)
from camshaft.triton_repo.server_exit import LAUNCHER_ENV, LOOP_FAILED, TERM_SUFFIX, group, shm_regions

LOG_FLAGS = {"debug": ["--log-verbose=1"], "info": [], "warning": ["--log-info=false"],
             "error": ["--log-info=false", "--log-warning=false"]}  # what tritonserver logs at each level

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # our own server: never through $http_proxy
_TRITON_LINE = re.compile(r"[IWE]\d{4} ")  # Triton's own lines: level, then month and day
_FAILURE = re.compile(r"(?i)error|exception|failed|killed")  # RuntimeError: ..., MemoryError
NO_DRIVER = "CudaDriverHelper has not been initialized"  # Triton's error on every start without NVIDIA's driver


def _without_gpu() -> list[str]:
    """On a machine without NVIDIA's driver: no GPU metrics (DCGM would append its failure to
    /var/log/nv-hostengine.log at each start) and no pinned host memory pool (a CUDA allocation)."""
    if Path("/proc/driver/nvidia").exists():
        return []
    return ["--allow-gpu-metrics=false", "--pinned-memory-pool-byte-size=0"]


def check_backend_tmp() -> None:
    """Triton's python backend makes its directories in /tmp whatever $TMPDIR says (where /tmp is read-only, as in
    a container with a read-only root filesystem, tritonserver aborts while loading the models)."""
    try:
        tempfile.TemporaryDirectory(prefix="camshaft-probe-", dir="/tmp").cleanup()
    except OSError as exc:
        raise CamshaftError(f"/tmp is not writable ({exc.strerror}), and Triton's python backend makes its "
                            "directories there whatever $TMPDIR says; mount a writable /tmp (e.g. an emptyDir "
                            "volume)") from None


class TritonServer:
    """`with TritonServer(repo) as server:` starts tritonserver on loopback and waits until it is ready."""

    def __init__(self, repo: Path, *, host: str = "127.0.0.1", http_port: int = 0, grpc_port: int = 0,
                 metrics_port: int = 0, exit_timeout_s: int = 5, ready_timeout_s: float = 120.0,
                 log_file: Path | None = None, log_level: str = "info") -> None:
        """Ports 0 pick free ones. log_file None: a file in a private temporary directory (see log_tail).
        log_level: what tritonserver logs there (debug, info, warning or error and what is worse)."""
        if log_level not in LOG_FLAGS:
            raise CamshaftError(f"unknown log level {log_level!r}; use {', '.join(LOG_FLAGS)}")
        self.repo = Path(repo).resolve()
        if not (self.repo.is_dir() and any(self.repo.glob("*/config.pbtxt"))):
            raise CamshaftError(f"{repo} is not a model repository (no */config.pbtxt); write one with camshaft deploy")
        check_path(self.repo, "the model repository")
        check_path(Path(tempfile.gettempdir()), "the temporary directory ($TMPDIR)")
        check_backend_tmp()
        host = ipv4_address(host or "0.0.0.0")
        probe = "127.0.0.1" if host == "0.0.0.0" else host
        given = [http_port, grpc_port, metrics_port]
        picked = iter(free_ports(probe, sum(not p for p in given), taken=[p for p in given if p]))
        self.endpoints = Endpoints(probe, *(port or next(picked) for port in given))
        self.host, self.exit_timeout_s, self.ready_timeout_s = host, exit_timeout_s, ready_timeout_s
        self._tmp = tempfile.TemporaryDirectory(prefix="camshaft-triton-")
        self.log_file = Path(log_file) if log_file else Path(self._tmp.name) / "tritonserver.log"
        self.log_flags = LOG_FLAGS[log_level]
        self.process: subprocess.Popen | None = None
        self._shm: set[str] = set()
        self.leaked_shm: list[str] = []  # regions still present once the server exited (stop() removes them)

    def command(self) -> list[str]:
        e = self.endpoints
        return [str(tritonserver_root() / "bin" / "tritonserver"), f"--model-repository={self.repo}",
                f"--backend-directory={make_backends_dir(Path(self._tmp.name) / 'backends')}",
                f"--http-address={self.host}", f"--http-port={e.http_port}",
                f"--grpc-address={self.host}", f"--grpc-port={e.grpc_port}",
                "--allow-metrics=true", "--allow-cpu-metrics=true", f"--metrics-address={self.host}",
                f"--metrics-port={e.metrics_port}", f"--exit-timeout-secs={self.exit_timeout_s}",
                "--strict-readiness=true", *self.log_flags, *_without_gpu()]

    def start(self) -> TritonServer:
        e = self.endpoints
        for port in (e.http_port, e.grpc_port, e.metrics_port):  # a server already there would answer our poll
            check_port(e.host, port)
        with open(self.log_file, "ab") as log:
            # its own process group, which the stubs join: stop() can end them even after Triton itself died
            # SIGTERM when we die; the kernel sends it when the starting thread ends, so from another thread (a pool's,
            # which ends first) the models' watch of this process sends it; they also take our part once it is sent
            main = threading.current_thread() is threading.main_thread()
            env = {**server_env(), LAUNCHER_ENV: f"{os.getpid()}{'' if main else TERM_SUFFIX}"}
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                            stdin=subprocess.DEVNULL, process_group=0,
                                            preexec_fn=stop_with(os.getpid()) if main else None)
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        self._shm = self._shm_regions()
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        url = f"http://{self.endpoints.http}/v2/health/ready"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise CamshaftError(f"tritonserver exited with code {self.process.returncode} before it was ready; "
                                    f"its log ({self.log_file}) ends:\n{self.log_tail()}")
            try:
                with _DIRECT.open(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise CamshaftError(f"tritonserver was not ready within {self.ready_timeout_s:.0f} s; its log "
                            f"({self.log_file}) ends:\n{self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        """Triton's error lines (E...) and its stubs' (a traceback's last line, "memory allocation of N bytes
        failed"), then the last lines of its log."""
        try:
            text = self.log_file.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        errors = [line for line in text[:-lines] if _TRITON_LINE.match(line) and line.startswith("E")
                  and NO_DRIVER not in line or not _TRITON_LINE.match(line) and _FAILURE.search(line)]
        return "\n".join([*errors[-20:], *text[-lines:]])

    def gave_up(self) -> bool:
        """Whether Triton said it gave up stopping at its exit timeout (it may then hang, e.g. on an open gRPC
        stream)."""
        return self._logged(b"Exit timeout expired")

    def signalled(self) -> bool:
        """Whether Triton said it got a stop signal (at any log level; anywhere in its log, which a debug level
        fills fast)."""
        return self._logged(b"Signal (", tail=None)

    def loop_failed(self) -> bool:
        """Whether the token model said its batch loop failed (server_exit.exit_failed)."""
        return self._logged(LOOP_FAILED.encode(), tail=None)

    def _logged(self, text: bytes, tail: int | None = 4096) -> bool:
        """Whether the log's last `tail` bytes (None: all of it) hold `text`."""
        try:
            with open(self.log_file, "rb") as log:
                log.seek(0 if tail is None else max(0, log.seek(0, os.SEEK_END) - tail))
                kept = b""
                while chunk := log.read(1 << 20):
                    if text in kept + chunk:
                        return True
                    kept = chunk[-len(text):]
                return False
        except OSError:
            return False

    def is_ready(self) -> bool:
        try:
            with _DIRECT.open(f"http://{self.endpoints.http}/v2/health/ready", timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)

    def wait(self, timeout: float | None = None) -> int:
        return self.process.wait(timeout)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (Triton drains for exit_timeout_s, then unloads the models), SIGKILL if it overstays."""
        if self.process is None:
            return None
        self._shm |= self._shm_regions()
        self.signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        # stubs left behind: Triton gave up unloading ("Exiting immediately"), or died before stop() was called
        left = group(self.process.pid)
        self._shm |= shm_regions(left)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        psutil.wait_procs(left, timeout=10)  # SIGKILL is delivered, not yet acted on, when killpg returns
        self.leaked_shm = sorted(name for name in self._shm if Path("/dev/shm", name).exists())
        for name in self.leaked_shm:  # only regions our server's processes mapped; a clean exit leaves none
            Path("/dev/shm", name).unlink(missing_ok=True)
        shutil.rmtree(channel_path(TOKEN_MODEL, self.process.pid).parent, ignore_errors=True)  # unless finalized
        self._tmp.cleanup()
        return code

    def stubs(self) -> dict[int, str]:
        """The python backend stubs running now: pid → the model each serves (`<repo>/<model>/<version>/model.py`)."""
        found = {}
        for child in psutil.Process(self.process.pid).children():
            with contextlib.suppress(psutil.Error, IndexError):
                command = child.cmdline()
                if Path(command[0]).name == "triton_python_backend_stub":
                    found[child.pid] = Path(command[1]).parent.parent.name
        return found

    @property
    def shm_regions(self) -> set[str]:
        """Names of the /dev/shm regions the server's processes were seen to map (removed by stop())."""
        return set(self._shm)

    def _shm_regions(self) -> set[str]:
        if self.process is None or self.process.poll() is not None:
            return set()
        return shm_regions(group(self.process.pid))  # tritonserver and its stubs share its process group

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
