"""tool_choice "auto" readers for models that write calls as bare JSON (as vLLM's parsers of the same names):

- llama3_json (Llama 3.1 / 3.2 / 3.3): an answer that begins with `{` or `<|python_tag|>` is calls,
  `{"name": ..., "parameters": {...}}` objects apart by `;`; any other answer is content.
- mistral (Mistral v0.3, Mistral Nemo): content, then `[TOOL_CALLS]` and a JSON array of
  `{"name": ..., "arguments": {...}}` objects.

Each call goes out once its object is complete. An answer with no call of the listed functions is content as written;
after calls, the text from the first object that is not one is.
"""

from __future__ import annotations

import json

from camshaft.openai_server.tool_calls import Piece, _partial_suffix, _Reader, whole_call

PYTHON_TAG, TOOL_CALLS = "<|python_tag|>", "[TOOL_CALLS]"
_SEPARATORS = " \t\r\n;,[]"
_decoder = json.JSONDecoder()


class _JsonCalls:
    """JSON call objects (or arrays of them) one after another; the first that is not a call of a listed function
    ends the calls, and the text from it on is content."""

    def __init__(self, reader: _Reader, names: set[str], parallel: bool) -> None:
        self._reader, self._names, self._parallel = reader, names, parallel
        self._text, self._at, self._stopped = "", 0, False

    def feed(self, delta: str) -> list[dict]:
        self._text += delta
        calls = []
        while not self._stopped:
            at = self._at
            while at < len(self._text) and self._text[at] in _SEPARATORS:
                at += 1
            if at >= len(self._text):
                break
            try:
                item, end = _decoder.raw_decode(self._text, at)
            except ValueError:  # not complete yet (or never: the rest is content at the end)
                break
            arguments = item.get("arguments", item.get("parameters")) if isinstance(item, dict) else None
            if not (isinstance(item, dict) and item.get("name") in self._names and isinstance(arguments, dict)):
                self._at, self._stopped = at, True
                break
            self._at = end
            if self._parallel or not self._reader.calls:
                calls.append(whole_call(self._reader.calls, item["name"], arguments))
                self._reader.calls += 1
        return calls

    def rest(self, marker: str) -> str:
        """Content at the end: nothing once all read as calls; the answer as written (`marker` first) where none did;
        else the text from the first object that is not a call."""
        tail = self._text[self._at:]
        if not tail.strip(_SEPARATORS):
            return ""
        return (marker + self._text).strip() if not self._reader.calls else tail.lstrip(_SEPARATORS).rstrip()


class Llama3JsonReader(_Reader):
    def __init__(self, names: set[str], parallel: bool = True) -> None:
        super().__init__()
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
        return start, []

    def finish(self) -> Piece:
        if self._mode == "calls":
            return self._calls.rest(self._tag), []
        return ("", []) if self._mode else (self._head.strip(), [])


class MistralReader(_Reader):
    def __init__(self, names: set[str], parallel: bool = True) -> None:
        super().__init__()
        self._calls = _JsonCalls(self, names, parallel)
        self._held, self._in_calls, self._sent = "", False, False

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
