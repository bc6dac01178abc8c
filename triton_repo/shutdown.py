"""How `camshaft serve` ends a tritonserver: SIGTERM lets requests drain for the exit timeout; shortly before it
ends, the token model is told to end the requests still running (each gets a final response), so every model can
unload in time; a server still running well after it, or a second signal, is killed."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable
from multiprocessing.connection import Client

import psutil

from camshaft.errors import CamshaftError
from camshaft.triton_repo.channel import channel_path
from camshaft.triton_repo.deploy import TOKEN_MODEL
from camshaft.triton_repo.server_exit import DRAIN_BEFORE_S, KILL_AFTER_S

GAVE_UP_S = 2.0  # after Triton said it gave up ("Exiting immediately"): killed if still running
STUBS_BEFORE_EXIT_S = 5.0  # a stub gone as a signalled server stops: how long it may take to exit


def drain(server_pid: int) -> bool:
    """Ask the token model of the tritonserver `server_pid` to end every request in flight; False if none listens."""
    try:
        with contextlib.closing(Client(str(channel_path(TOKEN_MODEL, server_pid)), family="AF_UNIX")) as connection:
            connection.send(("drain", ""))
        return True
    except OSError:
        return False


def stub_watch(stubs: dict[int, str]) -> Callable[[], str | None]:
    """A check that names a model whose python backend stub (`stubs`: pid → model) has died, else None. Triton
    neither restarts it nor stops being ready, so its requests would fail or hang until the server is restarted."""
    processes = {}
    for pid, model in stubs.items():
        with contextlib.suppress(psutil.Error):
            processes[psutil.Process(pid)] = model

    def gone(process: psutil.Process) -> bool:  # Triton does not reap a stub that died: a zombie is gone too
        try:
            return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
        except psutil.Error:
            return True

    def lost() -> str | None:
        return ", ".join(sorted(model for process, model in processes.items() if gone(process))) or None
    return lost


def wait_until_stopped(process: subprocess.Popen, signals: list[float], exit_timeout_s: float,
                       log: Callable[[str], None], lost: Callable[[], str | None] = lambda: None,
                       gave_up: Callable[[], bool] = lambda: False,
                       signalled: Callable[[], bool] = lambda: False) -> int:
    """The server's exit code. `signals`: when each stop signal arrived (appended by the signal handler, which
    forwards the first as SIGTERM); a second one, or the server overstaying the exit timeout by KILL_AFTER_S (by
    GAVE_UP_S once `gave_up` says Triton gave up unloading), kills it. `lost`: names models whose process died
    (stub_watch); the server is then no longer whole: CamshaftError, so a supervisor restarts it, unless
    `signalled` says something else stopped the server (which ends its stubs as it stops)."""
    drained, gave_up_at = False, None
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return process.wait(timeout=0.2)
        if not signals:
            if dead := lost():
                if signalled():
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        return process.wait(timeout=STUBS_BEFORE_EXIT_S)
                raise CamshaftError(f"the process serving the model(s) {dead} died (Triton neither restarts it nor "
                                    "stops answering ready, and its requests fail or wait): stopping the server; "
                                    "restart it, and see its log and the machine's (out of memory?) for why")
            continue
        waited = time.monotonic() - signals[0]
        if gave_up_at is None and waited > exit_timeout_s and gave_up():
            gave_up_at = time.monotonic()
        if gave_up_at is not None and time.monotonic() - gave_up_at > GAVE_UP_S and len(signals) == 1:
            log("tritonserver gave up unloading at its exit timeout but did not exit (the known cause: a client's "
                "gRPC stream left open, even idle, keeps the model it last used loaded): killing it")
            process.kill()
            return process.wait()
        if len(signals) > 1 or waited > exit_timeout_s + KILL_AFTER_S:
            log("a second signal: killing tritonserver" if len(signals) > 1 else
                f"tritonserver did not exit {waited:.0f} s after the signal: killing it")
            process.kill()
            return process.wait()
        if not drained and waited > exit_timeout_s - DRAIN_BEFORE_S:
            drained = True
            if drain(process.pid):
                log("ending the requests still running, so the models unload before the exit timeout")
