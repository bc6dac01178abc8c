"""Prompts in every form generation takes (text, token ids, vLLM's prompt dicts, chat messages with tools) to the
token ids fed to an engine, checked against its limits and vocabulary; Session and LLM each hold one."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from camshaft.checks import is_int, is_int_at_least
from camshaft.errors import CapacityError, RequestError
from camshaft.runtime.chat_template import ChatOptions, render_chat
from camshaft.runtime.prompt_text import encode_text

# text, token ids (a list, tuple or 1-D array), or vLLM's {"prompt": text} / {"prompt_token_ids": ids}
Prompt = str | list[int] | tuple[int, ...] | np.ndarray | dict[str, Any]
PROMPT_KEYS = ("prompt", "prompt_token_ids")


@contextmanager
def prompt_said_as_messages(chat: bool) -> Iterator[None]:
    """A RequestError raised inside about the prompt names "messages" where the prompt is a chat's."""
    try:
        yield
    except RequestError as exc:
        if chat and exc.field == "prompt":
            exc.field = "messages"
        raise


class PromptEncoder:
    def __init__(self, tokenizer, max_seq_len: int, vocab_size: int) -> None:
        self.tokenizer, self.max_seq_len, self.vocab_size = tokenizer, max_seq_len, vocab_size

    def encode(self, prompt: Prompt | None = None, messages: list[dict[str, Any]] | None = None, *,
               chat: ChatOptions | None = None, for_generation: bool = True,
               most_counted: int | None = None) -> list[int]:
        """The prompt's ids as generation feeds them to the engine: text, token ids, or chat messages through the
        chat template as `chat` asks (tools, template variables, how the conversation ends). For counting tokens
        (for_generation False), an empty prompt is tokenized, and text up to `most_counted` tokens (None: however
        long; beyond: a CapacityError after tokenizing a prefix)."""
        if isinstance(prompt, dict):
            if len(prompt) != 1 or next(iter(prompt)) not in PROMPT_KEYS:
                raise RequestError(f'a prompt dict holds one key, "prompt" (text) or "prompt_token_ids", got the '
                                   f"keys {sorted(map(str, prompt))}", field="prompt")
            key, prompt = next(iter(prompt.items()))
            if isinstance(prompt, str) != (key == "prompt"):
                raise RequestError(f'"prompt" takes text and "prompt_token_ids" a list of token ids; got {key} = '
                                   f"{prompt!r:.80}", field="prompt")
        if prompt is None and messages is None:
            raise RequestError("the prompt is None; pass text, token ids or a prompt dict (or chat messages)",
                               field="prompt")
        if prompt is not None and messages is not None:
            raise RequestError("pass exactly one of a prompt or chat messages", field="messages")
        if not (most_counted is None or is_int_at_least(most_counted, 1)):
            raise RequestError(f"most_counted must be an integer >= 1 or None, got {most_counted!r:.40}",
                               field="most_counted")
        limit = self.max_seq_len if for_generation else most_counted
        said = None if for_generation else f"counting stops at most_counted ({most_counted})"
        if chat is not None and chat.changed() and messages is None:
            raise RequestError(f"{' and '.join(chat.changed())} go with chat messages; pass messages=[...]",
                               field="messages")
        if messages is not None:
            ids = self._chat_prompt(messages, chat or ChatOptions(), limit, said)[1]
        elif isinstance(prompt, str):
            if not prompt and for_generation:
                raise RequestError("the prompt is empty; pass some text", field="prompt")
            ids = encode_text(self.tokenizer, prompt, limit, cap_said=said)
        else:
            vocab = self.vocab_size
            items = list(prompt) if isinstance(prompt, (list, tuple, np.ndarray)) else None
            if items is None or not all(is_int(t) for t in items):
                raise RequestError(f"a prompt is a string or a list of integer token ids, got {prompt!r:.80}",
                                   field="prompt")
            ids = [int(t) for t in items]
            if any(t < 0 or t >= vocab for t in ids):
                raise RequestError(f"prompt token ids must lie in [0, {vocab})", field="prompt")
        if not ids and for_generation:
            raise RequestError("the prompt encodes to no tokens; pass some text",
                               field="prompt" if messages is None else "messages")
        if not for_generation and most_counted is not None and len(ids) > most_counted:
            raise CapacityError(f"the prompt holds {len(ids)} tokens, more than most_counted ({most_counted})",
                                field="prompt")
        return ids

    def chat_prompt(self, messages: list[dict[str, Any]], chat: ChatOptions | None = None) -> tuple[str, list[int]]:
        """A conversation as generation feeds it: the chat template's text, and its ids."""
        text, ids = self._chat_prompt(messages, chat or ChatOptions(), self.max_seq_len)
        if not ids:
            raise RequestError("the prompt encodes to no tokens; pass some text", field="messages")
        return text, ids

    def _chat_prompt(self, messages: list[dict[str, Any]], chat: ChatOptions, most: int | None,
                     said: str | None = None) -> tuple[str, list[int]]:
        """The chat template's text of a conversation and its ids (the template holds the special tokens: encoding
        adds no second BOS)."""
        text = render_chat(self.tokenizer, messages, chat)
        return text, encode_text(self.tokenizer, text, most, "the chat", add_special_tokens=False, cap_said=said,
                                 field="messages")
