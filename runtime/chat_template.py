"""Chat messages (and the functions a model may call) through the tokenizer's chat template.

A template that reads `tools` renders them its own way (Qwen2.5's, Llama 3.1's, Hermes'); for one that does not
(SmolLM2's), the functions and the `<tool_call>` answer format go into the system message, so the model sees them.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from camshaft.errors import RequestError
from camshaft.runtime.prompt_text import check_unicode

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
TOOLS_PREAMBLE = ("You may call one or more functions to answer. The functions, as JSON Schema:\n{functions}\n"
                  "To call one, answer with <tool_call>{{\"name\": <function name>, \"arguments\": <arguments "
                  "object>}}</tool_call>, one such block per call.")


TEMPLATE_ARGUMENTS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                                "tokenize", "return_dict", "chat_template", "conversation", "tokenizer_kwargs"})


def render_chat(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """The template's text of the conversation, ending with the assistant's generation prompt. template_kwargs:
    more variables the template reads (vLLM's chat_template_kwargs, e.g. Qwen3's enable_thinking)."""
    from jinja2 import TemplateError

    check_messages(messages)
    if tokenizer.chat_template is None:
        raise RequestError("this engine's tokenizer has no chat template; pass a plain prompt, or give the engine "
                           "one (chat_template=, --chat-template FILE)")
    if tools is not None:
        check_tools(tools)
    template_kwargs = check_template_kwargs(template_kwargs)
    tools = tools or None
    template = tokenizer.get_chat_template(tools=tools)
    if not reads_tools(template):
        messages, tools = as_text(messages, tools, calls_as_text="tool_calls" not in template), None
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                             **template_kwargs)
    except (TemplateError, TypeError) as exc:  # e.g. a template that wants alternating turns, no system role
        raise RequestError(f"this model's chat template refused the messages: {exc}") from exc


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        raise RequestError(f"chat_template_kwargs is an object of template variable names to values, got "
                           f"{kwargs!r:.80}")
    taken = sorted(TEMPLATE_ARGUMENTS & kwargs.keys())
    if taken:
        raise RequestError(f"chat_template_kwargs cannot set {', '.join(taken)}: camshaft sets them (messages and "
                           "tools have their own fields); leave them out")
    return kwargs


def load_chat_template(value: str | Path) -> str:
    """A chat template from a file (its text: Jinja, as chat_template.jinja holds) or given inline as Jinja text;
    refused unless it parses."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    text = str(value)
    inline = isinstance(value, str) and ("{{" in text or "{%" in text)
    if not inline:
        path = Path(value).expanduser()
        if not path.is_file():
            raise RequestError(f"chat template {text!r:.120} is neither a file nor Jinja text (holding {{{{ or "
                               "{%); give the path of a .jinja file or the template itself")
        text = path.read_text(encoding="utf-8")
    try:
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).parse(text)
    except TemplateSyntaxError as exc:
        where = "the template given" if inline else str(value)
        raise RequestError(f"{where} is not a valid Jinja chat template: line {exc.lineno}: {exc.message}") from None
    return text


@lru_cache(maxsize=8)
def reads_tools(template: str) -> bool:
    from jinja2 import meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return "tools" in meta.find_undeclared_variables(ImmutableSandboxedEnvironment().parse(template))


def as_text(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
            calls_as_text: bool = True) -> list[dict[str, Any]]:
    """For a template that reads no tools: the functions described in the system message (one is added first where
    none is), and, unless it renders `tool_calls` itself, earlier calls written into their assistant messages as the
    `<tool_call>` blocks the description asks for."""
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
    return [{"role": "system", "content": preamble}, *messages]


def call_text(call: dict[str, Any]) -> str:
    function = call.get("function", call) if isinstance(call, dict) else {}
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI's wire form: JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return f"<tool_call>{json.dumps({'name': function.get('name'), 'arguments': arguments}, ensure_ascii=False)}" \
           "</tool_call>"


def check_tools(tools: Any) -> None:
    if not isinstance(tools, list):
        raise RequestError(f"tools is a list of {{'type': 'function', 'function': {{...}}}}, got {tools!r:.80}")
    names = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function":
            raise RequestError(f"tool {i} is {tool!r:.80}; each tool is {{'type': 'function', 'function': "
                               "{'name': ..., 'parameters': {...}}}")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise RequestError(f"tool {i}'s function name {name!r:.80} must be 1-64 letters, digits, _ or -")
        if name in names:
            raise RequestError(f"two tools are named {name!r}; give each function its own name")
        names.add(name)
        if not isinstance(function.get("parameters", {}), dict):
            raise RequestError(f"function {name!r}'s parameters must be a JSON Schema object")


def check_messages(messages: list[dict[str, Any]]) -> None:
    """Each message has a role and a content string; an assistant message that calls tools may have none."""
    if not messages:
        raise RequestError("chat messages are empty; pass at least one {'role': ..., 'content': ...}")
    for i, message in enumerate(messages):
        calls = isinstance(message, dict) and bool(message.get("tool_calls"))
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not (isinstance(message.get("content"), str) or (calls and message.get("content") is None)):
            raise RequestError(f"chat message {i} is {message!r:.200}; each message is a dict with a 'role' and a "
                               "'content' string (None only beside 'tool_calls')")
        for key in ("role", "content"):
            if message.get(key) is not None:
                check_unicode(message[key], f"chat message {i}'s {key}")
    if not any((m.get("content") or "").strip() or m.get("tool_calls") for m in messages):
        raise RequestError("every chat message's content is empty; pass some text")
