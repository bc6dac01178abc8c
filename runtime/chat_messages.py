"""Chat messages as the Python API and the servers take them: a list of {'role', 'content'} dicts, content as a
string or OpenAI's text parts (joined by newlines, as vLLM and TensorRT-LLM join them)."""

from __future__ import annotations

from typing import Any

from camshaft.errors import RequestError
from camshaft.runtime.prompt_text import check_unicode


def checked_messages(messages: Any) -> list[dict[str, Any]]:
    """The messages, each content a string (text parts joined); each has a role and content, or tool calls."""
    if not isinstance(messages, list | tuple) or isinstance(messages, str):
        raise RequestError(f"chat messages must be a list of {{'role', 'content'}} dicts, got {messages!r:.80}",
                           field="messages")
    if not messages:
        raise RequestError("chat messages are empty; pass at least one {'role': ..., 'content': ...}",
                           field="messages")
    messages = [{**m, "content": text_content(m["content"], m.get("role"))}
                if isinstance(m, dict) and isinstance(m.get("content"), list) else m for m in messages]
    for i, message in enumerate(messages):
        calls = isinstance(message, dict) and bool(message.get("tool_calls"))
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not (isinstance(message.get("content"), str) or (calls and message.get("content") is None)):
            raise RequestError(f"chat message {i} is {message!r:.200}; each message is a dict with a 'role' and a "
                               "'content' string or list of text parts (None only beside 'tool_calls')",
                               field="messages")
        for key in ("role", "content"):
            if message.get(key) is not None:
                check_unicode(message[key], f"chat message {i}'s {key}", "messages")
    if not any((m.get("content") or "").strip() or m.get("tool_calls") for m in messages):
        raise RequestError("every chat message's content is empty; pass some text", field="messages")
    return messages


def text_content(parts: list[Any], role: Any) -> str:
    """OpenAI's content parts as one text: text parts (and an assistant's refusal parts, as OpenAI replays them)
    joined by newlines; any other kind (images, audio) is refused."""
    kinds = {"text": "text", **({"refusal": "refusal"} if role == "assistant" else {})}
    if any(not isinstance(part, dict) or part.get("type") not in kinds for part in parts):
        raise RequestError("only text content parts ({'type': 'text', 'text': ...}; an assistant's "
                           "{'type': 'refusal', 'refusal': ...} too) are supported", field="messages")
    texts = [part.get(kinds[part["type"]], "") for part in parts]
    if not all(isinstance(text, str) for text in texts):
        raise RequestError("a text content part's text must be a string", field="messages")
    return "\n".join(texts)
