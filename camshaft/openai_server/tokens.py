"""Token strings and bytes for log-probs, as OpenAI shows them: the token's text when it is whole UTF-8, else
`bytes:\\xNN...` (part of a character), or `token_id:N` for ids the tokenizer has no piece for."""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

from camshaft.runtime.detokenizer import TextStream
from camshaft.runtime.sampler import SampleResult

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte tokens
_SPACE_MARK = "\u2581"  # SentencePiece's "▁": a space


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: each byte is shown as a printable character; this maps them back."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(shown)
    extra = 0
    for b in range(256):
        if b not in shown:
            shown.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(shown, chars, strict=True)}


def _raw_bytes(piece: str) -> bytes | None:
    if match := _BYTE_FALLBACK.fullmatch(piece):
        return bytes([int(match.group(1), 16)])
    table = _byte_level_decoder()
    if all(ch in table for ch in piece):
        return bytes(table[ch] for ch in piece)
    return None


class TokenText:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.get = lru_cache(maxsize=65536)(self._text_and_bytes)

    def _text_and_bytes(self, token_id: int) -> tuple[str, list[int] | None]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        text = self.tokenizer.decode([token_id])
        if isinstance(piece, str) and _SPACE_MARK in piece and not _BYTE_FALLBACK.fullmatch(piece) \
                and _SPACE_MARK not in text:  # SentencePiece's space (a byte-level token keeps its ▁ as text)
            text = piece.replace(_SPACE_MARK, " ")  # decoding it alone would strip (or keep) the space it begins with
            return text, list(text.encode())
        if text and "\ufffd" not in text:
            return text, list(text.encode())
        if piece is None:
            return f"token_id:{token_id}", None
        raw = _raw_bytes(piece)
        if raw is None:
            return text or piece, list((text or piece).encode())
        try:
            return raw.decode(), list(raw)
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)


class TextOffsets:
    """text_offset of each token of one text, as its detokenizer (`text`) builds it: the characters before the
    token's text, and for a token holding part of a character (a byte of it, or its end with more) that character."""

    def __init__(self, text: TextStream, tokens: TokenText) -> None:
        self.text, self._tokens = text, tokens
        self._inside: int | None = None  # the character the bytes so far end inside: begun, not complete

    def placed(self, samples: Sequence[SampleResult]) -> list[int]:
        """The offsets of the sampled tokens, each appended to the text in turn."""
        return [self.place(s.token_id) for s in samples]

    def place(self, token_id: int) -> int:
        """The token's offset; the token is then appended to the text."""
        raw = self._tokens.get(token_id)[1] if self.text.shows(token_id) else None
        continues = self._inside is not None and (not raw or _continuation(raw[0]))
        at = self._inside if continues else self.text.next_at
        self.text.append(token_id)
        if not self.text.ends_inside_a_character:
            self._inside = None
        elif raw:
            self._inside = _begun(at, raw, continues, self._inside)
        return at


def _continuation(byte: int) -> bool:
    return 0x80 <= byte < 0xC0


def _begun(at: int, raw: list[int], continues: bool, inside: int | None) -> int | None:
    """The character that a token at character `at` (continuing the one `inside` begun before it, or not) leaves
    incomplete at its end: where its last lead byte begins one, counted by the characters its bytes hold before."""
    lead = next((i for i in range(len(raw) - 1, -1, -1) if not _continuation(raw[i])), None)
    if lead is None:  # continuation bytes alone: the character it continues; continuing none, they begin none
        return inside if continues else None
    return at + continues + sum(not _continuation(b) for b in raw[:lead])
