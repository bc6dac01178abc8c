"""camshaft's Prometheus metrics on Triton's metrics port, through the python backend's custom metrics."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import triton_python_backend_utils as pb_utils

GAUGES = {
    "camshaft_kv_cache_blocks_used": "KV cache blocks in use",
    "camshaft_kv_cache_blocks_total": "KV cache blocks in the pool",
    "camshaft_kv_cache_usage_ratio": "Fraction of the KV cache pool in use",
    "camshaft_num_requests_running": "Sequences in the running batch (a request of n outputs counts n)",
    "camshaft_num_requests_waiting": "Sequences queued for the running batch",
    "camshaft_peak_batch_size": "Largest running batch of one engine step since start",
    "camshaft_tokens_per_second": "Generated tokens per second over the last second",
    "camshaft_stoppable_requests": "Unfinished requests with a client request id (which a stop request reaches)",
}
COUNTERS = {
    "camshaft_generation_tokens_total": "Tokens generated",
    "camshaft_requests_total": "Requests accepted by the executor",
    "camshaft_requests_refused_total": "Requests refused (invalid, too long, or the queue full)",
    "camshaft_requests_finished_total": "Requests finished, aborted ones included",
    "camshaft_requests_aborted_total": "Requests aborted (cancelled, client gone, or a stop request)",
    "camshaft_spec_decode_num_draft_tokens_total": "Prompt lookup's draft tokens fed to the engine",
    "camshaft_spec_decode_num_accepted_tokens_total": "Draft tokens equal to the sampled token",
    "camshaft_prefix_cache_hit_blocks_total": "KV blocks reused from the prefix cache",
    "camshaft_num_preemptions_total": "Sequences preempted to free KV blocks",
}
FROM_LOAD = {"camshaft_spec_decode_num_draft_tokens_total": "draft_tokens",  # counted by the batch loop itself
             "camshaft_spec_decode_num_accepted_tokens_total": "accepted_draft_tokens",
             "camshaft_prefix_cache_hit_blocks_total": "prefix_hits", "camshaft_num_preemptions_total": "preemptions"}

# TensorRT-LLM's triton backend families, under its names and labels: what endpoint pickers (the Gateway API
# inference extension, llm-d) scrape from a "triton-tensorrt-llm" server
TRTLLM = {
    "nv_trt_llm_request_metrics": ("TRT LLM request metrics", "request_type",
                                   ("active", "max", "scheduled", "context", "waiting")),
    "nv_trt_llm_kv_cache_block_metrics": ("TRT LLM KV cache block metrics", "kv_cache_block_type",
                                          ("max", "free", "used", "tokens_per", "fraction")),
}


class Metrics:
    def __init__(self, llm, model: str, period_s: float = 0.2, stoppable: Callable[[], int] = lambda: 0) -> None:
        self.llm, self.period_s, self.stoppable = llm, period_s, stoppable
        labels = {"model": model}
        self.families = {name: pb_utils.MetricFamily(name=name, description=text, kind=pb_utils.MetricFamily.GAUGE)
                         for name, text in GAUGES.items()}
        self.families |= {name: pb_utils.MetricFamily(name=name, description=text,
                                                      kind=pb_utils.MetricFamily.COUNTER)
                          for name, text in COUNTERS.items()}
        self.metrics: dict = {name: family.Metric(labels=labels) for name, family in self.families.items()}
        for family_name, (text, label, kinds) in TRTLLM.items():
            family = self.families[family_name] = pb_utils.MetricFamily(name=family_name, description=text,
                                                                         kind=pb_utils.MetricFamily.GAUGE)
            self.metrics |= {(family_name, kind): family.Metric(labels={**labels, label: kind, "version": "1"})
                             for kind in kinds}
        self._counts = dict.fromkeys(COUNTERS.keys() - FROM_LOAD.keys(), 0)
        self._sent = dict.fromkeys(COUNTERS, 0)
        self._lock = threading.Lock()
        self._window: list[tuple[float, int]] = []

    def count(self, name: str, value: int = 1) -> None:
        """Any thread: counted here, sent to Triton by tick() (the stub's metric calls are IPC)."""
        with self._lock:
            self._counts[name] += value

    def update(self) -> None:
        load = self.llm.load()  # before the counts: an idle load is never shown with a request not yet counted
        with self._lock:
            counts = dict(self._counts)
        counts |= {name: getattr(load, field) for name, field in FROM_LOAD.items()}
        for name, value in counts.items():
            if value > self._sent[name]:
                self.metrics[name].increment(value - self._sent[name])
                self._sent[name] = value
        values = {"camshaft_kv_cache_blocks_used": load.kv_blocks_used,
                  "camshaft_kv_cache_blocks_total": load.kv_blocks_total,
                  "camshaft_kv_cache_usage_ratio": load.kv_usage, "camshaft_num_requests_running": load.running,
                  "camshaft_num_requests_waiting": load.waiting,
                  "camshaft_peak_batch_size": self.llm.executor.peak_batch_size,
                  "camshaft_stoppable_requests": self.stoppable()}
        step = self.llm.executor.last_stats()
        values |= {("nv_trt_llm_request_metrics", "active"): load.running,  # admitted: in the running batch
                   ("nv_trt_llm_request_metrics", "max"): self.llm.config.max_batch_size,
                   ("nv_trt_llm_request_metrics", "scheduled"): load.running,
                   ("nv_trt_llm_request_metrics", "context"): step.num_prefill_requests if step and load.running
                   else 0,
                   ("nv_trt_llm_request_metrics", "waiting"): load.waiting,
                   ("nv_trt_llm_kv_cache_block_metrics", "max"): load.kv_blocks_total,
                   ("nv_trt_llm_kv_cache_block_metrics", "free"): load.kv_blocks_total - load.kv_blocks_used,
                   ("nv_trt_llm_kv_cache_block_metrics", "used"): load.kv_blocks_used,
                   ("nv_trt_llm_kv_cache_block_metrics", "tokens_per"): self.llm.config.block_size,
                   ("nv_trt_llm_kv_cache_block_metrics", "fraction"): load.kv_usage}
        for name, value in values.items():
            self.metrics[name].set(value)

    def tick(self) -> None:
        """Push the metrics to Triton if period_s has passed; call it from the one thread that talks to Triton."""
        now = time.monotonic()
        if self._window and now - self._window[-1][0] < self.period_s:
            return
        with self._lock:
            self._window.append((now, self._counts["camshaft_generation_tokens_total"]))
        self._window = [(t, n) for t, n in self._window if now - t <= 1.0 + self.period_s]
        (t0, n0), (t1, n1) = self._window[0], self._window[-1]
        try:
            self.metrics["camshaft_tokens_per_second"].set((n1 - n0) / (t1 - t0) if t1 > t0 else 0.0)
            self.update()
        except Exception as exc:  # a racy snapshot must not end the metrics: skip this tick
            pb_utils.Logger.log_warn(f"camshaft: metrics update failed ({exc!r})")

    def close(self) -> None:
        self.metrics.clear()  # metrics before their families, as the python backend requires
        self.families.clear()
