"""What the batch loop counts of its steps: the latest steps' stats, peaks, prompt lookup's drafts."""

from __future__ import annotations

import threading
import time
from collections import deque

from camshaft.runtime.outputs import IterationStats
from camshaft.runtime.scheduler import Scheduled, Scheduler


class StepCounters:
    def __init__(self, stats_window: int) -> None:
        self.stats: deque[IterationStats] = deque(maxlen=stats_window)  # the latest steps (a server runs for days)
        self.steps_done = 0
        self.peak_batch_size, self.peak_kv_usage = 0, 0.0  # since the caller last set them to 0
        self.draft_tokens = self.accepted_draft_tokens = 0  # prompt lookup's drafts (config.prompt_lookup)
        self._stats_lock = threading.Lock()

    def snapshot_stats(self) -> list[IterationStats]:
        with self._stats_lock:
            return list(self.stats)

    def last_stats(self) -> IterationStats | None:
        with self._stats_lock:
            return self.stats[-1] if self.stats else None

    def count_step(self, scheduled: list[Scheduled], scheduler: Scheduler, started: float) -> None:
        running = len(scheduled)
        self.peak_batch_size = max(self.peak_batch_size, running)
        blocks = scheduler.blocks
        step = IterationStats(running, sum(item.num_tokens for item in scheduled),
                              sum(item.num_tokens for item in scheduled if not item.decode),
                              len(scheduler.waiting), blocks.num_used, blocks.capacity,
                              time.perf_counter() - started, sum(1 for item in scheduled if not item.decode))
        self.peak_kv_usage = max(self.peak_kv_usage, step.kv_usage)
        with self._stats_lock:
            self.stats.append(step)
            self.steps_done += 1
