"""Per-request logits processing and sampling on numpy rows.

Order: logit_bias -> repetition penalty -> presence/frequency penalties -> bad words -> min_tokens -> guided decoding ->
greedy argmax, or temperature -> top_k -> top_p -> min_p -> draw (transformers' order; vLLM applies min_p before
top_k/top_p, which differs only when min_p and top_p are combined). Logprobs are log_softmax of the RAW model logits
(vLLM's default). Repetition penalty covers prompt + output tokens, presence/frequency only output tokens;
min_tokens bans stop_token_ids and, unless ignore_eos, the eos ids; guided decoding bans what its grammar cannot
continue with. `SequenceSampler.sample` records the token it returns.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from camshaft.errors import RequestError
from camshaft.runtime.guided import Guide
from camshaft.runtime.row_select import draw, nucleus, top_k_indices
from camshaft.runtime.sampling_params import SamplingParams

_TINY = np.finfo(np.float32).tiny
BROKEN_LOGITS = ("the model's logits are not finite (NaN or infinity): the engine or its weights are broken, or a "
                 "float16 engine's activations overflowed; rebuild the engine from a checkpoint whose weights are "
                 "finite (a float16 one in bfloat16: --dtype bfloat16)")


@dataclass(frozen=True)
class SampleResult:
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None  # None unless logprobs > 0; best first


class _ScratchRows(threading.local):
    """Per-thread work rows reused across calls: fresh ~200 KB temporaries would page-fault on every token."""

    def get(self, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        rows = getattr(self, "rows", None)
        if rows is None or rows[0].size != size:
            rows = self.rows = (*(np.empty(size, dtype=np.float32) for _ in range(3)), np.empty(size, dtype=np.intp))
        return rows


_scratch = _ScratchRows()


class _TokenCounts:
    """Counts per token id plus the distinct ids seen, so penalties cost O(distinct) rather than O(vocab)."""

    def __init__(self, vocab_size: int, initial: np.ndarray | None = None) -> None:
        self.counts = np.zeros(vocab_size, dtype=np.int32)
        distinct, counts = np.unique(initial if initial is not None else [], return_counts=True)
        self.counts[distinct.astype(np.int64)] = counts
        self._ids = np.empty(max(64, 2 * distinct.size), dtype=np.int64)
        self._ids[: distinct.size] = distinct
        self._num_ids = distinct.size

    def add(self, token_id: int) -> None:
        if self.counts[token_id] == 0:
            if self._num_ids == self._ids.size:
                self._ids = np.concatenate([self._ids, np.empty_like(self._ids)])
            self._ids[self._num_ids] = token_id
            self._num_ids += 1
        self.counts[token_id] += 1

    @property
    def ids(self) -> np.ndarray:
        return self._ids[: self._num_ids]


class SequenceSampler:
    """Sampling state of one output sequence. Give each of a request's n sequences its own `sequence_index`:
    with a seed, equal indices draw equal tokens."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], eos_token_ids: tuple[int, ...],
                 bad_word_ids: Sequence[Sequence[int]], vocab_size: int, sequence_index: int = 0,
                 guide: Guide | None = None) -> None:
        self.params, self.guide = params, guide
        self.vocab_size = vocab_size
        bad_ids = [t for word in bad_word_ids for t in word]
        stop_word_ids = [t for word in params.stop_word_ids for t in word]
        bias_ids = [t for t, _ in params.logit_bias]
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("stop_word_ids", stop_word_ids),
                          ("bad_words", bad_ids), ("logit_bias", bias_ids), ("prompt", prompt_ids)):
            if len(ids) and (min(ids) < 0 or max(ids) >= vocab_size):  # Python ints: no overflow on huge ids
                raise RequestError(f"{name} contains a token id outside the vocabulary (0..{vocab_size - 1}); "
                                   "check the ids against the model's tokenizer", field=name)
        self._bias_ids = np.array(bias_ids, dtype=np.int64)  # checked above: huge ids would overflow here
        self._bias = np.array([b for _, b in params.logit_bias], dtype=np.float32)
        prompt = np.asarray(prompt_ids, dtype=np.int64)
        # every integer seed its own stream: a negative one as its magnitude under another spawn key
        seed, key = (None, (sequence_index,)) if params.seed is None else \
            (abs(params.seed), (sequence_index,) if params.seed >= 0 else (sequence_index, 1))
        self._rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=key)))
        self.generated_ids: list[int] = []
        self._seen = None
        if params.repetition_penalty != 1.0:
            self._seen = _TokenCounts(vocab_size, prompt)
        self._output_counts = None
        if params.presence_penalty or params.frequency_penalty:
            self._output_counts = _TokenCounts(vocab_size)
        words = [tuple(int(t) for t in w) for w in bad_word_ids if len(w)]
        self._always_banned = np.array(sorted({w[0] for w in words if len(w) == 1}), dtype=np.int64)
        self._banned_after = [(w[:-1], w[-1]) for w in words if len(w) > 1]
        # past ~1e38 1/T is 0 in float32, and a banned token's -inf times 0 would be NaN
        self._inv_temperature = max(np.float32(1.0 / params.temperature), _TINY) if not params.greedy else None
        early_stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self._early_stop_ids = np.array(sorted(early_stops), dtype=np.int64)

    @property
    def plain_greedy(self) -> bool:
        """The next token is the raw logits' argmax and nothing else of them is read (no log-probs)."""
        return self.params.greedy and self.params.logprobs is None and not self._transforms_logits

    @property
    def _transforms_logits(self) -> bool:
        return bool(self._seen is not None or self._output_counts is not None or self._always_banned.size
                    or self._bias.size or self.guide is not None
                    or self._banned_after or (len(self.generated_ids) < self.params.min_tokens
                                              and self._early_stop_ids.size))

    def processed_logits(self, logits_row: np.ndarray) -> np.ndarray:
        """Logits after logit_bias, penalties and bans, before temperature; a new array (the input is not
        modified)."""
        return self._process(logits_row, np.empty(logits_row.shape[-1], dtype=np.float32))

    def _process(self, logits_row: np.ndarray, x: np.ndarray) -> np.ndarray:
        x[...] = logits_row
        p = self.params
        x[self._bias_ids] += self._bias  # on the model's logits, as OpenAI adds it
        if self._seen is not None:
            ids = self._seen.ids
            vals = x[ids]
            with np.errstate(over="ignore"):  # an overflow is refused in sample() with a clear message
                x[ids] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if self._output_counts is not None:
            ids = self._output_counts.ids
            x[ids] -= p.presence_penalty + p.frequency_penalty * self._output_counts.counts[ids]
        x[self._always_banned] = -np.inf
        tail = self.generated_ids
        for prefix, last in self._banned_after:
            if len(tail) >= len(prefix) and tuple(tail[len(tail) - len(prefix):]) == prefix:
                x[last] = -np.inf
        if len(tail) < p.min_tokens:
            x[self._early_stop_ids] = -np.inf
        if self.guide is not None:
            x[self.guide.banned(x.size)] = -np.inf
        return x

    def sample(self, logits_row: np.ndarray) -> SampleResult:
        """Choose the next token from one row of model logits (shape [vocab]) and record it."""
        rows = _scratch.get(logits_row.shape[-1])
        x = self._process(logits_row, rows[0]) if self._transforms_logits else logits_row
        best = int(np.argmax(x))  # a NaN anywhere is the argmax
        top = float(x[best])
        if np.isnan(top) or not np.isfinite(logits_row[best]):
            raise RequestError(BROKEN_LOGITS)
        if top == -np.inf:
            raise RequestError("every token is banned; relax bad_words / min_tokens / stop_token_ids / "
                               "guided_decoding")
        if top == np.inf:
            raise RequestError("the penalties pushed a logit to infinity; use a repetition_penalty nearer 1")
        token = best if self.params.greedy else self._sample_filtered(x, top, rows)
        return self._record(token, logits_row)

    def _sample_filtered(self, x: np.ndarray, top: float, rows: tuple[np.ndarray, ...]) -> int:
        p = self.params
        log_weights = np.subtract(x, np.float32(top), out=rows[1])
        log_weights *= self._inv_temperature
        weights = np.exp(log_weights, out=rows[2])  # the most likely token has weight 1
        kept = None
        if p.top_k and p.top_k < x.size:
            kept = top_k_indices(x, p.top_k, keep_ties=True)
            if p.top_p < 1.0:
                w = weights[kept]
                mass_before = np.cumsum(w, dtype=np.float64) - w
                kept = kept[mass_before < p.top_p * w.sum(dtype=np.float64)]
        elif p.top_p < 1.0:
            kept = nucleus(log_weights, weights, p.top_p * weights.sum(dtype=np.float64), rows[3])
        if p.min_p > 0.0:
            kept = np.flatnonzero(weights >= p.min_p) if kept is None else kept[weights[kept] >= p.min_p]
        if kept is None:
            return draw(weights, self._rng.random())
        return int(kept[draw(weights[kept], self._rng.random())])

    def _record(self, token: int, raw_row: np.ndarray) -> SampleResult:
        if self.guide is not None:
            self.guide.advance(token)
        self.generated_ids.append(token)
        if self._seen is not None:
            self._seen.add(token)
        if self._output_counts is not None:
            self._output_counts.add(token)
        want = self.params.logprobs
        return SampleResult(token) if want is None else logprob_of(raw_row, token, want)


