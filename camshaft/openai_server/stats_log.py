"""vLLM's periodic log line: the tokens a second since the last line and the batch loop's load, while there is any."""

from __future__ import annotations

from camshaft.openai_server.metrics import Metrics
from camshaft.runtime.llm import LLM

STATS_INTERVAL_S = 10.0


class StatsLog:
    def __init__(self, llm: LLM, metrics: Metrics, start: float, interval_s: float = STATS_INTERVAL_S) -> None:
        """start: now, on the clock line() is given (time.monotonic)."""
        self.llm, self.metrics, self.interval_s = llm, metrics, interval_s
        self._last = (start, *self._totals())

    def _totals(self) -> tuple[float, float]:
        sample = self.metrics.registry.get_sample_value
        return sample("camshaft_prompt_tokens_total") or 0.0, sample("camshaft_generation_tokens_total") or 0.0

    def line(self, now: float) -> str | None:
        """The line due at `now`; None before the interval is over, or when nothing ran since the last line."""
        start, prompt_before, generated_before = self._last
        if now - start < self.interval_s:
            return None
        prompt, generated = self._totals()
        load = self.llm.load()
        self._last = (now, prompt, generated)
        if (prompt, generated) == (prompt_before, generated_before) and not load.running and not load.waiting:
            return None
        span = now - start
        return (f"prompt {(prompt - prompt_before) / span:.1f} tokens/s, generation "
                f"{(generated - generated_before) / span:.1f} tokens/s; running {load.running}, waiting "
                f"{load.waiting}; KV cache {load.kv_usage:.1%} used")
