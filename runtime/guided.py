"""Guided decoding (structured output): the output held to a JSON schema, any JSON object, a regular expression,
one of several strings or a grammar, by masking at every step the tokens the grammar cannot continue with.

The grammars are llguidance's (one of vLLM's structured-output backends): `GuidedDecodingParams` says what the
output must match, as vLLM's and TensorRT-LLM's classes of that name; `Guide` is one sequence's matcher.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from camshaft.errors import RequestError
from camshaft.runtime.prompt_text import check_unicode

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# JSON laid out as Python's json.dumps writes it, no other whitespace: free whitespace lets small models run on in
# blanks until max_tokens (a schema's own top-level "x-guidance" settings override what they name; asking for free
# whitespace, whitespace_flexible true or a whitespace_pattern, replaces the whole layout, whose separators would bind)
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
OPEN_KEYS = {"additionalProperties", "patternProperties", "unevaluatedProperties"}
# Where JSON Schema holds subschemas: maps of them, one, and lists of them ("items" may be either)
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_ONE = ("items", "contains", "additionalProperties", "not", "if", "then", "else", "propertyNames",
              "unevaluatedProperties", "unevaluatedItems", "additionalItems")
SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
UNIONS = ("anyOf", "oneOf")
# Keys beside "properties" through which an object may have more: its parent is left open (closed, it would refuse
# what they allow, as would a "required" name it does not list or an allOf branch that cannot be merged)
EXTENDING = {"anyOf", "oneOf", "if", "then", "else", "dependentSchemas", "$ref"}


@dataclass(frozen=True)
class GuidedDecodingParams:
    """Exactly one of: json (a JSON schema, as a dict or its text), json_object=True (any JSON object), regex,
    choice (a list of strings), grammar (Lark, or llama.cpp's GBNF). An object schema that does not say
    additionalProperties allows none (as vLLM's default backend and TensorRT-LLM do)."""

    json: str | Mapping | None = None
    json_object: bool = False
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, str | bytes | Mapping):
            try:
                object.__setattr__(self, "choice", tuple(self.choice))
            except TypeError:
                pass  # not iterable: refused below
        given = [k for k in KINDS if getattr(self, k) is not None and getattr(self, k) is not False]
        if len(given) != 1:
            raise _refused(f"guided decoding takes exactly one of {', '.join(KINDS)}; got "
                               f"{', '.join(given) or 'none'}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        if self.json_object is None:  # vLLM's default, and what a client sending nulls sends
            object.__setattr__(self, "json_object", False)
        if self.json_object is not False and self.json_object is not True:
            raise _refused(f"json_object must be True or False, got {self.json_object!r:.100}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise _refused(f"guided {name} must be a non-empty string, got {value!r:.100}")
        if self.choice is not None and not (isinstance(self.choice, tuple) and self.choice
                                            and all(isinstance(c, str) and c for c in self.choice)):
            raise _refused(f"guided choice must be a list of non-empty strings, got {self.choice!r:.100}")
        for text in (self.regex, self.grammar, *(self.choice or ())):
            if text is not None:
                check_unicode(text, f"the guided {given[0]}", "guided_decoding")

    def llguidance_grammar(self) -> str:
        import llguidance

        if self.json is not None or self.json_object:
            schema = json.loads(self.json) if self.json is not None else {"type": "object"}
            given = schema.get("x-guidance")  # the schema's own settings; asking for free whitespace drops compact's
            free = isinstance(given, Mapping) and (given.get("whitespace_flexible") is True
                                                   or given.get("whitespace_pattern") is not None)
            layout = {} if free else COMPACT
            schema["x-guidance"] = {**layout, **given} if isinstance(given, Mapping) else given or COMPACT
            return llguidance.grammar_from("json_schema", json.dumps(schema))
        if self.regex is not None:
            return llguidance.grammar_from("regex", self.regex)
        if self.choice is not None:  # one regex of the escaped strings (llguidance's choice rule caps its size)
            return llguidance.grammar_from("regex", "|".join(re.escape(c) for c in self.choice))
        try:  # GBNF is converted here, so its errors come now; a Lark grammar's come when the matcher compiles it
            return llguidance.grammar_from("grammar", self.grammar)
        except ValueError as exc:
            raise _refused(f"guided decoding: the grammar does not compile: {_first_line(str(exc))}") from None


def _schema_text(schema: object) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as exc:
            raise _refused(f"the guided json schema is not JSON ({str(exc)[:200]}); send a JSON schema") from None
    if not isinstance(schema, Mapping):  # true and false are schemas too; {} is the one that allows any value
        raise _refused(f"the guided json schema must be a JSON object, got {schema!r:.100}; send an object "
                           "schema ({} allows any JSON value)")
    try:
        defs = {f"#/{key}/{name}": sub for key in ("$defs", "definitions") if isinstance(schema.get(key), Mapping)
                for name, sub in schema[key].items()}
        return json.dumps(_closed(schema, defs), allow_nan=False)  # property order is output order; NaN is not JSON
    except (ValueError, TypeError, RecursionError) as exc:
        raise _refused(f"the guided json schema is not JSON ({str(exc)[:200]}); send a JSON schema") from None


def _closed(schema: object, defs: Mapping[str, object], close: bool = True, inlined: frozenset = frozenset(),
            extended: bool = False) -> object:
    """additionalProperties false wherever an object schema lists properties and says nothing of others; only
    subschemas are visited (never a const, enum, default or example value). The branches of an allOf stay open (each
    closed alone would forbid the others' properties): their parent is closed over all their properties instead. An
    object that may have more properties another way (EXTENDING, a required name that neither it nor an allOf branch
    lists, an allOf branch with one of EXTENDING) stays open, as do the branches of a union beside properties or in an
    allOf branch whose siblings add properties (`extended`). A branch that only names a local
    definition (and a $ref beside properties, as an allOf branch) is that definition's text, once per path, so the
    definition's own closing does not forbid the parent's properties."""
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {name: _closed(sub, defs, inlined=inlined) for name, sub in out[key].items()}
    for key in SCHEMA_ONE:
        if key in out:
            out[key] = [_closed(sub, defs, inlined=inlined) for sub in out[key]] if isinstance(out[key], list) \
                else _closed(out[key], defs, inlined=inlined)
    beside = isinstance(out.get("properties"), Mapping)  # a union's branches add to the parent's properties
    if beside and out.get("$ref") in defs and out["$ref"] not in inlined:
        out["allOf"] = [{"$ref": out.pop("$ref")}, *(out.get("allOf") if isinstance(out.get("allOf"), list) else [])]
    for key in SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            keep_open = key == "allOf" or ((beside or extended) and key in UNIONS)
            branches = [_definition(sub, defs, inlined) if keep_open else (sub, inlined) for sub in out[key]]
            out[key] = [_closed(sub, defs, close=not keep_open, inlined=seen,
                                extended=keep_open and (key in UNIONS or beside or extended
                                                        or _others_add(out[key], i)))
                        for i, (sub, seen) in enumerate(branches)]
    branches = out.get("allOf") if isinstance(out.get("allOf"), list) else []
    listed = {name: {} for sub in branches if isinstance(sub, Mapping) and isinstance(sub.get("properties"), Mapping)
              for name in sub["properties"]}
    merged = all(isinstance(sub, Mapping) and not (OPEN_KEYS | EXTENDING | {"allOf"}) & sub.keys() for sub in branches)
    if listed and merged:
        out["properties"] = {**listed, **(out.get("properties") or {})}
    properties = out.get("properties")
    required = [name for sub in (out, *branches) if isinstance(sub, Mapping) and isinstance(sub.get("required"), list)
                for name in sub["required"]]  # a branch's name no branch lists comes another way
    if close and isinstance(properties, Mapping) and not (OPEN_KEYS | EXTENDING) & out.keys() and merged \
            and all(name in properties for name in required if isinstance(name, str)):
        out["additionalProperties"] = False
    return out


def _others_add(branches: list, index: int) -> bool:
    """Whether an allOf's other branches may add properties to the object (its unions' branches then stay open)."""
    return any(isinstance(sub, Mapping) and ({"properties", "required"} | EXTENDING) & sub.keys()
               for i, sub in enumerate(branches) if i != index)


def _definition(sub: object, defs: Mapping[str, object], inlined: frozenset) -> tuple[object, frozenset]:
    """A branch that only names a local definition: the definition (not again inside itself), else the branch."""
    if isinstance(sub, Mapping) and set(sub) == {"$ref"} and sub["$ref"] in defs and sub["$ref"] not in inlined:
        return defs[sub["$ref"]], inlined | {sub["$ref"]}
    return sub, inlined


class Guides:
    """Makes each sequence's Guide; the tokenizer as llguidance reads it is built on first use (~0.5 s for a 49k
    vocabulary), once per engine."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._source = (tokenizer, vocab_size, list(eos_token_ids) or None)
        self._tokenizer: object = None
        self._lock = threading.Lock()

    def __call__(self, params: GuidedDecodingParams) -> Guide:
        with self._lock:
            if self._tokenizer is None:
                try:
                    import llguidance.hf

                    tokenizer, vocab_size, eos = self._source
                    self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
                except Exception as exc:  # remembered: every later request would pay for the same failure
                    self._tokenizer = f"guided decoding cannot read this engine's tokenizer ({exc})"
            if isinstance(self._tokenizer, str):  # a new error each time: one raised again grows its traceback
                raise RequestError(self._tokenizer)
        return Guide(params, self._tokenizer)


def _refused(message: str) -> RequestError:
    return RequestError(message, field="guided_decoding")


def _first_line(error: str) -> str:
    """The head of llguidance's message, without the parser state and grammar it can append."""
    head = error.split("<state>")[0].strip()
    if head.startswith("NoExtension"):
        return "the grammar allows no text that this model's tokens can write"
    lines = [line.strip() for line in head.splitlines() if line.strip()][:6]
    return " ".join(lines)[:600] or "not allowed"


class Guide:
    """One sequence's grammar state: which tokens may come next, and whether the grammar is complete."""

    def __init__(self, params: GuidedDecodingParams | None, ll_tokenizer, matcher=None) -> None:
        import llguidance
        import llguidance.numpy as ll_numpy

        self._fill = ll_numpy.fill_next_token_bitmask
        self.matcher = matcher or llguidance.LLMatcher(ll_tokenizer, params.llguidance_grammar(), log_level=0)
        self._tokenizer = ll_tokenizer
        self._bits = ll_numpy.allocate_token_bitmask(1, ll_tokenizer.vocab_size)
        self.banned(0)  # a grammar that cannot even begin is refused now, not at its first step

    def copy(self) -> Guide:
        """The same grammar in its own state, without compiling it again (a prompt's other sequences)."""
        return Guide(None, self._tokenizer, self.matcher.deep_copy())

    def _check(self) -> None:
        if self.matcher.is_error():
            raise _refused(f"guided decoding: {_first_line(self.matcher.get_error())}")

    def banned(self, vocab_size: int) -> np.ndarray:
        """A boolean mask of the tokens the grammar does not allow next."""
        self._fill(self.matcher, self._bits, 0)
        self._check()  # a grammar that cannot go on (its limits, or nothing matches) is an error, not an end
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:vocab_size]
        return allowed == 0

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            error = _first_line(self.matcher.get_error())
            if self.matcher.is_error():  # the parser hit one of its limits, not a wrong token
                raise _refused(f"guided decoding stopped: {error}")
            raise _refused(f"guided decoding: token {token} does not continue the grammar ({error})")

    @property
    def complete(self) -> bool:
        """Nothing but an end id can follow: the output matches the grammar and can stop here."""
        return self.matcher.is_stopped() and not self.matcher.is_error()
