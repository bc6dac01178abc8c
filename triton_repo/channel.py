"""How the text models reach the executor that the token model hosts: a Unix socket private to one tritonserver.

Triton's BLS was the first way, and Triton 2.51's python backend does not survive it under load: with 80 concurrent
decoupled BLS streams from the text model, a stub crashed (heap corruption) or lost responses within a few storms
(its IPC thread builds the tensors of decoupled BLS responses; BLS responses are the only difference from token-model
clients, which ran 40 storms clean). So the token model listens on `channel_path()`, in a directory only this user
can enter, and each text model instance keeps one connection: it sends ("submit", call id, token inputs) (a batch:
("submit_all", first call id, [(call id, token inputs), ...]), queued whole or refused whole) and ("abort", call id)
and receives ("out", call id, payload) until a payload says it is the last, or ("error", call id, code, message).
The engine is still loaded once, and every request shares its one running batch.
"""

from __future__ import annotations

import contextlib
import os
import queue
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path

from camshaft.errors import ServerClosedError
from camshaft.triton_repo.protocol import token_error_status

Send = Callable[[tuple], None]


SOCKET_PATH_MAX = 107  # bytes of a Unix socket path (sun_path) on Linux
HELLO_TIMEOUT_S = 10.0  # the executor's first message on a new connection


def channel_path(token_model: str, server_pid: int | None = None) -> Path:
    """The same path in every stub of one tritonserver: their parent process is the server (`server_pid`, for
    the launcher that cleans up after it). Under /tmp when the temporary directory's path is too long for a socket."""
    name = Path(f"camshaft-triton-{os.getuid()}-{server_pid or os.getppid()}") / f"{token_model}.sock"
    path = Path(tempfile.gettempdir()) / name
    return path if len(os.fsencode(path)) <= SOCKET_PATH_MAX else Path("/tmp") / name


class ChannelServer:
    """Token-model side. submit(send, [(call_id, values), ...]) queues one prompt or a batch's together and returns
    each one's executor request ids, or raises having queued none (the error goes to the first call);
    abort(request_id) stops one; refused() counts a request the text model refused itself (("refused", call id)).
    A connection that closes aborts its unfinished requests; ("drain", "") (the launcher, at shutdown) calls
    drain()."""

    def __init__(self, path: Path, submit: Callable[[Send, list[tuple[str, dict]]], list[list[str]]],
                 abort: Callable[[str], None], refused: Callable[[], None] = lambda: None,
                 drain: Callable[[], None] = lambda: None, hello: tuple = ("hello",)) -> None:
        private_dir(path.parent)
        path.unlink(missing_ok=True)
        self.path, self.submit, self.abort, self.refused, self.drain = path, submit, abort, refused, drain
        self.hello = hello  # the first message on each connection: which engine this executor hosts
        self.listener = Listener(str(path), family="AF_UNIX")
        self.connections: list[Connection] = []
        # per connection: its calls not yet ended (call id -> request ids), its outgoing queue and writer thread
        self._served: list[tuple[dict[str, list[str]], queue.SimpleQueue, threading.Thread]] = []
        threading.Thread(target=self._accept, name="camshaft-channel", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection = self.listener.accept()
            except OSError:
                return  # closed
            self.connections.append(connection)
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: Connection) -> None:
        outgoing: queue.SimpleQueue = queue.SimpleQueue()
        owned: dict[str, list[str]] = {}
        lock = threading.Lock()
        writer = threading.Thread(target=_write, args=(connection, outgoing), daemon=True)
        self._served.append((owned, outgoing, writer))
        outgoing.put(self.hello)

        def send(message: tuple) -> None:
            finished = message[0] == "error" or message[2].get("last", False)  # the call's last sequence ended
            if finished:
                with lock:
                    owned.pop(message[1], None)
            outgoing.put(message)

        writer.start()
        try:
            while True:
                kind, call_id, *rest = connection.recv()
                if kind in ("submit", "submit_all"):  # one prompt, or a batch's: queued together or none
                    batch = [(call_id, rest[0])] if kind == "submit" else rest[0]
                    with lock:
                        owned.update({one: [] for one, _ in batch})
                    try:
                        all_ids = self.submit(send, batch)
                    except Exception as exc:
                        with lock:
                            for one, _ in batch[1:]:
                                owned.pop(one, None)
                        send(("error", batch[0][0], *token_error_status(exc)))  # pops the first
                        continue
                    with lock:
                        for (one, _), ids in zip(batch, all_ids, strict=True):
                            if one in owned:  # not already ended
                                owned[one] = ids
                elif kind == "refused":
                    self.refused()
                elif kind == "drain":  # the launcher, at shutdown: end every request in flight now
                    self.drain()
                elif kind == "abort":
                    with lock:
                        ids = owned.get(call_id, [])
                    for request_id in ids:
                        self.abort(request_id)
        except (EOFError, OSError, TypeError):  # TypeError: close() closed it under recv()
            pass
        finally:
            with lock:
                unfinished = [i for ids in owned.values() for i in ids]
            for request_id in unfinished:
                self.abort(request_id)
            outgoing.put(None)

    def in_flight(self) -> int:
        """Calls whose last message is not yet queued (the executor may have let a request go before its sink ran)."""
        return sum(len(owned) for owned, _, _ in list(self._served))

    def close(self) -> None:
        """Stop accepting; what is queued for each text model is written before its connection closes."""
        self.listener.close()
        for _, outgoing, writer in list(self._served):
            outgoing.put(None)
            if writer.is_alive():
                writer.join(timeout=5)
        for connection in self.connections:
            connection.close()
        remove_socket(self.path)


