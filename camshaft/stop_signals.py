"""The stop signals a process got. GNU `timeout` sends its SIGTERM to the process and again to the process group
it leads, and a closed terminal may send SIGHUP twice: a SIGTERM (SIGHUP) soon after a first one is that same stop,
not a second one (which kills or cuts short)."""

from __future__ import annotations

import signal
import time

REPEAT_S = 1.0


class Stops:
    def __init__(self) -> None:
        self.times: list[float] = []  # when each stop came (monotonic)
        self._first: int | None = None

    def add(self, signum: int) -> bool:
        """Record a signal; False for a repeat of a first SIGTERM or SIGHUP within REPEAT_S, which is no new stop."""
        now = time.monotonic()
        if self._first == signum in (signal.SIGTERM, signal.SIGHUP) and now - self.times[0] < REPEAT_S:
            return False
        self._first = signum if self._first is None else self._first
        self.times.append(now)
        return True
