"""Per-run latency percentiles, throughput and goodput; JSON and a latency-vs-throughput plot (one line per
target, one point per request rate)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from camshaft.bench_serve.clients import Record, Target
from camshaft.errors import RequestError
from camshaft.runtime.throughput_plot import save_figure
from camshaft.runtime.throughput_report import fmt, json_ready, percentiles


@dataclass(frozen=True)
class Goodput:
    """Service-level objectives: a request counts toward goodput when it meets all that are set (milliseconds)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> Goodput:
        """e.g. 'ttft_ms=1000,tpot_ms=100'"""
        if not text:
            return cls()
        values = {}
        for part in text.split(","):
            key, _, value = part.partition("=")
            try:
                values[key.strip()] = float(value)
            except ValueError:
                values[key.strip()] = -1.0
            if key.strip() not in ("ttft_ms", "tpot_ms", "e2e_ms") or not 0 < values[key.strip()] < math.inf:
                raise RequestError(f"cannot read --goodput {text!r}; use e.g. ttft_ms=1000,tpot_ms=100,e2e_ms=20000")
        return cls(**values)

    @property
    def set(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))

    def met(self, ttft_ms: float, tpot_ms: float, e2e_ms: float) -> bool:
        return all(limit is None or value <= limit for limit, value in
                   ((self.ttft_ms, ttft_ms), (self.tpot_ms, tpot_ms), (self.e2e_ms, e2e_ms)))


@dataclass(frozen=True)
class ServeResult:
    target: str
    backend: str
    request_rate: float
    concurrency: int | None
    completed: int
    failed: int
    wall_s: float
    prompt_tokens: int
    output_tokens: int
    output_tok_s: float
    requests_s: float
    goodput_req_s: float | None  # None: no SLO given
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]
    errors: dict[str, int] = field(default_factory=dict)  # each failure's message: how many requests, most first
    requests: list[dict] = field(default_factory=list, repr=False)  # each request's numbers, in arrival order

    def line(self) -> str:
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}"
        limit = f"C={self.concurrency}" if self.concurrency else "C=inf"
        ttft, itl = self.ttft_ms, self.itl_ms
        goodput = "" if self.goodput_req_s is None else f" (goodput {self.goodput_req_s:.2f})"
        return " ".join([
            f"{self.target:<14} {limit:>5} rate {rate:>5}/s:", f"{self.output_tok_s:7.1f} out tok/s",
            f"{self.requests_s:5.2f} req/s{goodput}",
            f" TTFT p50/p99 {fmt(ttft['p50'], None)}/{fmt(ttft['p99'], None)} ms",
            f" TPOT p50 {fmt(self.tpot_ms['p50'], None)} ms",
            f" ITL p50/p99 {fmt(itl['p50'], None)}/{fmt(itl['p99'], None)} ms",
            f" E2E p50 {fmt(self.e2e_ms['p50'], None)} ms",
        ] + ([f" FAILED {self.failed}: {self.error_summary()}"] if self.failed else []))

    def error_summary(self, most: int = 3) -> str:
        shown = [f"{message} (x{count})" for message, count in list(self.errors.items())[:most]]
        more = len(self.errors) - most
        return "; ".join(shown + ([f"{more} other error(s)"] if more > 0 else []))

    def to_dict(self) -> dict:
        """Plain JSON values: a percentile without data is None, not NaN."""
        out = json_ready(asdict(self))
        out["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        return out


def _ms(values: list[float]) -> dict[str, float]:
    return {k: v * 1000 for k, v in percentiles(values).items()}


def summarize(target: Target, rate: float, concurrency: int | None, records: list[Record], wall_s: float,
              goodput: Goodput) -> ServeResult:
    ok = [r for r in records if r.ok]
    ttft = [r.chunk_times[0] - r.sent for r in ok]
    e2e = [r.chunk_times[-1] - r.sent for r in ok]
    tokens = [r.tokens for r in ok]
    tpot = [(e - t) / (n - 1) for t, e, n in zip(ttft, e2e, tokens, strict=True) if n > 1]
    gaps = [[b - a for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)] for r in ok]
    itl = [gap for each in gaps for gap in each]
    each = iter({"prompt_tokens": r.prompt_tokens, "output_tokens": n, "ttft_ms": t * 1000, "e2e_ms": e * 1000,
                 "itl_ms": [g * 1000 for g in gs]} for r, n, t, e, gs in zip(ok, tokens, ttft, e2e, gaps, strict=True))
    good = sum(goodput.met(t * 1000, ((e - t) / (n - 1) if n > 1 else 0.0) * 1000, e * 1000)
               for t, e, n in zip(ttft, e2e, tokens, strict=True))
    failed = Counter(r.failure for r in records if not r.ok)
    return ServeResult(
        target=target.name, backend=target.backend, request_rate=rate, concurrency=concurrency,
        completed=len(ok), failed=sum(failed.values()), wall_s=wall_s, prompt_tokens=sum(r.prompt_tokens for r in ok),
        output_tokens=sum(tokens), output_tok_s=sum(tokens) / wall_s, requests_s=len(ok) / wall_s,
        goodput_req_s=good / wall_s if goodput.set else None, ttft_ms=_ms(ttft), tpot_ms=_ms(tpot), itl_ms=_ms(itl),
        e2e_ms=_ms(e2e), errors=dict(failed.most_common()),
        requests=[next(each) if r.ok else {"error": r.failure} for r in records])


