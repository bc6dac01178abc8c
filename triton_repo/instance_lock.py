"""One token model per tritonserver: it holds the engine's executor and the channel the text models reach it by. A
second instance (a reload through Triton's model control, an instance_group count above 1) is refused while one
serves, and Triton keeps serving that one; while one unloads (its requests draining), the next waits for it."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path

from camshaft.errors import CamshaftError
from camshaft.triton_repo.channel import private_dir

SERVING, DRAINING = b"serving", b"draining"


class InstanceLock:
    """An flock on a file beside the channel's socket, held for the instance's life (the kernel drops it with a
    stub that dies). The file says whether its holder serves or drains."""

    def __init__(self, socket_path: Path, model: str, wait_s: float) -> None:
        self.path = socket_path.with_suffix(".lock")
        deadline = time.monotonic() + wait_s
        while True:
            private_dir(socket_path.parent)  # again: a holder that leaves removes it once empty
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                state = os.pread(fd, 16, 0)
                os.close(fd)
                if state != DRAINING:
                    raise CamshaftError(f"{model} is loaded in this tritonserver already, and it holds the engine's "
                                        "executor: it runs as one instance (instance_group count 1) and cannot be "
                                        "reloaded in place; unload it first (or restart the server)") from None
                if time.monotonic() > deadline:
                    raise CamshaftError(f"{model}'s last instance is still unloading (its requests end by the "
                                        "server's exit timeout); load it again once it has") from None
                time.sleep(0.1)
                continue
            with contextlib.suppress(OSError):
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:  # not the file a leaving holder unlinked
                    self.fd = fd
                    self._say(SERVING)
                    return
            os.close(fd)

    def _say(self, state: bytes) -> None:
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, state, 0)

    def draining(self) -> None:
        self._say(DRAINING)

    def release(self) -> None:
        """Unlinked while still held, so whoever waits takes a new file; then the directory, once empty."""
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self.fd)
        with contextlib.suppress(OSError):
            self.path.parent.rmdir()
