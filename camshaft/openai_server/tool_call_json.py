"""tool_choice "auto" readers for models that write calls as bare JSON (as vLLM's parsers of the same names):

- llama3_json (Llama 3.1 / 3.2 / 3.3): an answer that begins with `{` or `<|python_tag|>` is calls,
  `{"name": ..., "parameters": {...}}` objects apart by `;`; any other answer is content.
- mistral: content, then `[TOOL_CALLS]` and a JSON array of `{"name": ..., "arguments": {...}}` objects (Mistral
  v0.3, Nemo), or `[TOOL_CALLS]NAME[ARGS]{...}` per call (the tokenizers of Mistral Small 3.2, Magistral, Devstral).

Each call goes out once its object is complete. An answer with no call of the listed functions is content as written;
after calls, the text from the first object that is not one is.
"""

from __future__ import annotations

import json

from camshaft.openai_server.tool_calls import Piece, _partial_suffix, _Reader, call_parts, raw_arguments, whole_call

PYTHON_TAG, TOOL_CALLS = "<|python_tag|>", "[TOOL_CALLS]"
_SEPARATORS = " \t\r\n;,[]"
_decoder = json.JSONDecoder()


class _JsonCalls:
    """Calls one after another: JSON objects (or arrays of them), or Mistral's `NAME[ARGS]{...}` / `NAME{...}` after
    `[TOOL_CALLS]` markers. The first that is not a call of a listed function ends the calls, and the text from it on
    is content. An object is decoded once its brackets close (scanned as the text comes: a long call stays linear)."""

    def __init__(self, reader: _Reader, names: set[str], parallel: bool) -> None:
        self._reader, self._names, self._parallel = reader, names, parallel
        self._text, self._at, self._stopped = "", 0, False
        self._item, self._scanned, self._depth, self._in_string, self._escaped = -1, 0, 0, False, False

    def feed(self, delta: str) -> list[dict]:
        self._text += delta
        calls: list[dict] = []
        while not self._stopped:
            at = self._next(self._at)
            if at is None:
                break
            named = self._text[at] not in "{["
            start = self._text.find("{", at) if named else at
            if start < 0 or not self._closed(start):
                break
            try:
                item, end = _decoder.raw_decode(self._text, start)
            except (ValueError, RecursionError):  # not JSON, or nested too deep to read: content
                item, end = None, start
            raw = self._text[start:end] if item is not None else None
            if named:
                item = {"name": self._text[at:start].strip().removesuffix("[ARGS]").strip(), "arguments": item}
            elif isinstance(item, dict):
                raw = raw_arguments(self._text, start)
            parts = call_parts(item, self._names, raw)
            if parts is None:
                self._at, self._stopped = at, True
                break
            self._at = end
            if self._parallel or not self._reader.calls:
                calls.append(whole_call(self._reader.calls, *parts))
                self._reader.calls += 1
        return calls

    def _closed(self, start: int) -> bool:
        """Whether the JSON value at `start` has closed its brackets (strings skipped), scanning on from where the
        last call left off."""
        if self._item != start:
            self._item, self._scanned, self._depth, self._in_string, self._escaped = start, start, 0, False, False
        text, at = self._text, self._scanned
        while at < len(text):
            char = text[at]
            at += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    self._scanned = at
                    return True
        self._scanned = at
        return False

    def _next(self, at: int) -> int | None:
        """Where the next call begins: past separators and `[TOOL_CALLS]` markers; None until it has."""
        text = self._text
        while at < len(text):
            if text.startswith(TOOL_CALLS, at):
                at += len(TOOL_CALLS)
            elif TOOL_CALLS.startswith(text[at:]):
                return None  # perhaps a marker, not all here yet
            elif text[at] in _SEPARATORS:
                at += 1
            else:
                return at
        return None

    def rest(self, marker: str) -> str:
        """Content at the end: nothing once all read as calls; the answer as written (`marker` first) where none did;
        else the text from the first object that is not a call, less the one `]`, `;` or `,` that closed the calls."""
        tail = self._text[self._at:]
        if not tail.strip(_SEPARATORS):
            return ""
        if not self._reader.calls:
            return (marker + self._text).strip()
        tail = tail.lstrip()
        return (tail[1:] if tail[:1] in ("]", ";", ",") else tail).strip()


class Llama3JsonReader(_Reader):
    def __init__(self, names: set[str], parallel: bool = True, continuing: bool = False) -> None:
        super().__init__(continuing)
        self._calls = _JsonCalls(self, names, parallel)
        self._head, self._mode = "", ""  # mode: "" until the answer's first characters decide, "calls", "content"
        self._tag = ""

    def feed(self, delta: str) -> Piece:
        if self._mode == "content":
            return delta, []
        if self._mode == "calls":
            return "", self._calls.feed(delta)
        self._head += delta
        start = self._head.lstrip()
        if not start or (PYTHON_TAG.startswith(start) and start != PYTHON_TAG):
            return "", []
        if start.startswith(("{", PYTHON_TAG)):
            self._mode, self._tag = "calls", PYTHON_TAG if start.startswith(PYTHON_TAG) else ""
            return "", self._calls.feed(start.removeprefix(PYTHON_TAG))
        self._mode = "content"
        return self._head if self.continuing else start, []

    def finish(self) -> Piece:
        if self._mode == "calls":
            return self._calls.rest(self._tag), []
        return ("", []) if self._mode else (self._head.rstrip() if self.continuing else self._head.strip(), [])


class MistralReader(_Reader):
    def __init__(self, names: set[str], parallel: bool = True, continuing: bool = False) -> None:
        super().__init__(continuing)
        self._calls = _JsonCalls(self, names, parallel)
        self._held, self._in_calls, self._sent = "", False, continuing

    def feed(self, delta: str) -> Piece:
        if self._in_calls:
            return "", self._calls.feed(delta)
        self._held += delta
        at = self._held.find(TOOL_CALLS)
        if at >= 0:
            content, rest = self._held[:at], self._held[at + len(TOOL_CALLS):]
            self._held, self._in_calls = "", True
            return self._content(content), self._calls.feed(rest)
        keep = _partial_suffix(self._held, TOOL_CALLS)
        ready, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
        return self._content(ready), []

    def finish(self) -> Piece:
        if self._in_calls:
            return self._calls.rest(TOOL_CALLS), []
        held, self._held = self._held, ""
        return self._content(held), []

    def _content(self, text: str) -> str:
        if not self._sent:
            text = text.lstrip()
            self._sent = bool(text)
        return text
