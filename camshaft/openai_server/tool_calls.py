"""Generated text to OpenAI tool calls, one choice at a time, as it streams.

Each reader takes text deltas (`feed`) and the end (`finish`) and returns what the client sees: content text and
tool-call deltas. A whole response is one `feed` of the text and a `finish`, so a stream's pieces always add up to
the non-streamed message.
"""

from __future__ import annotations

import json
import secrets
import string
from typing import Any

PARSERS = ("hermes", "llama3_json", "mistral")  # `--tool-call-parser`: how text the model chose to write is read
Piece = tuple[str, list[dict[str, Any]]]  # (content delta, tool-call deltas)
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_decoder = json.JSONDecoder()


def call_id() -> str:
    """9 letters and digits: what Mistral's chat templates require of the ids a client sends back."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def whole_call(index: int, name: str, arguments: Any) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"index": index, "id": call_id(), "type": "function", "function": {"name": name, "arguments": text}}


def call_parts(item: Any, names: set[str], raw: str | None = None) -> tuple[str, dict | str] | None:
    """(name, arguments) of a decoded {"name", "arguments" | "parameters"} object calling a listed function (the
    arguments an object, or JSON text of one); None where it is not such a call. `raw`: the model's text of the
    arguments, given as they are (decoded and written again, 1e999 would come out as Infinity, not JSON)."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or item["name"] not in names:
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else raw
    if isinstance(arguments, str):
        arguments = loads(arguments)
    if not isinstance(arguments, dict):
        return None
    return item["name"], arguments if text is None else text


def raw_arguments(text: str, at: int) -> str | None:
    """The text of the arguments (or parameters) of the call object starting at `at` (a complete one)."""
    members = _member_texts(text, at)
    return members.get("arguments", members.get("parameters"))


def element_starts(text: str, at: int) -> list[int]:
    """Where each item of the JSON array starting at `at` (a complete one) starts."""
    starts, at = [], _past_space(text, at + 1)
    while text[at] != "]":
        starts.append(at)
        _, at = _decoder.raw_decode(text, at)
        at = _past_space(text, at)
        at = _past_space(text, at + 1) if text[at] == "," else at
    return starts


def loads(text: str) -> Any:
    """json.loads, None where the text is not JSON (or nests too deep to read)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


class _Reader:
    def __init__(self, continuing: bool = False) -> None:
        """continuing: the content goes on from text already shown (chat echo), so its start is not stripped."""
        self.calls = 0
        self.continuing = continuing

    def feed(self, delta: str) -> Piece:
        raise NotImplementedError

    def finish(self) -> Piece:
        raise NotImplementedError


class NamedReader(_Reader):
    """tool_choice naming one function: the whole output is its arguments (a grammar holds it to the schema)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, delta: str) -> Piece:
        if not delta:
            return "", []
        if self.calls:
            return "", [{"index": 0, "function": {"arguments": delta}}]
        self.calls = 1
        return "", [whole_call(0, self.name, delta)]

    def finish(self) -> Piece:
        return ("", []) if self.calls else ("", [whole_call(0, self.name, "")])


class ArrayReader(_Reader):
    """tool_choice "required": a JSON array of {"name", "parameters"} objects (a grammar holds it to the tools);
    each call goes out once its object is complete."""

    def __init__(self) -> None:
        super().__init__()
        self._text, self._at, self._opened = "", 0, False

    def feed(self, delta: str) -> Piece:
        self._text += delta
        calls = []
        while (at := self._next_item()) is not None:
            try:
                item, self._at = _decoder.raw_decode(self._text, at)
            except ValueError:  # not complete yet
                break
            self._opened = True
            if isinstance(item, dict) and isinstance(item.get("name"), str):  # the model's own text of the
                # parameters (decoded and written again, 1e999 came out as Infinity, not JSON)
                arguments = _member_texts(self._text, at).get("parameters", "{}")
                calls.append(whole_call(self.calls, item["name"], arguments))
                self.calls += 1
        return "", calls

    def finish(self) -> Piece:
        """An item the length limit cut is dropped: the array is the grammar's form, not content."""
        return "", []

    def _next_item(self) -> int | None:
        """Where the next item starts (past "[" or ","), once it has begun."""
        text, at = self._text, _past_space(self._text, self._at)
        if not text.startswith("," if self._opened else "[", at):
            return None
        at = _past_space(text, at + 1)
        return at if at < len(text) else None