def logprob_of(raw_row: np.ndarray, token: int, alternatives: int) -> SampleResult:
    """`token`'s log-prob under the log_softmax of a raw logits row, with the `alternatives` most likely tokens'."""
    raw = np.asarray(raw_row, dtype=np.float32)
    top = float(raw.max())
    shifted = np.subtract(raw, np.float32(top), out=_scratch.get(raw.size)[1])
    log_total = top + float(np.log(np.exp(shifted, out=shifted).sum(dtype=np.float64)))
    best = None
    if alternatives > 0:
        best = tuple((int(i), float(raw[i]) - log_total) for i in top_k_indices(raw, alternatives))
    return SampleResult(token, float(raw[token]) - log_total, best)


def sample_batch(samplers: Sequence[SequenceSampler], logits: np.ndarray) -> list[SampleResult | Exception]:
    """Sample row i of logits [batch, vocab] with samplers[i]; plain greedy rows share one vectorised argmax. A row
    that cannot be sampled gets its exception in its place, so one request's error never stops the others."""
    plain = [i for i, s in enumerate(samplers) if s.plain_greedy]
    results: list[SampleResult | None] = [None] * len(samplers)
    if plain:
        tokens = np.argmax(logits, axis=1)  # all rows: cheaper than gathering the plain ones
        finite = np.isfinite(logits[plain, tokens[plain]])  # a NaN or an infinity is the argmax: refused by sample()
        for i, ok in zip(plain, finite.tolist(), strict=True):
            if ok:
                results[i] = samplers[i]._record(int(tokens[i]), logits[i])
    for i, sampler in enumerate(samplers):
        if results[i] is None:
            try:
                results[i] = sampler.sample(logits[i])
            except Exception as exc:  # the request's error (a bug's too: not the loop every request shares)
                results[i] = exc
    return results  # type: ignore[return-value]


def tokenize_bad_words(tokenizer, words: Sequence[str]) -> list[list[int]]:
    """Token ids of each bad word as it would appear at the start of the text and after a space (as vLLM does); a word
    of whitespace alone is banned as it is (its "after a space" form would ban the space)."""
    variants = [v for word in words for v in ((word.lstrip(), " " + word.lstrip()) if word.strip() else (word,))]
    encoded = tokenizer(variants, add_special_tokens=False)["input_ids"] if variants else []
    return [list(ids) for ids in dict.fromkeys(tuple(ids) for ids in encoded if ids)]
