"""Per-request sampling parameters (vLLM/OpenAI names and meanings), validated on construction."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from camshaft.checks import is_int
from camshaft.errors import CapacityError, RequestError
from camshaft.model_config import ModelConfig
from camshaft.runtime.guided import GuidedDecodingParams
from camshaft.runtime.prompt_text import check_unicode

MAX_LOGPROBS = 20
MAX_STOP_STRINGS, MAX_STOP_CHARS = 64, 4096
MAX_BAD_WORDS, MAX_BAD_WORD_CHARS = 1024, 32768
MAX_STOP_WORD_IDS = 1024
MAX_LOGIT_BIAS = 1024
GREEDY_BELOW = 1e-5  # a temperature this small samples as greedy (vLLM's rule; 1/T would overflow float32)


def _require(ok: bool, message: str, field: str) -> None:
    if not ok:
        raise RequestError(message, field=field)


def _is_number(value: object) -> bool:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer past float's range
        return False


def _listed(value: object, name: str, example: str) -> tuple:
    """A list parameter as a tuple: None is empty (vLLM's default), a lone string one entry."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    _require(isinstance(value, Iterable) and not isinstance(value, (bytes, dict)),
             f"{name} must be a list (e.g. {example}), got {value!r:.200}", name)
    return tuple(value)  # type: ignore[arg-type]


