"""Chat messages (and the functions a model may call) through the tokenizer's chat template.

A template that reads `tools` renders them its own way (Qwen2.5's, Llama 3.1's, Hermes'); for one that does not
(SmolLM2's), the functions and the `<tool_call>` answer format go into the system message, so the model sees them.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import re
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Any

from camshaft.errors import EngineError, RequestError
from camshaft.runtime.chat_messages import checked_messages
from camshaft.transformers_import import from_transformers

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
TOOLS_PREAMBLE = ("You may call one or more functions to answer. The functions, as JSON Schema:\n{functions}\n"
                  "To call one, answer with <tool_call>{{\"name\": <function name>, \"arguments\": <arguments "
                  "object>}}</tool_call>, one such block per call.")


@dataclass(frozen=True, eq=False)
class ChatOptions:
    """How a conversation renders: the functions the model may call (`tools`, OpenAI's form), more variables the
    template reads (`chat_template_kwargs`, vLLM's: e.g. Qwen3's enable_thinking, or a RAG template's `documents`,
    a list of objects such as {"title", "text"}), and how it ends:
    the assistant's turn opened (`add_generation_prompt`, the default) or the last message left open for the model
    to go on with (`continue_final_message`, e.g. an assistant reply begun by the caller)."""

    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def __post_init__(self) -> None:
        for name in ("add_generation_prompt", "continue_final_message"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name} is true or false, got {getattr(self, name)!r:.80}", field=name)
        if self.add_generation_prompt and self.continue_final_message:
            raise RequestError("add_generation_prompt and continue_final_message exclude each other: the first opens "
                               "a new assistant turn, the second goes on with the last message; set "
                               "add_generation_prompt false to continue the last message",
                               field="continue_final_message")
        if self.tools is not None:
            check_tools(self.tools)

    def changed(self) -> list[str]:
        """The options set away from their defaults (by their public names)."""
        return [f.name for f in fields(self) if getattr(self, f.name) != f.default]


def render_chat(tokenizer, messages: list[dict[str, Any]], options: ChatOptions = ChatOptions()) -> str:
    """The template's text of the conversation, ending as `options` asks (by default with the assistant's
    generation prompt)."""
    messages = checked_messages(messages)
    if tokenizer.chat_template is None:
        raise RequestError("this engine's tokenizer has no chat template; pass a plain prompt, or give the engine "
                           "one (chat_template=, --chat-template FILE)", field="messages")
    template_kwargs = check_template_kwargs(options.chat_template_kwargs, tokenizer)
    if options.continue_final_message and not (messages[-1].get("content") or ""):
        raise RequestError("continue_final_message goes on with the last message's text, and it has none; end the "
                           "messages with the text to continue (e.g. an assistant message begun)",
                           field="continue_final_message")
    tools = options.tools or None
    messages = [{**m, "tool_calls": template_calls(m["tool_calls"])} if m.get("tool_calls") else m for m in messages]
    try:
        template = tokenizer.get_chat_template(tools=tools)
    except ValueError as exc:  # several named templates, none "default" (nor "tool_use" with tools): the server's
        # to fix, not a request's (no field)
        named = ", ".join(sorted(tokenizer.chat_template)) if isinstance(tokenizer.chat_template, dict) else "?"
        raise RequestError(f"this engine's tokenizer has several chat templates ({named}) and none for this chat "
                           f"({exc}); give one (chat_template=, --chat-template FILE)") from exc
    if not template.strip():  # a truncated copy, or an editor's save on a full disk: no prompt would come of it
        raise EngineError("this engine's chat template (tokenizer/chat_template.jinja) is empty; restore it, rebuild "
                          "the engine, or give a template (chat_template=, --chat-template FILE)")
    if "developer" not in template:  # OpenAI's newer name for the system role, which most templates do not know
        messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
    described = None  # the tools in the first message, for a template refusing an added system turn (Mistral's)
    if not reads_tools(template):
        calls_as_text = "tool_calls" not in template
        if tools and messages and messages[0]["role"] != "system":
            described = as_text(messages, tools, calls_as_text, system=False)
        messages, tools = as_text(messages, tools, calls_as_text), None

    def apply(conversation: list[dict[str, Any]]) -> str:
        return tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False,
                                             add_generation_prompt=options.add_generation_prompt,
                                             continue_final_message=options.continue_final_message, **template_kwargs)
    try:
        return apply(messages)
    except Exception as exc:  # the template's own errors (raise_exception, a division by zero, ...) and jinja's
        if described is not None:
            with contextlib.suppress(Exception):
                return apply(described)
        raise RequestError(f"this model's chat template refused the messages: {exc}", field="messages") from exc


def check_template_kwargs(kwargs: dict[str, Any] | None, tokenizer) -> dict[str, Any]:
    """vLLM's rule: names apply_chat_template takes itself are not template variables."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        raise RequestError(f"chat_template_kwargs is an object of template variable names to values, got "
                           f"{kwargs!r:.80}", field="chat_template_kwargs")
    own = {name for name, p in inspect.signature(tokenizer.apply_chat_template).parameters.items()
           if p.kind is not p.VAR_KEYWORD} - {"documents"}  # RAG templates' documents: passed on, as vLLM's
    taken = sorted((own | {"messages", "conversations"}) & kwargs.keys())
    if taken:
        raise RequestError(f"chat_template_kwargs cannot set {', '.join(taken)}: they are not template variables "
                           "(messages and tools have their own fields); leave them out", field="chat_template_kwargs")
    documents = kwargs.get("documents")
    if documents is not None and not (isinstance(documents, list) and all(isinstance(d, dict) for d in documents)):
        raise RequestError(f"documents is a list of objects (e.g. {{\"title\": ..., \"text\": ...}}), got "
                           f"{documents!r:.80}", field="documents")
    return kwargs


