"""Results and what the batch loop reports: a request's GenerationResult (timings, metrics), a prompt's outputs, a
stream's steps, per-step stats and the current load."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

from camshaft.runtime.sampler import SampleResult


@dataclass(frozen=True)
class Timings:
    queued_s: float  # arrival to admission (the running batch, or the Session's turn)
    ttft_s: float
    total_s: float
    prompt_tokens: int
    output_tokens: int

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.ttft_s if self.ttft_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        decode_time = self.total_s - self.ttft_s
        return (self.output_tokens - 1) / decode_time if self.output_tokens > 1 and decode_time > 0 else 0.0


@dataclass(frozen=True)
class RequestMetrics:
    """A request's times and counts, as TensorRT-LLM reports them with return_perf_metrics. Times: seconds of
    time.perf_counter() (the monotonic clock, TensorRT-LLM's steady_clock: compare them with each other, not with
    the wall clock; None: not reached). KV blocks: the prompt's, counted when the in-flight batcher admitted the
    request (summed over admissions: a preempted request is admitted again with its output so far, and may find its
    own blocks still cached; those a sliding window has passed are in neither count; 0 from a Session)."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    kv_blocks_reused: int = 0  # taken from the prefix cache
    kv_blocks_new: int = 0  # computed for the rest of the prompt (a sliding window's: blocks behind it skipped)
    draft_tokens: int = 0  # prompt lookup's drafts fed to the engine
    accepted_draft_tokens: int = 0  # drafts equal to the token sampled in their place

    @property
    def kv_blocks_total(self) -> int:
        return self.kv_blocks_reused + self.kv_blocks_new

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_token_ids: list[int]
    timings: Timings
    logprobs: list[SampleResult] | None = None
    stop_token_id: int | None = None  # the end id or stop_token_ids entry that ended it (token_ids[-1]), else None
    stop_reason: str | int | tuple[int, ...] | None = None  # vLLM's: the stop string, stop_token_ids entry or
    # stop_word_ids sequence that ended it; None for an end id, the length limit or an abort
    prompt_logprobs: list[SampleResult | None] | None = None  # vLLM's: None for the first prompt token, then each
    # prompt token's log-prob given the tokens before it (with prompt_logprobs alternatives), when asked for
    metrics: RequestMetrics | None = None
    index: int = 0  # which of the prompt's n outputs (vLLM's CompletionOutput.index)

    @property
    def cumulative_logprob(self) -> float | None:
        """Sum of the chosen tokens' log-probs (vLLM's), when logprobs were asked for."""
        return None if self.logprobs is None else float(sum(s.logprob or 0.0 for s in self.logprobs))


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    delta: str  # text that became safe to emit (may be empty while a stop string is held back)
    token_ids: tuple[int, ...] = ()  # tokens sampled since the previous output
    logprobs: tuple[SampleResult, ...] = ()  # their log-probs, when the request asked for them
    result: GenerationResult | None = None  # set on the request's last output
    error: Exception | None = None
    prompt_logprobs: list[SampleResult | None] | None = None  # on the first token's output, when asked for
    metrics: RequestMetrics | None = None  # the request's so far, on each output the batch loop delivers

    @property
    def finished(self) -> bool:
        return self.result is not None or self.error is not None


@dataclass(frozen=True)
class IterationStats:
    batch_size: int
    num_tokens: int
    num_prefill_tokens: int
    queue_length: int
    kv_blocks_used: int
    kv_blocks_total: int
    step_s: float
    num_prefill_requests: int = 0  # requests with prompt tokens in the step

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total


Sink = Callable[[RequestOutput], None]


@dataclass(frozen=True)
class Load:
    """What the batch loop holds now: for metrics, health checks and admission."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_hits: int
    preemptions: int
    draft_tokens: int = 0  # prompt lookup's drafts fed to the engine, and those taken, since start
    accepted_draft_tokens: int = 0

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total


@dataclass(frozen=True)
class PromptOutput:
    """The n outputs of one prompt (n = SamplingParams.n)."""

    prompt_token_ids: list[int]
    outputs: list[GenerationResult]
    request_id: str = ""  # the prompt's id (LLM.abort takes it)
    prompt: str | None = None  # the prompt's text (a chat's as its template wrote it); None when ids were given

    @property
    def finished(self) -> bool:
        """Always true: generate() returns finished outputs (vLLM's field)."""
        return True

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def prompt_logprobs(self) -> list[SampleResult | None] | None:
        """The prompt's log-probs (vLLM's field; each output holds the same)."""
        return self.outputs[0].prompt_logprobs


def own_error(error: Exception) -> Exception:
    """A copy of `error` for one request's output (its traceback so far, cause and context kept): one object raised
    by every request it ended grew one traceback with all their frames."""
    try:
        mine = copy.copy(error)
    except Exception:  # an exception type that cannot be rebuilt from its args
        return error
    mine.__traceback__, mine.__cause__, mine.__context__ = error.__traceback__, error.__cause__, error.__context__
    mine.__suppress_context__ = error.__suppress_context__
    return mine