def _bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs, from a mapping or pairs (None: none)."""
    if value is None:
        return ()
    items = value.items() if isinstance(value, Mapping) else value
    _require(isinstance(items, Iterable) and not isinstance(items, (str, bytes)),
             f"logit_bias must map token ids to biases (e.g. {{50256: -100}}), got {value!r:.200}", "logit_bias")
    pairs = [tuple(item) if isinstance(item, Iterable) and not isinstance(item, (str, bytes)) else (item,)
             for item in items]  # type: ignore[union-attr]
    _require(all(len(p) == 2 and is_int(p[0]) and p[0] >= 0 and _is_number(p[1]) and -100 <= p[1] <= 100
                 for p in pairs),
             f"logit_bias maps non-negative token ids to biases in [-100, 100] (OpenAI's range), got {value!r:.200}",
             "logit_bias")
    _require(len(pairs) <= MAX_LOGIT_BIAS, f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(pairs)}",
             "logit_bias")
    return tuple(sorted({int(t): float(b) for t, b in pairs}.items()))  # a token given twice: the last bias


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = 128  # None: as many as max_seq_len (or the KV budget) leaves after the prompt
    min_tokens: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # -1: none, a fresh stream (vLLM's)
    # list-valued fields take what vLLM's take (a string or any sequence, None for none) and are kept as tuples
    stop: str | Sequence[str] | None = ()
    stop_token_ids: Sequence[int] | None = ()
    stop_word_ids: Sequence[Sequence[int]] | None = ()  # token id sequences, as TensorRT-LLM's stop_words_list
    bad_words: str | Sequence[str] | None = ()
    bad_word_ids: Sequence[Sequence[int]] | None = ()  # token id sequences, as TensorRT-LLM's bad_words_list
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    beam_width: int = 1
    include_stop_str_in_output: bool = False
    # OpenAI's: {token id: bias in [-100, 100]} added to the logits (or (id, bias) pairs)
    logit_bias: Mapping[int, float] | Sequence[tuple[int, float]] | None = ()
    skip_special_tokens: bool = True  # vLLM's: special tokens left out of the text (their ids stay in token_ids)
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's log-prob (and this many alternatives); LLM only
    guided_decoding: GuidedDecodingParams | None = None  # the output held to a JSON schema, regex, choice or grammar

    def __post_init__(self) -> None:
        for name in ("stop", "bad_words"):
            value = getattr(self, name)
            words = _listed(value, name, '["\\n\\n"]')
            _require(all(isinstance(w, str) and w for w in words),
                     f"{name} must be a non-empty string or a list of them, got {value!r}", name)
            for word in words:
                check_unicode(word, f"{name} {word!r}", name)
            object.__setattr__(self, name, words)
        _require(len(self.stop) <= MAX_STOP_STRINGS and sum(map(len, self.stop)) <= MAX_STOP_CHARS,
                 f"stop takes at most {MAX_STOP_STRINGS} strings of {MAX_STOP_CHARS} characters in all (each is "
                 f"looked for after every token, on the loop every request shares); got {len(self.stop)} of "
                 f"{sum(map(len, self.stop))}", "stop")
        _require(len(self.bad_words) <= MAX_BAD_WORDS and sum(map(len, self.bad_words)) <= MAX_BAD_WORD_CHARS,
                 f"bad_words takes at most {MAX_BAD_WORDS} words of {MAX_BAD_WORD_CHARS} characters in all (each is "
                 f"checked at every token, on the loop every request shares); got {len(self.bad_words)} of "
                 f"{sum(map(len, self.bad_words))}", "bad_words")
        for name, limit in (("bad_word_ids", MAX_BAD_WORDS), ("stop_word_ids", MAX_STOP_WORD_IDS)):
            words = tuple(() if isinstance(w, (str, bytes)) or not isinstance(w, Iterable) else tuple(w)
                          for w in _listed(getattr(self, name), name, "[[5, 6]]"))
            _require(all(w and all(is_int(t) and t >= 0 for t in w) for w in words),
                     f"{name} must be non-empty lists of non-negative token ids (a list of id lists, e.g. "
                     f"[[5, 6]]), got {getattr(self, name)!r:.200}", name)
            _require(len(words) <= limit, f"{name} takes at most {limit} words, got {len(words)}", name)
            object.__setattr__(self, name, tuple(tuple(int(t) for t in w) for w in words))
        ids = _listed(self.stop_token_ids, "stop_token_ids", "[2]")
        _require(all(is_int(t) and t >= 0 for t in ids),
                 f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids!r}", "stop_token_ids")
        object.__setattr__(self, "stop_token_ids", ids)

        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            flag = getattr(self, name)
            _require(isinstance(flag, bool | np.bool_), f"{name} must be True or False, got {flag!r}", name)
            object.__setattr__(self, name, bool(flag))
        _require(self.max_tokens is None or is_int(self.max_tokens),
                 f"max_tokens must be an integer or None (all the engine leaves after the prompt), got "
                 f"{self.max_tokens!r}", "max_tokens")
        for name in ("min_tokens", "top_k", "n", "beam_width"):
            _require(is_int(getattr(self, name)), f"{name} must be an integer, got {getattr(self, name)!r}", name)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            _require(_is_number(getattr(self, name)), f"{name} must be a finite number, got {getattr(self, name)!r}",
                     name)

        _require(self.beam_width <= 1,
                 "beam search is not supported; use beam_width=1 (several outputs of one prompt: sample with n > 1 "
                 "in the Python or OpenAI API)", "beam_width")
        _require(self.beam_width == 1, f"beam_width must be 1, got {self.beam_width}", "beam_width")
        _require(self.max_tokens is None or self.max_tokens >= 1,
                 f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        _require(0 <= self.min_tokens <= (math.inf if self.max_tokens is None else self.max_tokens),
                 f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}",
                 "min_tokens")
        _require(self.temperature >= 0, f"temperature must be >= 0 (0 means greedy), got {self.temperature}",
                 "temperature")
        _require(self.top_k >= -1, f"top_k must be >= 1, or 0 or -1 to disable it, got {self.top_k}", "top_k")
        if self.top_k == -1:  # vLLM's "all tokens"
            object.__setattr__(self, "top_k", 0)
        _require(0 < self.top_p <= 1, f"top_p must be in (0, 1] (1 disables it), got {self.top_p}", "top_p")
        _require(0 <= self.min_p <= 1, f"min_p must be in [0, 1] (0 disables it), got {self.min_p}", "min_p")
        _require(self.repetition_penalty > 0,
                 f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}", "repetition_penalty")
        for name in ("presence_penalty", "frequency_penalty"):
            _require(-2 <= getattr(self, name) <= 2, f"{name} must be in [-2, 2], got {getattr(self, name)}", name)
        _require(self.seed is None or is_int(self.seed), f"seed must be an integer or None, got {self.seed!r}", "seed")
        if self.seed == -1:  # vLLM's "random", which clients send
            object.__setattr__(self, "seed", None)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(value is None or (is_int(value) and 0 <= value <= MAX_LOGPROBS),
                     f"{name} must be None or an integer in 0..{MAX_LOGPROBS}, got {value!r}", name)
        _require(self.n >= 1, f"n must be at least 1, got {self.n}", "n")
        for name in ("max_tokens", "min_tokens", "top_k", "n", "beam_width", "seed", "logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:  # numpy's numbers as Python's (JSON, repr), as the id lists
                object.__setattr__(self, name, int(getattr(self, name)))
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))
        _require(self.guided_decoding is None or isinstance(self.guided_decoding, GuidedDecodingParams),
                 f"guided_decoding must be a GuidedDecodingParams (e.g. GuidedDecodingParams(json=schema)) or None, "
                 f"got {self.guided_decoding!r:.100}", "guided_decoding")

    def for_prompt(self, prompt_tokens: int, max_seq_len: int, kv_tokens: int | None = None) -> SamplingParams:
        """These params for a prompt of `prompt_tokens` on an engine of `max_seq_len` whose KV cache holds
        `kv_tokens` of one request (None: max_seq_len): max_tokens None becomes what both leave; a prompt and
        max_tokens that cannot fit max_seq_len are refused (CapacityError)."""
        room = max_seq_len - prompt_tokens
        if room < 1:
            raise CapacityError(f"the prompt has {prompt_tokens} tokens; this engine's max_seq_len allows "
                                f"{max_seq_len} tokens in all (prompt + output). Shorten the prompt or rebuild with "
                                "a larger --max-seq-len.", field="prompt")
        if self.max_tokens is None:
            if kv_tokens is not None and kv_tokens - prompt_tokens < room:
                room = kv_tokens - prompt_tokens
                if room < 1:
                    raise CapacityError(f"the prompt has {prompt_tokens} tokens; the KV cache holds {kv_tokens} of "
                                        "one request: shorten the prompt or raise kv_cache_memory", field="prompt")
            if self.min_tokens > room:
                raise CapacityError(f"min_tokens {self.min_tokens} does not fit after the prompt ({prompt_tokens} "
                                    f"tokens) in the {prompt_tokens + room} tokens a request may hold; lower "
                                    "min_tokens", field="min_tokens")
            return replace(self, max_tokens=room)
        if self.max_tokens > room:
            raise CapacityError(f"prompt ({prompt_tokens} tokens) + max_tokens ({self.max_tokens}) exceeds the "
                                f"engine's max_seq_len ({max_seq_len}); pass max_tokens <= {room} or shorten the "
                                "prompt", field="prompt")
        return self

    @property
    def greedy(self) -> bool:
        """The output is the argmax of the processed logits (no randomness)."""
        return self.temperature < GREEDY_BELOW or self.top_k == 1


RECOMMENDED_TEMPERATURE = 1.0  # vLLM's SamplingParams default, under a recommendation that names no temperature


def recommended_sampling(model: ModelConfig) -> dict[str, float]:
    """What the model's generation_config.json recommends, as vLLM lays it over its own defaults: a recommendation
    without a temperature (Gemma 3's top_k 64, top_p 0.95) samples at temperature 1; none at all: {}."""
    recommended = dict(model.sampling_defaults)
    return {"temperature": RECOMMENDED_TEMPERATURE} | recommended if recommended else {}


def model_defaults(model: ModelConfig) -> SamplingParams:
    """SamplingParams with the sampling the model's generation_config.json recommends (vLLM's default), else
    camshaft's (greedy)."""
    try:
        return SamplingParams(**recommended_sampling(model))
    except RequestError as exc:
        raise RequestError(f"the engine's sampling defaults (from generation_config.json) are invalid: {exc}; "
                           "rebuild the engine from a corrected checkpoint") from exc