def _raw(text: str, at: int) -> str | None:
    return raw_arguments(text, at) if text[at] == "{" else None


def _member_texts(text: str, at: int) -> dict[str, str]:
    """The text of each member's value of the JSON object that starts at `at` (a complete one)."""
    members, at = {}, _past_space(text, at + 1)
    while text[at] != "}":
        key, at = _decoder.raw_decode(text, at)
        start = _past_space(text, _past_space(text, at) + 1)  # past the colon
        _, at = _decoder.raw_decode(text, start)
        members[key] = text[start:at]
        at = _past_space(text, at)
        at = _past_space(text, at + 1) if text[at] == "," else at
    return members


def _past_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


class HermesReader(_Reader):
    """tool_choice "auto" with the hermes parser (Qwen2.5/Qwen3, Hermes, and camshaft's own tool preamble): calls
    are `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; text around them is content. Text that may
    begin a block is held back; content is stripped; a block that is not a call of a known function goes out as the
    text it was."""

    def __init__(self, names: set[str], parallel: bool = True, continuing: bool = False) -> None:
        super().__init__(continuing)
        self._names, self._parallel = names, parallel
        self._held, self._space, self._in_call, self._sent_content = "", "", False, continuing
        self._after_call = False  # the space held before a call goes if the text after it brings its own

    def feed(self, delta: str) -> Piece:
        self._held += delta
        content, calls = "", []
        while True:
            if self._in_call:
                end = self._held.find(CLOSE)
                if end < 0:
                    return content, calls
                text, call = self._block(self._held[:end], closed=True)
                content, calls = content + text, calls + call
                self._held, self._in_call = self._held[end + len(CLOSE):], False
                continue
            start = self._held.find(OPEN)
            if start >= 0:
                content += self._content(self._held[:start])
                self._held, self._in_call = self._held[start + len(OPEN):], True
                continue
            keep = _partial_suffix(self._held, OPEN)
            ready, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
            return content + self._content(ready), calls

    def finish(self) -> Piece:
        if self._in_call:  # an unclosed block (the end id or a stop string came first)
            piece = self._block(self._held, closed=False)
        else:
            piece = self._content(self._held), []
        self._held = ""
        return piece

    def _block(self, body: str, closed: bool) -> Piece:
        """One call's object, or a list of them (SmolLM2's trained form: `<tool_call>[{...}, {...}]</tool_call>`)."""
        value, at = loads(body), _past_space(body, 0)
        if isinstance(value, list) and value:
            found = [call_parts(v, self._names, _raw(body, start))
                     for v, start in zip(value, element_starts(body, at), strict=True)]
        else:
            found = [call_parts(value, self._names, _raw(body, at) if isinstance(value, dict) else None)]
        if any(parts is None for parts in found):
            return self._content(OPEN + body + (CLOSE if closed else "")), []
        calls = []
        for parts in found:
            if self.calls and not self._parallel:
                break
            self.calls += 1
            calls.append(whole_call(self.calls - 1, *parts))
        self._after_call = True
        return "", calls

    def _content(self, text: str) -> str:
        """Content as it comes, less its leading whitespace and any whitespace at its end so far (held back until
        more content follows it: a response's content is stripped)."""
        if self._after_call and text:  # "A <call> B" is "A B", "A <call>B" stays "A B"
            self._after_call = False
            if text[0].isspace():
                self._space = ""
        self._space += text
        body = self._space.rstrip()
        if not body:
            return ""
        self._space = self._space[len(body):]
        out = body if self._sent_content else body.lstrip()
        self._sent_content = True
        return out


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
