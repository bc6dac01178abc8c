"""The throughput benchmark's results (runtime/throughput.py measures them), their text report and JSON values: a
percentile without data prints as "—" and is null in JSON (not nan); requests clipped to fit the engine are counted,
with the lengths asked for and run."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from camshaft.runtime.bench_data import BenchRequest

NO_DATA = "—"


def json_ready(value: Any) -> Any:
    """`value` with every nan or infinite float (in dicts, lists, tuples) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan, "mean": math.nan}
    arr = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(arr.mean())}


@dataclass
class RequestRecord:
    index: int
    prompt_tokens: int
    max_tokens: int
    submitted: float = 0.0
    token_times: list[float] = field(default_factory=list)
    token_steps: list[int] = field(default_factory=list)  # the engine step that gave each token
    decoding_at_first_token: int = 0  # other requests decoding in the step that gave this one its first token
    token_ids: list[int] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        return self.token_times[0] - self.submitted

    @property
    def e2e_s(self) -> float:
        return self.token_times[-1] - self.submitted

    @property
    def itl_s(self) -> list[float]:
        """Gaps between the steps that gave tokens: the tokens of one step (accepted drafts) arrive together, as a
        streamed chunk does (vLLM's serving benchmark counts chunks so)."""
        times = self.token_times if not self.token_steps else [
            t for i, t in enumerate(self.token_times) if i == 0 or self.token_steps[i] != self.token_steps[i - 1]]
        return [b - a for a, b in zip(times, times[1:], strict=False)]


@dataclass
class ThroughputResult:
    num_requests: int
    concurrency: int
    wall_s: float
    output_tokens: int
    prompt_tokens: int
    output_tok_s: float
    requests_s: float
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]
    ttft_joining_ms: dict[str, float]  # requests after the first C whose prefill ran beside C - 1 decoding others
    peak_kv_usage: float
    peak_batch_size: int
    num_steps: int
    gflop: dict[str, float]
    gflop_s: float
    gflop_s_linear: float
    python_overhead: dict[str, dict[str, float]]  # "all_steps" and "batch_C": StepTimer.overhead() of those steps
    preemptions: int
    prefix_hits: int  # KV blocks taken from the prefix cache (0 unless prompts repeat or preempted requests
    # find their own blocks again)
    draft_tokens: int  # prompt lookup's drafts fed to the engine, and those taken (0 without prompt_lookup)
    accepted_draft_tokens: int
    config: dict[str, str | int]  # the LLM's: policy, max_batch_size, max_num_tokens, kv_pool_blocks, kv_pool_bytes
    clipped: dict | None = None  # requests cut to fit max_seq_len (bench_data.clipped_requests)
    records: list[RequestRecord] = field(repr=False, default_factory=list)

    def to_dict(self, with_requests: bool = False) -> dict:
        """Plain JSON values: a percentile without data (nan) is None."""
        out = json_ready(asdict(self))
        out.pop("records")
        if with_requests:
            out["requests"] = [{"prompt_tokens": r.prompt_tokens, "output_tokens": len(r.token_times),
                                "ttft_ms": r.ttft_s * 1000, "e2e_ms": r.e2e_s * 1000,
                                "itl_ms": [x * 1000 for x in r.itl_s],
                                "decoding_at_first_token": r.decoding_at_first_token} for r in self.records]
        return out


def fmt(value: float | None, spec: str | None = ".0f") -> str:
    """`spec` None: whole at 10 and above, two significant digits below (a fast engine's 0.4 ms is not "0")."""
    if value is None or not math.isfinite(value):
        return NO_DATA
    return format(value, spec or (".0f" if abs(value) >= 10 else ".2g"))


def fmt_percentiles(p: dict[str, float | None], spec: str | None = ".0f", sep: str = "/") -> str:
    return sep.join(fmt(p[k], spec) for k in ("p50", "p90", "p99"))


