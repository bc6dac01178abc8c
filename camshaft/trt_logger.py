"""A TensorRT logger that keeps what TensorRT said, so an error can carry TensorRT's own reason (both products)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterable, Iterator, MutableSequence
from typing import Any

NOISE = ("Int64 binding", "logger passed into")  # warnings about camshaft's own choices, not about the model


class Stop:
    """A stop (Ctrl-C, SIGTERM) that arrived while TensorRT called back into Python: TensorRT catches what a callback
    raises, so it is kept here, the build is cancelled, and the builder raises it once TensorRT returns."""

    def __init__(self) -> None:
        self.exc: BaseException | None = None

    def keep(self, exc: BaseException) -> None:
        self.exc = self.exc or exc

    @contextlib.contextmanager
    def keeping(self) -> Iterator[None]:
        """Around a callback's body: what it raises (a signal's exception) is kept, as TensorRT would swallow it."""
        try:
            yield
        except BaseException as exc:
            self.keep(exc)

    def raise_kept(self) -> None:
        if self.exc is not None:
            raise self.exc

    @contextlib.contextmanager
    def deferring_signals(self) -> Iterator[None]:
        """SIGINT and SIGTERM, while TensorRT runs, kept rather than raised: Python runs a signal's handler as the
        next callback starts, before any of its code could catch what the handler raises (TensorRT would swallow
        it). The process's own handler still decides what the stop is (KeyboardInterrupt, the CLI's exit 143)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

        def kept(signum: int, frame: Any) -> None:
            handler = previous[signum]
            try:
                if callable(handler):
                    handler(signum, frame)
                elif handler == signal.SIG_DFL:
                    raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)
            except BaseException as exc:
                self.keep(exc)

        for sig in previous:
            signal.signal(sig, kept)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def capturing_logger(trt: Any, messages: MutableSequence[str], on_error: Callable[[str], None] | None = None,
                     stop: Stop | None = None) -> Any:
    """Errors and warnings are appended to `messages` (a bounded deque where the logger lives long); errors also
    go to `on_error`; a stop raised meanwhile is kept in `stop`."""
    severity = trt.ILogger.Severity
    stop = stop or Stop()

    class Logger(trt.ILogger):
        def log(self, level: Any, msg: str) -> None:
            with stop.keeping():
                if level in (severity.INTERNAL_ERROR, severity.ERROR):
                    messages.append(msg)
                    if on_error is not None:
                        on_error(f"TensorRT error: {msg}")
                elif level == severity.WARNING and not any(n in msg for n in NOISE):
                    messages.append(msg)

    return Logger()


def build_monitor(trt: Any, progress: Callable[[str], None], stop: Stop, every_s: float = 10.0) -> Any:
    """TensorRT's progress monitor: its top-level phases said as they start (and their steps at most every
    `every_s`), and the build cancelled at the next step once a stop arrived."""
    import time

    class Monitor(trt.IProgressMonitor):
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self.top: dict[str, int] = {}  # top-level phases running: their step counts
            self.said = time.monotonic()

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            with stop.keeping():
                if parent_phase is None:
                    self.top[phase_name] = num_steps
                    progress(f"{phase_name} ({num_steps} step{'s' if num_steps != 1 else ''})")

        def step_complete(self, phase_name: str, step: int) -> bool:
            with stop.keeping():
                if phase_name in self.top and time.monotonic() - self.said >= every_s:
                    self.said = time.monotonic()
                    progress(f"{phase_name}: step {step + 1}/{self.top[phase_name]}")
            return stop.exc is None  # False cancels the build

        def phase_finish(self, phase_name: str) -> None:
            with stop.keeping():
                self.top.pop(phase_name, None)

    return Monitor()


def quoted(messages: Iterable[str]) -> str:
    """What TensorRT said, one indented line a message, for an error to end with."""
    return "\n".join(f"  {m}" for m in messages) or "  (no messages)"
