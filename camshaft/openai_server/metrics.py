"""Prometheus metrics on the server's own registry: the batch loop's load (read at scrape time), latency histograms
and counters of requests and tokens."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from camshaft.runtime.llm import LLM

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                    5.0, 10.0, 20.0, 40.0, 80.0)


class _LoadCollector(Collector):
    def __init__(self, llm: LLM) -> None:
        self.llm = llm

    def collect(self) -> Iterator[Metric]:
        load = self.llm.load()
        for name, doc, value in (
                ("num_requests_running", "Sequences in the running batch", load.running),
                ("num_requests_waiting", "Sequences queued for the batch", load.waiting),
                ("kv_cache_usage_ratio", "Fraction of KV cache blocks in use", load.kv_usage),
                ("kv_cache_blocks_used", "KV cache blocks in use", load.kv_blocks_used),
                ("kv_cache_blocks_total", "KV cache blocks in the pool", load.kv_blocks_total)):
            yield GaugeMetricFamily(f"camshaft_{name}", doc, value=value)
        yield CounterMetricFamily("camshaft_prefix_cache_hit_blocks", "KV blocks reused from the prefix cache",
                                  value=load.prefix_hits)
        yield CounterMetricFamily("camshaft_num_preemptions", "Sequences preempted to free KV blocks",
                                  value=load.preemptions)
        yield CounterMetricFamily("camshaft_spec_decode_num_draft_tokens",
                                  "Prompt lookup's draft tokens fed to the engine", value=load.draft_tokens)
        yield CounterMetricFamily("camshaft_spec_decode_num_accepted_tokens", "Draft tokens equal to the sampled token",
                                  value=load.accepted_draft_tokens)


class Metrics:
    def __init__(self, llm: LLM) -> None:
        self.registry = registry = CollectorRegistry()
        registry.register(_LoadCollector(llm))
        self.ttft = Histogram("camshaft_time_to_first_token_seconds", "From request arrival to its first token",
                              buckets=_LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("camshaft_inter_token_latency_seconds", "Between successive tokens of a sequence",
                             buckets=_LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram("camshaft_e2e_request_latency_seconds", "From request arrival to its last token",
                             buckets=_LATENCY_BUCKETS, registry=registry)
        self.finished = Counter("camshaft_request_success", "Finished sequences by finish reason (abort: the "
                                "client went away; error: the server failed it)", ["finished_reason"],
                                registry=registry)
        self.prompt_tokens = Counter("camshaft_prompt_tokens", "Prompt tokens of admitted requests",
                                     registry=registry)
        self.generation_tokens = Counter("camshaft_generation_tokens", "Generated tokens", registry=registry)
        self._http = Counter("camshaft_http_requests", "HTTP responses by path and status", ["path", "status"],
                             registry=registry)

    def http(self, path: str, status: int) -> None:
        self._http.labels(path=path, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