def _rate_label(result: ServeResult) -> str:
    return ("inf" if math.isinf(result.request_rate) else f"{result.request_rate:g}") + "/s"


def _limit_label(result: ServeResult) -> str:
    return f"C={result.concurrency or 'inf'}"


def _limit_order(limit: int | None) -> tuple[bool, int]:
    return limit is None, limit or 0


def series(results: list[ServeResult]) -> list[tuple[str, list[ServeResult], Callable[[ServeResult], str]]]:
    """The plot's lines, each (legend label, its points by output tok/s, a point's label): a target's line runs
    through its request rates, one per concurrency limit; a target run at one rate runs through its limits."""
    lines = []
    for name in dict.fromkeys(r.target for r in results):
        runs = [r for r in results if r.target == name]
        limits = sorted({r.concurrency for r in runs}, key=_limit_order)
        if len({r.request_rate for r in runs}) == 1 and len(limits) > 1:
            lines.append((name, runs, _limit_label))
            continue
        several = len({r.concurrency for r in results}) > 1
        for limit in limits:
            lines.append((f"{name}, C={limit or 'inf'}" if several else name,
                          [r for r in runs if r.concurrency == limit], _rate_label))
    return [(label, sorted(points, key=lambda r: r.output_tok_s), point) for label, points, point in lines]


def labels_apart(points: list[tuple[str, float, float]], near: float = 0.06) -> list[tuple[str, float, float]]:
    """The point labels worth drawing: where several lines pass the same rate or limit close together, its label
    once, above them (written at each point, they piled into one blot); near is a share of the panel's spans."""
    points = [p for p in points if math.isfinite(p[1]) and math.isfinite(p[2])]  # a run whose requests all failed
    xs, ys = [x for _, x, _ in points], [y for _, _, y in points]
    spans = [(max(v) - min(v)) or 1.0 for v in (xs, ys)] if points else [1.0, 1.0]
    kept: list[tuple[str, float, float]] = []
    for text, x, y in sorted(points, key=lambda p: -p[2]):
        if not any(text == t and abs(x - kx) < near * spans[0] and abs(y - ky) < near * spans[1]
                   for t, kx, ky in kept):
            kept.append((text, x, y))
    return kept


def plot(results: list[ServeResult], path: str | Path, title: str | None = None) -> None:
    """p50 TTFT, p50 TPOT and p50 end-to-end latency against output tokens/s, a line per `series`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("p50 time to first token, ms", "ttft_ms"), ("p50 time per output token, ms", "tpot_ms"),
              ("p50 end-to-end latency, ms", "e2e_ms")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    for ax, (label, key) in zip(axes, panels, strict=True):
        labelled: list[tuple[str, float, float]] = []
        for name, points, point_label in series(results):
            xs, ys = [r.output_tok_s for r in points], [getattr(r, key)["p50"] for r in points]
            ax.plot(xs, ys, "o-", label=name)
            labelled += [(point_label(r), x, y) for r, x, y in zip(points, xs, ys, strict=True)]
        for text, x, y in labels_apart(labelled):
            ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xlabel("output tokens/s (higher is better)")
        ax.set_ylabel("ms")
        ax.set_title(label + " (lower is better)", fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path, title)