def private_dir(path: Path) -> None:
    """The channel's directory, made or checked as this user's alone (it holds the socket to the executor)."""
    path.mkdir(mode=0o700, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ServerClosedError(f"{path} must belong to this user with mode 0700 (it holds the socket to the "
                                "executor); remove it and restart the server")


def remove_socket(path: Path) -> None:
    """A channel's socket (its directory goes with the token model's instance lock)."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def _write(connection: Connection, outgoing: queue.SimpleQueue) -> None:
    while (message := outgoing.get()) is not None:
        try:
            connection.send(message)
        except OSError:
            return


class ChannelClient:
    """Text-model side: send() from one thread; what arrives goes to deliver(message) from a reader thread, and
    ("closed", reason) once the connection is gone (the next send reconnects)."""

    def __init__(self, path: Path, deliver: Send, connect_timeout_s: float = 60.0,
                 reconnect_timeout_s: float = 2.0, check: Callable[[tuple], None] = lambda hello: None) -> None:
        self.path, self.deliver, self.connect_timeout_s = path, deliver, connect_timeout_s
        self.reconnect_timeout_s, self.check = reconnect_timeout_s, check
        self.connection: Connection | None = None
        self.connected = False  # once: the token model loaded, and a lost connection means it is gone

    def open_if_listening(self) -> None:
        """Connect now if the token model already listens (its hello checked: raises as send() does)."""
        if self.connection is None and self.path.exists():
            with contextlib.suppress(FileNotFoundError, ConnectionRefusedError):
                self._greeted(Client(str(self.path), family="AF_UNIX"))

    def send(self, message: tuple) -> None:
        if self.connection is None:
            self._greeted(self._connect(self.reconnect_timeout_s if self.connected else self.connect_timeout_s))
        try:
            self.connection.send(message)
        except OSError as exc:
            self.connection = None
            raise ServerClosedError(f"the executor's channel {self.path} closed ({exc})") from exc

    def _greeted(self, connection: Connection) -> None:
        """Use `connection` once its hello passed check() (which raises on an executor it must not use)."""
        self.connected = True
        try:
            try:
                hello = connection.recv() if connection.poll(HELLO_TIMEOUT_S) else "nothing"
            except (EOFError, OSError) as exc:
                hello = repr(exc)
            if not (isinstance(hello, tuple) and hello[:1] == ("hello",)):
                raise ServerClosedError(f"the executor's channel {self.path} did not say hello ({str(hello):.80}); "
                                        "restart the server")
            self.check(hello)
        except BaseException:
            connection.close()
            raise
        self.connection = connection
        threading.Thread(target=self._read, args=(connection,), daemon=True).start()

    def _connect(self, timeout_s: float) -> Connection:
        deadline = time.monotonic() + timeout_s
        while True:  # the token model may still be loading
            try:
                return Client(str(self.path), family="AF_UNIX")
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                if time.monotonic() > deadline:
                    was = "its token model is gone (its process died?)" if self.connected else \
                        "is its token model loaded?"
                    raise ServerClosedError(f"no executor listens on {self.path}: {was}; restart the server") \
                        from exc
                time.sleep(0.1)

    def _read(self, connection: Connection) -> None:
        try:
            while True:
                self.deliver(connection.recv())
        except (EOFError, OSError, TypeError) as exc:  # TypeError: close() closed it under recv()
            if self.connection is connection:
                self.connection = None
            self.deliver(("closed", f"the executor's channel closed ({exc!r})"))

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()
