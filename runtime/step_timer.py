"""The batch loop's Python overhead: the share of each loop iteration spent outside `Engine.step`, and outside the
backend's model call, timed by wrapping those two calls on one LLM's engine (the throughput benchmark)."""

from __future__ import annotations

import math
import statistics
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from camshaft.runtime.llm import LLM


class StepTimer:
    """Wraps Engine.step and the backend's step on one engine: (start, end of Engine.step, backend seconds,
    sequences) per call."""

    def __init__(self, llm: LLM) -> None:
        self.calls: list[tuple[float, float, float, int]] = []
        engine = llm.engine
        self._engine, self._step, self._backend_step = engine, engine.step, engine.backend.step
        self._backend_s = 0.0

        def backend_step(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return self._backend_step(*args, **kwargs)
            finally:
                self._backend_s = time.perf_counter() - t0

        def step(chunks: list[Any]) -> Any:
            t0 = time.perf_counter()
            self._backend_s = 0.0
            try:
                return self._step(chunks)
            finally:
                self.calls.append((t0, time.perf_counter(), self._backend_s, len(chunks)))

        engine.step, engine.backend.step = step, backend_step

    def restore(self) -> None:
        self._engine.step, self._engine.backend.step = self._step, self._backend_step

    def overhead(self, batch_size: int | None = None) -> dict[str, float]:
        """Share of each loop iteration (end of one Engine.step to the end of the next, while the loop stays busy)
        outside Engine.step and outside the backend call; medians over iterations (of `batch_size` sequences)."""
        outside_step, outside_backend, iteration = [], [], []
        for (_, prev_end, _, _), (start, end, backend_s, n) in zip(self.calls, self.calls[1:], strict=False):
            total = end - prev_end
            if total <= 0 or start - prev_end > 0.05 or (batch_size is not None and n != batch_size):
                continue  # the loop idled (waiting for a submission) between the two steps
            iteration.append(total)
            outside_step.append((total - (end - start)) / total)
            outside_backend.append((total - backend_s) / total)
        if not iteration:
            return {"steps": 0, "outside_engine_step": math.nan, "outside_model_call": math.nan,
                    "iteration_ms": math.nan}
        return {"steps": len(iteration), "outside_engine_step": statistics.median(outside_step),
                "outside_model_call": statistics.median(outside_backend),
                "iteration_ms": statistics.median(iteration) * 1000}
