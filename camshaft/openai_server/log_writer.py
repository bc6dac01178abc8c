"""camshaft's server log lines, written by a thread of their own: a stderr nobody reads (a pipe left full, a
terminal paused with Ctrl-S) must not stall the event loop, which logged each request's end, nor the stop. Lines
past a bounded queue are dropped, and how many is said once writing goes on."""

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
        self.fd, self.dropped = fd, 0
        self._lines: queue.Queue[str] = queue.Queue(max_lines)
        threading.Thread(target=self._write_lines, name="camshaft-log", daemon=True).start()

    def handle(self, record: logging.LogRecord) -> bool:  # no lock taken: the queue is all that is shared
        if not self.filter(record):
            return False
        self.emit(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._lines.put_nowait(self.format(record) + "\n")
        except queue.Full:
            self.dropped += 1
        except Exception:  # a record that cannot be formatted: logging's own report
            self.handleError(record)

    def flush(self) -> None:
        deadline = time.monotonic() + FLUSH_S
        while self._lines.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def _write_lines(self) -> None:
        said = 0
        while True:
            line = self._lines.get()
            if self.dropped > said:  # written once stderr takes lines again
                line = f"({self.dropped - said} log line(s) dropped: stderr was not read)\n{line}"
                said = self.dropped
            data = line.encode(errors="replace")
            try:
                while data:
                    data = data[os.write(self.fd, data):]  # blocks here, holding no lock
            except OSError:  # stderr closed: nothing to write to
                pass
            self._lines.task_done()
