"""Guided decoding (structured output): the output held to a JSON schema, any JSON object, a regular expression,
one of several strings or a grammar, by masking at every step the tokens the grammar cannot continue with.

The grammars are llguidance's (one of vLLM's structured-output backends): `GuidedDecodingParams` says what the
output must match, as vLLM's and TensorRT-LLM's classes of that name; `Guide` is one sequence's matcher.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from camshaft.errors import RequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# JSON laid out as Python's json.dumps writes it, no other whitespace: free whitespace lets small models run on in
# blanks until max_tokens (a schema's own top-level "x-guidance" settings replace this)
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class GuidedDecodingParams:
    """Exactly one of: json (a JSON schema, as a dict or its text), json_object=True (any JSON object), regex,
    choice (a list of strings), grammar (Lark, or llama.cpp's GBNF)."""

    json: str | Mapping | None = None
    json_object: bool = False
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise RequestError(f"guided decoding takes exactly one of {', '.join(KINDS)}; got "
                               f"{', '.join(given) or 'none'}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise RequestError(f"the guided json schema is not JSON ({exc}); send a JSON schema") from None
            if not isinstance(schema, Mapping):
                raise RequestError(f"the guided json schema must be a JSON object, got {self.json!r:.100}")
            object.__setattr__(self, "json", json.dumps(schema))  # property order is output order
        if self.json_object is not False and self.json_object is not True:
            raise RequestError(f"json_object must be True or False, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise RequestError(f"guided {name} must be a non-empty string, got {value!r:.100}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) and c for c in self.choice) \
                    or not self.choice:
                raise RequestError(f"guided choice must be a list of non-empty strings, got {self.choice!r:.100}")
            object.__setattr__(self, "choice", tuple(self.choice))

    def llguidance_grammar(self) -> str:
        import llguidance

        if self.json is not None or self.json_object:
            schema = json.loads(self.json) if self.json is not None else {"type": "object"}
            schema.setdefault("x-guidance", COMPACT)
            return llguidance.grammar_from("json_schema", json.dumps(schema))
        if self.regex is not None:
            return llguidance.grammar_from("regex", self.regex)
        if self.choice is not None:
            return llguidance.grammar_from("choice", json.dumps(list(self.choice)))
        return llguidance.grammar_from("grammar", self.grammar)


class Guides:
    """Makes each sequence's Guide; the tokenizer as llguidance reads it is built on first use (~0.4 s for a 49k
    vocabulary), once per engine."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._source = (tokenizer, vocab_size, list(eos_token_ids) or None)
        self._tokenizer = None
        self._lock = threading.Lock()

    def __call__(self, params: GuidedDecodingParams) -> Guide:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                tokenizer, vocab_size, eos = self._source
                self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        return Guide(params, self._tokenizer)


class Guide:
    """One sequence's grammar state: which tokens may come next, and whether the grammar is complete."""

    def __init__(self, params: GuidedDecodingParams, ll_tokenizer) -> None:
        import llguidance
        import llguidance.numpy as ll_numpy

        self._fill = ll_numpy.fill_next_token_bitmask
        self.matcher = llguidance.LLMatcher(ll_tokenizer, params.llguidance_grammar(), log_level=0)
        if self.matcher.is_error():
            raise RequestError(f"guided decoding: {self.matcher.get_error().strip()}")
        self._bits = ll_numpy.allocate_token_bitmask(1, ll_tokenizer.vocab_size)

    def banned(self, vocab_size: int) -> np.ndarray:
        """A boolean mask of the tokens the grammar does not allow next."""
        self._fill(self.matcher, self._bits, 0)
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:vocab_size]
        return allowed == 0

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RequestError(f"guided decoding: token {token} does not continue the grammar "
                               f"({self.matcher.get_error().strip() or 'not allowed'})")

    @property
    def complete(self) -> bool:
        """Nothing but an end id can follow: the output matches the grammar and can stop here."""
        return self.matcher.is_stopped()
