"""OpenAI function calling: `tools`, `tool_choice` and `parallel_tool_calls` of a chat request.

- "none": the tools are left out of the prompt and the output is content.
- a named function ({"type": "function", "function": {"name": ...}}): the output is that function's arguments,
  held to its JSON Schema by a grammar; finish_reason "stop", as OpenAI's.
- "required": one or more calls (one with parallel_tool_calls false), held by a grammar to a JSON array of
  {"name", "parameters"} objects; finish_reason "tool_calls".
- "auto" (the default with tools): the model decides; the calls it writes become calls, read by the server's
  `--tool-call-parser` (hermes: `<tool_call>` blocks; llama3_json; mistral: tool_call_json.py), which it needs, as
  vLLM's does.
Named and required work with any model: the grammar decides the shape, the chat template only what the model knows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from camshaft.errors import RequestError
from camshaft.openai_server.tool_call_json import Llama3JsonReader, MistralReader
from camshaft.openai_server.tool_calls import ArrayReader, HermesReader, NamedReader
from camshaft.runtime.chat_template import check_tools
from camshaft.runtime.guided import SCHEMA_LISTS, SCHEMA_MAPS, SCHEMA_ONE, GuidedDecodingParams

_Reader = NamedReader | ArrayReader | HermesReader | Llama3JsonReader | MistralReader
DEFS_REFS = ("#/$defs/", "#/definitions/")
AUTO_READERS = {"hermes": HermesReader, "llama3_json": Llama3JsonReader, "mistral": MistralReader}


@dataclass(frozen=True)
class ToolChoice:
    kind: str  # "none" | "auto" | "required" | "function"
    tools: tuple[dict[str, Any], ...]
    name: str | None = None
    parallel: bool = True
    parser: str = "hermes"  # how "auto" reads the calls the model writes

    @property
    def prompt_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template renders (none for "none")."""
        return None if self.kind == "none" else list(self.tools)

    def guided(self) -> GuidedDecodingParams | None:
        try:
            return self._guided()
        except RequestError as exc:  # a function's parameters schema
            raise RequestError(str(exc), field="tools") from None

    def _guided(self) -> GuidedDecodingParams | None:
        if self.kind == "function":
            return GuidedDecodingParams(json=self._parameters(self.name))
        if self.kind == "required":
            shared: dict[str, dict[str, Any]] = {}  # each function's $defs, moved to the root its $refs now start at
            calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "parameters": _hoist_defs(
                          _rebased(_parameters(f), f"#/items/anyOf/{i}/properties/parameters"), f["name"], shared)},
                      "required": ["name", "parameters"]} for i, f in enumerate(self._functions())]  # one pass: a
            # lookup by name for each of 28k tools held the event loop 23 s
            schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1, **shared}
            return GuidedDecodingParams(json=schema if self.parallel else {**schema, "maxItems": 1})
        return None

    def reader(self, continuing: bool = False) -> _Reader | None:
        """continuing: the content goes on from text already shown (chat echo): an auto reader strips not its start."""
        if self.kind == "function":
            return NamedReader(self.name)
        if self.kind == "required":
            return ArrayReader()
        if self.kind == "auto":
            return AUTO_READERS[self.parser]({f["name"] for f in self._functions()}, self.parallel, continuing)
        return None

    def finish_reason(self, reader: _Reader, reason: str) -> str:
        """OpenAI's: "tool_calls" where the model chose to call (a named function's call ends with "stop")."""
        return "tool_calls" if reader.calls and reason == "stop" and self.kind != "function" else reason

    def _functions(self) -> list[dict[str, Any]]:
        return [tool["function"] for tool in self.tools]

    def _parameters(self, name: str | None) -> dict[str, Any]:
        return _parameters(next(f for f in self._functions() if f["name"] == name))


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


def _rebased(schema: Any, root: str) -> Any:
    """The schema with its references to itself ("#", "#/properties/...") made to point at `root`, where it now sits
    inside the calls' array schema; references into its $defs / definitions stay, as those move to the new root."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    ref = out.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")) and not ref.startswith(DEFS_REFS):
        out["$ref"] = root + ref[1:]
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _rebased(sub, root) for name, sub in out[key].items()}
    for key in (*SCHEMA_ONE, *SCHEMA_LISTS):
        if key in out:
            out[key] = [_rebased(sub, root) for sub in out[key]] if isinstance(out[key], list) \
                else _rebased(out[key], root)
    return out


def _hoist_defs(parameters: dict[str, Any], name: str, shared: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The parameters schema without its $defs / definitions, which go into `shared` (the array schema's root, where
    its "#/$defs/..." references now point); a name two functions define differently is refused."""
    kept = dict(parameters)
    for key in ("$defs", "definitions"):
        defs = kept.get(key)
        if not isinstance(defs, dict):
            continue
        del kept[key]
        into = shared.setdefault(key, {})
        for def_name, definition in defs.items():
            if into.setdefault(def_name, definition) != definition:
                raise RequestError(f"tools: function {name}'s parameters define {key}/{def_name} unlike another "
                                   "function's (or as it, but referring to its own parameters with \"#...\"), which "
                                   'tool_choice "required" cannot tell apart; rename one of them', field="tools")
    return kept


def tool_choice(tools: list[dict[str, Any]] | None, choice: Any, parallel: bool,
                parser: str | None) -> ToolChoice | None:
    """The request's function calling, checked; None where it has none."""
    if not tools:
        if choice not in (None, "none"):
            raise RequestError("tool_choice needs tools: send the functions in tools, or leave tool_choice out",
                               field="tool_choice")
        return None
    check_tools(tools)
    names = [tool["function"]["name"] for tool in tools]
    choice = "auto" if choice is None else choice
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if name not in names:
            raise RequestError(f"tool_choice {choice!r:.120} names no function in tools ({', '.join(names)}); "
                               'send {"type": "function", "function": {"name": ...}}, "auto", "required" or "none"',
                               field="tool_choice")
        return ToolChoice("function", tuple(tools), name, parallel)
    if choice not in ("none", "auto", "required"):
        raise RequestError(f"tool_choice {choice!r:.80} is not one of none, auto, required or "
                           '{"type": "function", "function": {"name": ...}}', field="tool_choice")
    if choice == "auto" and parser is None:
        raise RequestError('tool_choice "auto" (the default with tools) needs the server started with '
                           f"--tool-call-parser ({' | '.join(AUTO_READERS)}); or send tool_choice \"required\" or a "
                           "function's name", field="tool_choice")
    return ToolChoice(choice, tuple(tools), None, parallel, parser or "hermes")