def result_line(r: ThroughputResult) -> str:
    e2e = r.e2e_ms["p50"] / 1000
    return (f"concurrency {r.concurrency:>3}: {r.output_tok_s:8.1f} out tok/s  {r.requests_s:6.2f} req/s  "
            f"TTFT p50/p90/p99 {fmt_percentiles(r.ttft_ms, None)} ms  ITL p50/p90/p99 "
            f"{fmt_percentiles(r.itl_ms, None)} ms  E2E p50 {fmt(e2e, None)} s  peak KV {100 * r.peak_kv_usage:.0f}%  "
            f"{r.gflop_s:.1f} GFLOP/s  "
            f"loop overhead {fmt(100 * r.python_overhead['all_steps']['outside_engine_step'], '.1f')}%"
            + (f"  drafts {r.accepted_draft_tokens}/{r.draft_tokens} taken" if r.draft_tokens else ""))


def config_line(config: dict) -> str:
    lookup = f", prompt lookup {config['prompt_lookup']}" if config.get("prompt_lookup") else ""
    return (f"policy {config['policy']}, max batch size {config['max_batch_size']}, max num tokens "
            f"{config['max_num_tokens']}, KV pool {config['kv_pool_blocks']} blocks "
            f"({config['kv_pool_bytes'] / 2**20:.1f} MiB){lookup}")


def clipped_requests(requests: list[BenchRequest], max_seq_len: int) -> dict | None:
    """How many requests were clipped to fit max_seq_len and to what (token totals over those), and how many lengths
    drawn below 1 token ran as 1 (NORMAL's tail), or None when neither happened."""
    changed = [r for r in requests if r.asked is not None]
    if not changed:
        return None
    clipped = [r for r in changed if len(r.prompt_ids) < max(r.asked[0], 1) or r.max_tokens < max(r.asked[1], 1)]
    raised = [r for r in changed if min(r.asked) < 1]
    prompt = {"asked": sum(r.asked[0] for r in clipped), "run": sum(len(r.prompt_ids) for r in clipped)}
    output = {"asked": sum(r.asked[1] for r in clipped), "run": sum(r.max_tokens for r in clipped)}
    return {"count": len(clipped), "of": len(requests), "max_seq_len": max_seq_len, "prompt_tokens": prompt,
            "output_tokens": output, "raised_to_one": len(raised)}


def clipped_lines(clipped: dict | None) -> list[str]:
    """A warning for requests cut to fit max_seq_len, a note for lengths raised to 1 token."""
    if not clipped:
        return []
    lines = []
    if clipped["count"]:
        p, o = clipped["prompt_tokens"], clipped["output_tokens"]
        lines.append(f"warning: {clipped['count']} of {clipped['of']} requests did not fit the engine's max_seq_len "
                     f"{clipped['max_seq_len']} (prompt + output) and were clipped: prompt tokens {p['asked']} -> "
                     f"{p['run']}, output tokens {o['asked']} -> {o['run']} (totals over those requests); rebuild "
                     "with a larger --max-seq-len or shorten the dataset's lengths to measure what was asked")
    if clipped.get("raised_to_one"):
        lines.append(f"note: {clipped['raised_to_one']} of {clipped['of']} requests drew a length below 1 token "
                     "(a NORMAL distribution's tail) and ran with 1")
    return lines


def concurrency_note(r: ThroughputResult) -> str | None:
    """A note when fewer requests than the concurrency ever ran in one step, or None."""
    if r.peak_batch_size >= r.concurrency:
        return None
    why = (f"{r.num_requests} requests in all" if r.peak_batch_size >= r.num_requests else
           "the KV pool or the token budget admitted no more: raise --kv-cache-memory or --max-num-tokens")
    return f"note: at concurrency {r.concurrency} at most {r.peak_batch_size} requests ran in one step ({why})"


def report_lines(results: list[ThroughputResult]) -> list[str]:
    """The printed report: the LLM's configuration, a clipping warning if any, one line per concurrency (and a note
    where fewer ran at once)."""
    if not results:
        return []
    lines = [config_line(results[0].config), *clipped_lines(results[0].clipped)]
    for r in results:
        lines += [result_line(r), *filter(None, [concurrency_note(r)])]
    return lines
