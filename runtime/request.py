"""The request record: the one piece of state shared by the session, the scheduler and the executor."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from camshaft.errors import RequestError
from camshaft.runtime.detokenizer import TextStream
from camshaft.runtime.guided import Guide, Guides
from camshaft.runtime.outputs import GenerationResult, RequestMetrics, Timings
from camshaft.runtime.sampler import SampleResult, SequenceSampler, logprob_of, tokenize_bad_words
from camshaft.runtime.sampling_params import SamplingParams


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sampler: SequenceSampler
    text: TextStream
    eos_token_ids: tuple[int, ...]
    output_ids: list[int] = field(default_factory=list)
    samples: list[SampleResult] = field(default_factory=list)
    prompt_samples: list[SampleResult] = field(default_factory=list)  # prompt tokens 1.. (prompt_logprobs)
    blocks: list[int] = field(default_factory=list)  # the block table: position p's K/V is in blocks[p // size]
    released_blocks: int = 0  # table entries before this one are the null block (behind a sliding window)
    stop_words: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)  # stop_word_ids by their last id
    num_computed: int = 0
    priority: int = 0  # lower runs first (vLLM's meaning); ties: first come, first served
    queue_order: int = 0  # set by the scheduler when the request arrives
    finish_reason: str | None = None
    stop_token_id: int | None = None
    stop_reason: str | int | tuple[int, ...] | None = None
    arrival: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None  # first taken into the running batch (a preempted request keeps it)
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    kv_blocks_reused: int = 0  # RequestMetrics' counts (summed over admissions)
    first_reused_blocks: int | None = None  # prompt blocks the first admission did not compute (prefix cache)
    kv_blocks_new: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    prompt_id: str = ""  # the prompt's id, shared by its n requests ("" : the request's own)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_length(self) -> int:
        """The most tokens it may reach: prompt + max_tokens."""
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def longest_pass(self) -> int:
        """The most tokens a forward pass over it covers: max_length - 1 (the last token is sampled, never fed)."""
        return self.max_length - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_prompt_rows(self) -> bool:
        """Prompt log-probs were asked for and some are not recorded yet: every computed row's logits are wanted."""
        return self.params.prompt_logprobs is not None and len(self.prompt_samples) < len(self.prompt_ids) - 1

    def add_prompt_rows(self, rows, start: int) -> None:
        """Record the prompt tokens that the logits rows of positions start, start+1, ... predict (once each: a
        recomputed prompt is not recorded again)."""
        for offset, row in enumerate(rows):
            target = start + offset + 1
            if target == len(self.prompt_samples) + 1 and target < len(self.prompt_ids):
                self.prompt_samples.append(logprob_of(row, self.prompt_ids[target], self.params.prompt_logprobs or 0))

    def add_sample(self, sample: SampleResult) -> str:
        """Record a sampled token; returns the text delta that became safe to emit, and sets finish_reason."""
        now = self.last_token_at = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
        token = sample.token_id
        self.output_ids.append(token)
        if self.params.logprobs is not None:
            self.samples.append(sample)
        params = self.params
        may_stop = len(self.output_ids) > params.min_tokens  # a stop must end past the first min_tokens tokens
        end_id = not params.ignore_eos and token in self.eos_token_ids
        stop_id = may_stop and (end_id or token in params.stop_token_ids)
        guide = self.sampler.guide
        guide_end = guide is not None and token in self.eos_token_ids and guide.complete  # even under ignore_eos
        # a stop token's text is left out unless include_stop_str_in_output (vLLM); its id stays in the output
        delta = "" if (stop_id or guide_end) and not params.include_stop_str_in_output else self.text.append(token)
        word = self._stop_word(token) if may_stop else None
        if self.text.stopped or stop_id or word:
            self.finish_reason = "stop"
            self.stop_token_id = token if stop_id else None
            # vLLM's: the stop string, else a stop token id (the tokenizer's eos is tested first: None; the model's
            # other end ids are vLLM's stop_token_ids), else the stop word
            eos = end_id and token == self.eos_token_ids[0]
            self.stop_reason = (self.text.matched_stop if self.text.matched_stop is not None
                                else token if stop_id and not eos else word)
        if self.finish_reason is None and guide is not None and guide.complete:  # only an end id could follow
            self.finish_reason = "stop"
            self.stop_token_id = token if token in self.eos_token_ids else None  # an end id the grammar ended on
        if self.finish_reason is None and len(self.output_ids) >= params.max_tokens:
            self.finish_reason = "length"
        if self.finish_reason is not None:
            self.finished_at = now
            if not self.text.stopped:
                delta += self.text.finish()
                if self.text.stopped:  # a stop string in what only the flush decoded (held back, a partial character)
                    self.finish_reason, self.stop_reason = "stop", self.text.matched_stop
        return delta

    def _stop_word(self, token: int) -> tuple[int, ...] | None:
        """The stop_word_ids entry the sequence (prompt and output, as TensorRT-LLM matches) ends with; its ids and
        text stay in the output."""
        words = self.stop_words.get(token)
        if not words:
            return None
        ids = self.output_ids if max(map(len, words)) <= len(self.output_ids) else self.all_ids
        return next((word for word in words if tuple(ids[-len(word):]) == word), None)

    @property
    def prompt_logprobs(self) -> list[SampleResult | None] | None:
        return None if self.params.prompt_logprobs is None else [None, *self.prompt_samples]

    def add_drafted(self, rows, drafts: list[int] | tuple[int, ...]) -> tuple[list[str], list[SampleResult]]:
        """Sample the logits rows of a token and its drafts in turn, each sample recorded before the next row is
        sampled (penalties, grammars), as without drafts; stops at the first sample that differs from its draft, at
        the row after the last draft, or when the request finishes. Returns each sample's text delta and the samples
        taken: the cache holds as many of the fed tokens (the decode token and the drafts taken)."""
        deltas, taken = [], []
        for i, row in enumerate(rows):
            taken.append(self.sampler.sample(row))
            deltas.append(self.add_sample(taken[-1]))
            if self.finished or i >= len(drafts) or taken[-1].token_id != drafts[i]:
                break
        self.draft_tokens += len(drafts)
        self.accepted_draft_tokens += sum(s.token_id == d for s, d in zip(taken, drafts, strict=False))
        return deltas, taken

    def result(self) -> GenerationResult:
        end = self.finished_at or time.perf_counter()
        first = self.first_token_at or end
        queued = (self.admitted_at or end) - self.arrival  # never admitted: it waited until it ended
        timings = Timings(queued, first - self.arrival, end - self.arrival, len(self.prompt_ids), len(self.output_ids))
        return GenerationResult(
            text=self.text.text,
            token_ids=list(self.output_ids),
            finish_reason=self.finish_reason or "abort",
            prompt_token_ids=list(self.prompt_ids),
            timings=timings,
            logprobs=list(self.samples) if self.params.logprobs is not None else None,
            stop_token_id=self.stop_token_id,
            stop_reason=self.stop_reason,
            prompt_logprobs=self.prompt_logprobs,
            metrics=self.metrics(),
            index=sequence_of(self.request_id, self.params.n)[1],
        )

    def metrics(self) -> RequestMetrics:
        return RequestMetrics(self.arrival, self.admitted_at, self.first_token_at, self.last_token_at,
                              self.kv_blocks_reused, self.kv_blocks_new, self.draft_tokens, self.accepted_draft_tokens)


