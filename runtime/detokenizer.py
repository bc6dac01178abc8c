"""Incremental detokenization with stop strings.

Each step decodes only a short window of tokens (prefix_offset..end) and emits what it adds to the window's older
part (prefix_offset..read_offset), so the cost per token does not grow with the output. The window starts on the
prompt's last tokens: decoders that drop a word's leading space at the start of a text (sentencepiece) then keep it.
Text is decoded by the tokenizer's backend without transformers' clean_up_tokenization_spaces (which rewrites
spaces before punctuation after the fact and cannot be streamed; LLM tokenizers leave it off).
"""

from __future__ import annotations

from collections.abc import Sequence

_PROMPT_CONTEXT = 5  # prompt tokens the first window starts with
_TRIM_AFTER = 64  # drop tokens before the window once this many have piled up


class TextStream:
    """Turns generated token ids into text deltas that are safe to show: never half a UTF-8 character, never the
    start of a stop string that may still complete. After a stop string the text is cut at its first occurrence
    (the one that ends first; kept only with include_stop) and later tokens are ignored. With `min_tokens`, stop
    strings are looked for once more tokens than that were appended, and only those ending past the first
    min_tokens tokens' text (vLLM's meaning: text wholly before then is kept)."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int], stop: tuple[str, ...] = (), include_stop: bool = False,
                 skip_special_tokens: bool = True, min_tokens: int = 0) -> None:
        backend = tokenizer.backend_tokenizer
        self._decode = lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
        # tokens the decode skips: kept out of the window, which would otherwise grow with each (a repeated end id;
        # ids past the tokenizer's vocabulary, which an engine's padded embedding may sample)
        self._skipped = {i for i, t in backend.get_added_tokens_decoder().items() if t.special} \
            if skip_special_tokens else set()
        self._known = backend.get_vocab_size(with_added_tokens=True)
        self._stops = tuple(s for s in stop if s)
        self._include_stop = include_stop
        self._ids = context = self._context(list(prompt_ids[-_PROMPT_CONTEXT * 4:]))
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = self._decode(context)
        self._pending = ""  # decoded text not emitted yet: it may begin a stop string
        self._held = ""  # decoded text of the tokens since the last delta, held back (ends inside a character)
        self._text = ""  # emitted text
        self._matched: str | None = None
        self._done = False
        self._min_tokens = min_tokens
        self._appended = 0
        self._boundary = 0  # length of the text of the first min_tokens tokens: a stop must end past it

    def _context(self, ids: list[int]) -> list[int]:
        """The prompt's last tokens the output is decoded after (so SentencePiece decoders keep its first word's
        space): a prompt cut inside a character loses that tail (it would garble the output); the window then widens
        back from _PROMPT_CONTEXT tokens until it begins with text (not inside a character, whose byte group a
        byte-fallback decoder makes all U+FFFD, and not special tokens alone, which decode to nothing)."""
        end = len(ids)
        while end and self._decode(ids[max(0, end - _PROMPT_CONTEXT):end]).endswith("\ufffd"):
            end -= 1
        start = max(0, end - _PROMPT_CONTEXT)
        while start and (not (text := self._decode(ids[start:end])) or text.startswith("\ufffd")):
            start -= 1
        return ids[start:end]

    @property
    def text(self) -> str:
        """Text emitted so far; the full output once finish() was called or a stop string matched."""
        return self._text

    @property
    def stopped(self) -> bool:
        return self._matched is not None

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the text, if any."""
        return self._matched

    @property
    def next_at(self) -> int:
        """Characters of the whole text before what the next token adds: those emitted, and those held back (for a
        stop string, or decoded from bytes that do not end a character yet: U+FFFD each, as the end flushes them)."""
        return len(self._text) + len(self._pending) + len(self._held)

    @property
    def ends_inside_a_character(self) -> bool:
        """The bytes appended so far end inside a UTF-8 character (or in bytes that make none)."""
        return self._held.endswith("\ufffd")

    def shows(self, token_id: int) -> bool:
        """Whether the token's text is part of the text (special tokens skipped, ids past the vocabulary are not)."""
        return token_id not in self._skipped and token_id < self._known

    def append(self, token_id: int) -> str:
        """Add one generated token; return the newly safe text (often empty). Ignored once stopped or finished."""
        if self._done:
            return ""
        self._appended += 1
        if token_id in self._skipped or token_id >= self._known:
            self._mark_boundary(0)
            return ""
        self._ids.append(token_id)
        new_text = self._decode(self._ids[self._prefix_offset :])
        self._held = new_text[len(self._prefix_text) :]
        if len(new_text) <= len(self._prefix_text) or new_text.endswith("\ufffd"):
            self._mark_boundary(0)
            return ""  # nothing new yet, or a character still incomplete
        delta, self._held = self._held, ""
        self._mark_boundary(len(delta))
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        if self._prefix_offset > _TRIM_AFTER:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return self._release(delta, final=False)

    def _mark_boundary(self, unreleased: int) -> None:
        if self._appended == self._min_tokens:
            self._boundary = len(self._text) + len(self._pending) + unreleased

    def finish(self) -> str:
        """Generation ended for another reason (eos, length): flush held-back text, even an incomplete character."""
        if self._done:
            return ""
        new_text = self._decode(self._ids[self._prefix_offset :])
        return self._release(new_text[len(self._prefix_text) :], final=True)

    def _release(self, delta: str, final: bool) -> str:
        pending = self._pending + delta
        searched_from = max(0, len(self._pending) - max((len(s) for s in self._stops), default=0) + 1)
        cut = self._first_stop(pending, searched_from) if self._appended > self._min_tokens else None
        if cut is not None:
            self._done = True
            safe = pending[:cut]
        elif final:
            self._done = True
            safe = pending
        else:
            safe = pending[: len(pending) - self._stop_prefix_len(pending)]
        self._pending = pending[len(safe) :]
        self._text += safe
        return safe

    def _first_stop(self, text: str, start: int) -> int | None:
        """End of the kept text if a stop string occurs in text[start:] ending past the min_tokens boundary (earliest
        end wins, then earliest start); `text` begins where the emitted text ends."""
        best: tuple[int, int, str] | None = None
        boundary = self._boundary - len(self._text)
        for stop in self._stops:
            at = text.find(stop, max(start, boundary - len(stop) + 1))
            if at >= 0 and (best is None or (at + len(stop), at) < best[:2]):
                best = (at + len(stop), at, stop)
        if best is None:
            return None
        self._matched = best[2]
        return best[0] if self._include_stop else best[1]

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of text that a stop string starts with."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
