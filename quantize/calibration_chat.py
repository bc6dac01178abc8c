"""Chat conversations as calibration samples: rows of {"role", "content"} messages (the `messages` field of JSONL
rows or a dataset column), rendered with the model's chat template so calibration sees the text the model will
serve."""

from __future__ import annotations

from typing import Any

from camshaft.quantize.spec import QuantizeError

Messages = list[dict[str, str]]
Sample = str | Messages  # a text, or a conversation rendered by the tokenizer's chat template
CHAT_FIELD = "messages"


def is_chat_feature(feature: Any) -> bool:
    """A `datasets` feature holding a list of {"role", "content"} structs (its List)."""
    inner = getattr(feature, "feature", None)
    return isinstance(inner, dict) and {"role", "content"} <= set(inner)


def checked_messages(value: list, where: str) -> Messages:
    for number, message in enumerate(value):
        if not isinstance(message, dict) or not {"role", "content"} <= set(message):
            found = f"an object with the keys {sorted(message)[:10]}" if isinstance(message, dict) else \
                type(message).__name__
            raise QuantizeError(f'{where}: chat messages must be objects with "role" and "content" strings, found '
                                f"{found}")
        wrong = next((k for k in ("role", "content") if not isinstance(message[k], str)), None)
        if wrong is not None:
            raise QuantizeError(f"{where}: message {number}'s {wrong} is {message[wrong]!r:.60}, not a string (tool "
                                "calls and content parts are not rendered); give conversations of text turns, or "
                                "a text column with PATH:COLUMN")
    return value


def sample_chars(sample: Sample) -> int:
    """Characters of text a sample holds (0: nothing to calibrate on)."""
    if isinstance(sample, str):
        return len(sample) if sample.strip() else 0
    return sum(len(m["content"]) for m in sample if m["content"].strip())


def render(tokenizer: Any, messages: Messages, source: str) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise QuantizeError(f"calibration data ({source}) holds chat messages, but the model's tokenizer has no chat "
                            "template to render them; give plain text rows")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as exc:  # jinja2's TemplateError, or the template's own raise_exception
        raise QuantizeError(f"calibration data ({source}): the chat template refused a conversation ({exc}); "
                            f"first message: {messages[0] if messages else 'none'}") from exc
