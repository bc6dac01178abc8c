"""OpenAI chat messages and vLLM's chat template options, as chat templates take them, and vLLM's /tokenize and
/detokenize bodies."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt

from camshaft.errors import RequestError
from camshaft.runtime.chat_messages import text_content


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None
    reasoning_content: str | None = None  # an assistant's earlier thinking (Qwen3's template reads it)
    reasoning: str | None = None  # vLLM's newer name for it

    def template_dict(self) -> dict[str, Any]:
        """{'role', 'content'} with text content parts joined by newlines (as vLLM and TensorRT-LLM join them), the
        tool fields as sent (render_chat makes each call's arguments an object, as chat templates expect), and an
        assistant's reasoning under both its names, as vLLM passes it."""
        message: dict[str, Any] = {"role": self.role, "content": self._text()}
        if self.tool_calls:
            message["tool_calls"] = list(self.tool_calls)
        message.update({k: v for k, v in (("tool_call_id", self.tool_call_id), ("name", self.name)) if v is not None})
        thinking = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thinking is not None and self.role == "assistant":
            message |= {"reasoning_content": thinking, "reasoning": thinking}
        return message

    def _text(self) -> str:
        content = self.content
        return (text_content(content, self.role) if isinstance(content, list) else content) or ""


class TemplateOptions(BaseModel):
    """The chat template options of OpenAI and vLLM bodies: tools, chat_template_kwargs (vLLM's) and how the chat
    ends (add_generation_prompt, continue_final_message) reach the template; a request's own template does not."""

    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None  # vLLM's: a RAG template's documents
    chat_template: Any = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False

    def check_template_options(self) -> None:
        if self.chat_template is not None:  # vLLM refuses it too, unless trusted: it would run a client's template
            raise RequestError("a request's own chat_template is not taken: the server's (its engine's, or "
                               "--chat-template) renders every chat; leave it out", field="chat_template")

    def chat_keywords(self) -> dict[str, Any]:
        """The template options as LLM.encode takes them (documents among the template's variables)."""
        kwargs = self.chat_template_kwargs
        if self.documents is not None:
            if isinstance(kwargs, dict) and "documents" in kwargs:
                raise RequestError("documents are given twice (as a field and in chat_template_kwargs); send one",
                                   field="documents")
            kwargs = {**(kwargs if isinstance(kwargs, dict) else {}), "documents": self.documents}
        return {"chat_template_kwargs": kwargs, "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}


class TokenizeRequest(TemplateOptions):
    """vLLM's /tokenize body: a prompt or chat messages, tokenized exactly as a completion or chat request would be
    (its options at their defaults only: other values would tokenize unlike generation)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None
    return_token_strs: StrictBool = False
    tool_choice: Any = None  # "none" leaves the tools out of the prompt, as in a chat request

    def prompt_tools(self) -> list[dict[str, Any]] | None:
        return None if self.tool_choice == "none" else self.tools or None

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("send one of prompt (text) or messages (chat)")
        chat_only = [name for name in ("tools", "chat_template_kwargs", "documents", "continue_final_message")
                     if getattr(self, name)]
        chat_only += [] if self.add_generation_prompt else ["add_generation_prompt"]
        if self.prompt is not None and chat_only:
            raise RequestError(f"{' and '.join(chat_only)} go with messages (a chat); a prompt is tokenized as it is: "
                               "leave them out", field=chat_only[0])
        self.check_template_options()
        default = self.prompt is not None  # vLLM's: special tokens for a prompt, none added to a chat template
        if self.add_special_tokens not in (None, default):
            raise RequestError("add_special_tokens takes its default only: camshaft tokenizes as its completions "
                               "and chat completions do; leave it out", field="add_special_tokens")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[StrictInt]
