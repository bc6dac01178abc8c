"""What the batch loop reports: per-request outputs (to a request's sink), per-step stats and its current load."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from camshaft.runtime.request import GenerationResult
from camshaft.runtime.sampler import SampleResult


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    delta: str  # text that became safe to emit (may be empty while a stop string is held back)
    token_ids: tuple[int, ...] = ()  # tokens sampled since the previous output
    logprobs: tuple[SampleResult, ...] = ()  # their log-probs, when the request asked for them
    result: GenerationResult | None = None  # set on the request's last output
    error: Exception | None = None
    prompt_logprobs: list[SampleResult | None] | None = None  # on the first token's output, when asked for

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
