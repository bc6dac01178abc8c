"""camshaft's server log lines, written by a thread of their own: a stderr nobody reads (a pipe left full, a
terminal paused with Ctrl-S) must not stall the event loop, which logged each request's end. Lines past a bounded
queue are dropped, and how many is said before the next line queued."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

QUEUE_LINES = 10_000
FLUSH_S = 1.0  # at exit: how long the lines still queued may take to be written


class LogWriter(logging.Handler):
    def __init__(self, fd: int, max_lines: int = QUEUE_LINES) -> None:
        super().__init__()
        self.fd, self.dropped, self._said = fd, 0, 0
        self._lines: queue.Queue[str] = queue.Queue(max_lines)
        threading.Thread(target=self._write_lines, name="camshaft-log", daemon=True).start()

    def handle(self, record: logging.LogRecord) -> bool:  # no lock taken: the queue is all that is shared
        if not self.filter(record):
            return False
        self.emit(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        try:
            dropped, line = self.dropped, self.format(record) + "\n"
            if dropped > self._said:  # before the first line queued after them
                line = f"({dropped - self._said} log line(s) dropped: stderr was not read)\n{line}"
            self._lines.put_nowait(line)
            self._said = dropped
        except queue.Full:
            self.dropped += 1
        except Exception:  # a record that cannot be formatted: logging's own report
            self.handleError(record)

    def flush(self) -> None:
        deadline = time.monotonic() + FLUSH_S
        while self._lines.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def _write_lines(self) -> None:
        while True:
            data = self._lines.get().encode(errors="replace")
            try:
                while data:
                    data = data[os.write(self.fd, data):]  # blocks here, holding no lock
            except OSError:  # stderr closed: nothing to write to
                pass
            self._lines.task_done()