def new_requests(request_id: str, prompt_ids: list[int], params: SamplingParams, tokenizer: object,
                 eos_token_ids: tuple[int, ...], vocab_size: int, priority: int = 0,
                 guides: Guides | None = None) -> list[Request]:
    """The params.n requests one prompt makes, each with its own sampler and text stream (ids `request_id`, or
    `request_id-i` when n > 1)."""
    bad_words = tokenize_bad_words(tokenizer, params.bad_words) + [list(w) for w in params.bad_word_ids]
    stop_words = stop_words_by_last_id(params.stop_word_ids)  # read only: the n requests share it
    guide = _guide(params, guides)  # compiled once; each sequence gets its own state
    return [Request(request_id if params.n == 1 else f"{request_id}-{i}", prompt_ids, params,  # see sequence_of
                    SequenceSampler(params, prompt_ids, eos_token_ids, bad_words, vocab_size, sequence_index=i,
                                    guide=guide if guide is None or i == 0 else guide.copy()),
                    TextStream(tokenizer, prompt_ids, params.stop, include_stop=params.include_stop_str_in_output,
                               skip_special_tokens=params.skip_special_tokens,
                               min_tokens=params.min_tokens),
                    eos_token_ids, priority=priority, stop_words=stop_words, prompt_id=request_id)
            for i in range(params.n)]


def sequence_of(request_id: str, n: int) -> tuple[str, int]:
    """(the prompt's id, the sequence index) of one of a prompt's n requests, as new_requests names them."""
    if n == 1:
        return request_id, 0
    prompt, index = request_id.rsplit("-", 1)
    return prompt, int(index)


def _guide(params: SamplingParams, guides: Guides | None) -> Guide | None:
    if params.guided_decoding is None:
        return None
    if guides is None:
        raise RequestError("guided decoding needs the engine's tokenizer; submit through LLM or Session")
    return guides(params.guided_decoding)


def stop_words_by_last_id(words: tuple[tuple[int, ...], ...]) -> dict[int, list[tuple[int, ...]]]:
    by_last: dict[int, list[tuple[int, ...]]] = {}
    for word in words:
        by_last.setdefault(word[-1], []).append(word)
    return by_last
