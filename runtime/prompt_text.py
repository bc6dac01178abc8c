"""Prompt text to token ids for an engine: text that is not Unicode is refused, and text far longer than the engine
can hold is refused after tokenizing a prefix, not all of it (a 50 MB prompt took minutes and gigabytes)."""

from __future__ import annotations

from camshaft.errors import CapacityError, RequestError

SAFETY = 4  # normalizers may fold a few characters into one


def longest_piece(tokenizer) -> int:
    """Characters of the longest vocabulary entry: no token covers more of the text."""
    cached = getattr(tokenizer, "_camshaft_longest_piece", None)
    if cached is None:
        cached = max(map(len, tokenizer.get_vocab()), default=1)
        tokenizer._camshaft_longest_piece = cached
    return cached


def encode_text(tokenizer, text: str, max_tokens: int, what: str = "the prompt",
                add_special_tokens: bool = True) -> list[int]:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(f"{what} is not valid Unicode (a lone surrogate at character {exc.start}); send UTF-8 "
                           "text") from None
    cap = max_tokens * longest_piece(tokenizer) * SAFETY + 64
    if len(text) > cap:
        head = tokenizer(text[:cap], add_special_tokens=add_special_tokens)["input_ids"]
        if len(head) > max_tokens + 1:  # the cut may split one token in two
            raise CapacityError(f"{what} has {len(text)} characters, more than {max_tokens} tokens: this engine "
                                f"allows {max_tokens} tokens in all (prompt + output); shorten it")
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