def load_chat_template(value: str | Path) -> str:
    """A chat template from a file (its text: Jinja, as chat_template.jinja holds), else, as vLLM reads one, the
    value itself where it looks like a template (braces or a line break); refused unless it parses as transformers
    parses chat templates."""

    text = str(value)
    path = Path(text).expanduser()
    try:
        inline = not path.is_file()
    except (OSError, ValueError):  # not a path at all (a name too long, a NUL)
        inline = True
    if inline and not any(c in text for c in "{}\n"):
        raise RequestError(f"chat template {text!r:.120} is neither a file nor a template; give the path of a "
                           ".jinja file or the template itself", field="chat_template")
    if not inline:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise RequestError(f"chat template {path} could not be read as UTF-8 text: {exc}",
                               field="chat_template") from None
    where = "the template given" if inline else str(path)
    if not text.strip():
        raise RequestError(f"{where} is empty; give a chat template", field="chat_template")
    if problem := template_problem(text):
        raise RequestError(f"{where} is not a valid Jinja chat template: {problem}", field="chat_template")
    return text


def template_problem(text: str) -> str | None:
    """Why a chat template does not parse ("line N: ...", or that it is empty), or None."""
    from jinja2 import TemplateSyntaxError

    if not text.strip():
        return "it is empty"

    try:
        _environment().parse(text)
    except TemplateSyntaxError as exc:
        return f"line {exc.lineno}: {exc.message}"
    return None


@lru_cache(maxsize=1)
def _environment():
    """transformers' chat template environment (its extensions: loop controls, {% generation %})."""
    _compile_jinja_template = from_transformers("_compile_jinja_template",
                                                module="transformers.utils.chat_template_utils")

    return _compile_jinja_template("").environment


@lru_cache(maxsize=8)
def reads_tools(template: str) -> bool:
    from jinja2 import TemplateSyntaxError, meta

    try:
        return "tools" in meta.find_undeclared_variables(_environment().parse(template))
    except TemplateSyntaxError as exc:  # the engine's own template (one given was checked): the engine is at fault
        raise EngineError(f"this engine's chat template does not parse (line {exc.lineno}: {exc.message}); fix "
                          "tokenizer/chat_template.jinja in the engine or give one (--chat-template FILE)") from None


def as_text(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
            calls_as_text: bool = True, system: bool = True) -> list[dict[str, Any]]:
    """For a template that reads no tools: the functions described in the system message (one is added first where
    none is; `system` False: in front of the first message instead), and, unless it renders `tool_calls` itself,
    earlier calls written into their assistant messages as the `<tool_call>` blocks the description asks for."""
    if calls_as_text:
        messages = [{k: v for k, v in m.items() if k != "tool_calls"}
                    | {"content": (m.get("content") or "") + "".join(map(call_text, m["tool_calls"]))}
                    if m.get("tool_calls") else m for m in messages]
    if not tools:
        return messages
    functions = "\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in tools)
    preamble = TOOLS_PREAMBLE.format(functions=functions)
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{preamble}"}, *messages[1:]]
    if not system and messages:
        first = messages[0]
        return [{**first, "content": f"{preamble}\n\n{first.get('content') or ''}"}, *messages[1:]]
    return [{"role": "system", "content": preamble}, *messages]


def template_calls(calls: Any) -> list[dict[str, Any]]:
    """An assistant message's tool calls as chat templates expect them: OpenAI's {'type': 'function', 'function':
    {...}} (a bare {'name', 'arguments'} call is wrapped so), each call's arguments an object (OpenAI sends JSON
    text, which a template would render as a string, quoted again). Applied once, by render_chat."""
    if not isinstance(calls, list):
        raise RequestError(f"tool_calls is a list of calls, got {calls!r:.80}", field="messages")
    out = []
    for index, call in enumerate(calls):
        if isinstance(call, dict) and "function" not in call and "name" in call:
            call = {**{k: v for k, v in call.items() if k not in ("name", "arguments")}, "type": "function",
                    "function": {"name": call["name"], "arguments": call.get("arguments", {})}}
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function" \
                or not isinstance(function.get("name"), str):
            raise RequestError(f"tool call {index} is {call!r:.120}; each is {{'id': ..., 'type': 'function', "
                               "'function': {'name': ..., 'arguments': JSON text}}", field="messages")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except (ValueError, RecursionError):
                raise RequestError(f"tool call {index}'s arguments are not JSON: {arguments!r:.80}",
                                   field="messages") from None
        out.append({**call, "type": "function", "function": {**function, "arguments": arguments}})
    return out


def call_text(call: dict[str, Any]) -> str:
    function = call["function"]  # template_calls' form: arguments an object
    arguments = function.get("arguments", {})
    return f"<tool_call>{json.dumps({'name': function.get('name'), 'arguments': arguments}, ensure_ascii=False)}" \
           "</tool_call>"


def check_tools(tools: Any) -> None:
    if not isinstance(tools, list):
        raise RequestError(f"tools is a list of {{'type': 'function', 'function': {{...}}}}, got {tools!r:.80}",
                           field="tools")
    names = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function":
            raise RequestError(f"tool {i} is {tool!r:.80}; each tool is {{'type': 'function', 'function': "
                               "{'name': ..., 'parameters': {...}}}", field="tools")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise RequestError(f"tool {i}'s function name {name!r:.80} must be 1-64 letters, digits, _ or -",
                               field="tools")
        if name in names:
            raise RequestError(f"two tools are named {name!r}; give each function its own name", field="tools")
        names.add(name)
        if not isinstance(function.get("parameters", {}), dict):
            raise RequestError(f"function {name!r}'s parameters must be a JSON Schema object", field="tools")
