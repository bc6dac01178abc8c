"""Token strings and bytes for log-probs, as OpenAI shows them: the token's text when it is whole UTF-8, else
`bytes:\\xNN...` (part of a character), or `token_id:N` for ids the tokenizer has no piece for."""

from __future__ import annotations

import re
from functools import lru_cache

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
        if isinstance(piece, str) and _SPACE_MARK in piece and not _BYTE_FALLBACK.fullmatch(piece):
            text = piece.replace(_SPACE_MARK, " ")  # decoding it alone would strip (or keep) the space it begins with
            return text, list(text.encode())
        text = self.tokenizer.decode([token_id])
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
