"""A TensorRT logger that keeps what TensorRT said, so an error can carry TensorRT's own reason (both products)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableSequence
from typing import Any

NOISE = ("Int64 binding", "logger passed into")  # warnings about camshaft's own choices, not about the model


def capturing_logger(trt: Any, messages: MutableSequence[str], on_error: Callable[[str], None] | None = None) -> Any:
    """Errors and warnings are appended to `messages` (a bounded deque where the logger lives long); errors also
    go to `on_error`."""
    severity = trt.ILogger.Severity

    class Logger(trt.ILogger):
        def log(self, level: Any, msg: str) -> None:
            if level in (severity.INTERNAL_ERROR, severity.ERROR):
                messages.append(msg)
                if on_error is not None:
                    on_error(f"TensorRT error: {msg}")
            elif level == severity.WARNING and not any(n in msg for n in NOISE):
                messages.append(msg)

    return Logger()


def quoted(messages: Iterable[str]) -> str:
    """What TensorRT said, one indented line a message, for an error to end with."""
    return "\n".join(f"  {m}" for m in messages) or "  (no messages)"
