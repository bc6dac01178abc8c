"""Prompt text to token ids for an engine: text that is not Unicode is refused, and text far longer than the engine
can hold is refused after tokenizing a prefix, not all of it (a 50 MB prompt took minutes and gigabytes)."""

from __future__ import annotations

import weakref

from camshaft.errors import CapacityError, RequestError

FIRST_PREFIX = 8  # characters a token: a prefix this long of a prompt that fits is most of it
_longest: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def longest_piece(tokenizer) -> int:
    """Characters of the longest vocabulary entry: cutting the text splits one token into at most this many."""
    if tokenizer not in _longest:
        _longest[tokenizer] = max(map(len, tokenizer.get_vocab()), default=1)
    return _longest[tokenizer]


def check_unicode(text: str, what: str, field: str | None = None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(f"{what} is not valid Unicode (a lone surrogate at character {exc.start}); send UTF-8 "
                           "text", field=field) from None


def encode_text(tokenizer, text: str, max_tokens: int | None, what: str = "the prompt",
                add_special_tokens: bool = True, cap_said: str | None = None, field: str = "prompt") -> list[int]:
    """Token ids of `text`; refused, after tokenizing a prefix (growing fourfold: at most ~1.3x the work of one
    encoding), when that prefix alone holds more tokens than `max_tokens` plus what the cut may add (None: never).
    `cap_said`: what sets max_tokens, as the refusal says it (default: the engine's max_seq_len). `field`: the
    errors' RequestError.field."""
    check_unicode(text, what, field)
    size = len(text) if max_tokens is None else max_tokens * FIRST_PREFIX
    while size < len(text):
        head = tokenizer(text[:size], add_special_tokens=add_special_tokens)["input_ids"]
        if len(head) > max_tokens + longest_piece(tokenizer):
            cap_said = cap_said or f"this engine allows {max_tokens} tokens in all (prompt + output)"
            raise CapacityError(f"{what} has {len(text)} characters, more than {max_tokens} tokens: {cap_said}; "
                                "shorten it", field=field)
        size *= 4
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
