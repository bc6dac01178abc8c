"""Response bodies and stream chunks of /v1/completions and /v1/chat/completions."""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any

from camshaft.openai_server.tokens import TextOffsets, TokenText
from camshaft.openai_server.tools import ToolChoice
from camshaft.runtime.detokenizer import TextStream
from camshaft.runtime.outputs import GenerationResult, RequestOutput
from camshaft.runtime.sampler import SampleResult

_FLOOR = -9999.0  # OpenAI's stand-in for a log-prob of -inf (JSON has no infinities)


def _logprob(value: float | None) -> float:
    return _FLOOR if value is None or not math.isfinite(value) else max(value, _FLOOR)


def stop_reason(result: GenerationResult | None) -> str | int | list[int] | None:
    """vLLM's field: the stop string, stop token id or stop word (ids) that ended the choice; else null."""
    reason = result.stop_reason if result is not None else None
    return list(reason) if isinstance(reason, tuple) else reason


def finish_reason(reason: str) -> str:
    return reason if reason in ("stop", "length") else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body, separators=(',', ':'))}\n\n"


class _Shape:
    """What completions and chat share: ids, envelopes and token strings."""

    object: str
    chunk_object: str
    prefix: str
    shows_output = True  # the choices show the output tokens (usage and metrics count them)

    def __init__(self, model: str, tokenizer, response_id: str | None = None) -> None:
        self.model, self.created = model, int(time.time())
        self.id = response_id or f"{self.prefix}-{uuid.uuid4().hex}"
        self.tokens = TokenText(tokenizer)

    def token(self, token_id: int) -> str:
        return self.tokens.get(token_id)[0]

    def response(self, choices: list[dict], prompt_tokens: int, completion_tokens: int) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}

    def chunk(self, choices: list[dict], usage_: dict | None = None, with_usage: bool = True) -> dict:
        """A stream's chunk; OpenAI's: a usage field (null but on the last) only when include_usage asked for it."""
        return {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                "choices": choices, **({"usage": usage_} if with_usage else {})}


class CompletionShape(_Shape):
    object = chunk_object = "text_completion"
    prefix = "cmpl"

    def __init__(self, model: str, tokenizer, prompts: list[list[int]], n: int,
                 skip_special_tokens: bool = True, echo: str | None = None,
                 prompt_texts: list[str] | None = None, response_id: str | None = None) -> None:
        """echo: None, "prompt+output" (the prompt as sent, then the output's text) or "prompt" (max_tokens 0);
        prompt_texts: the prompts as sent (echo)."""
        super().__init__(model, tokenizer, response_id)
        # text_offset: characters of the choice's text before each token (a token that ends inside a character
        # adds none), counted by a detokenizer of its own that runs on across a streamed choice's chunks
        self._tokenizer, self._prompts, self._n = tokenizer, prompts, n
        self._skip_special, self.echo, self._prompt_texts = skip_special_tokens, echo, prompt_texts or []
        self._texts: dict[int, TextOffsets] = {}
        self._opened: set[int] = set()  # streamed choices whose echoed prompt has been sent
        self.shows_output = echo != "prompt"  # echo with max_tokens 0: the output (one token) is not shown

    def logprobs(self, index: int, samples: list[SampleResult] | tuple[SampleResult, ...]) -> dict:
        if index not in self._texts:  # a streamed choice's offsets run on across its chunks
            self._texts[index] = self._offsets(self._prompts[index // self._n], self._skip_special)
        return self._entries(samples, self._texts[index].placed(samples))

    def _offsets(self, context: list[int], skip_special_tokens: bool) -> TextOffsets:
        stream = TextStream(self._tokenizer, context, skip_special_tokens=skip_special_tokens)
        return TextOffsets(stream, self.tokens)

    def _entries(self, samples: list[SampleResult] | tuple[SampleResult, ...], offsets: list[int]) -> dict:
        # an echoed prompt's first token has no log-prob: null, as OpenAI
        return {"tokens": [self.token(s.token_id) for s in samples],
                "token_logprobs": [None if s.logprob is None else _logprob(s.logprob) for s in samples],
                "top_logprobs": [None if s.logprob is None else self._top(s) for s in samples],
                "text_offset": offsets}

    def _top(self, sample: SampleResult) -> dict[str, float | None]:
        """The alternatives, best first, and the chosen token among them (OpenAI's legacy shape)."""
        top = {self.token(t): _logprob(lp) for t, lp in sample.top_logprobs or ()}
        top.setdefault(self.token(sample.token_id), _logprob(sample.logprob))
        return top

    def choice(self, index: int, result: GenerationResult, with_logprobs: bool) -> dict:
        alone = not self.shows_output
        prompt_text, logprobs = self._echoed(index, result.prompt_token_ids, result.prompt_logprobs, with_logprobs)
        if not alone:
            logprobs = _joined(logprobs, self._output_logprobs(index, result.logprobs or [], with_logprobs))
        return {"index": index, "text": prompt_text + ("" if alone else result.text),
                "finish_reason": "length" if alone else finish_reason(result.finish_reason),
                "stop_reason": None if alone else stop_reason(result), "logprobs": logprobs}

    def _echoed(self, index: int, prompt_ids: list[int], prompt_logprobs: list[SampleResult | None] | None,
                with_logprobs: bool) -> tuple[str, dict | None]:
        """The prompt as sent and, with logprobs, its entries (counted from its start), when echo asks for them."""
        if not self.echo:
            return "", None
        sent = self._prompt_texts[index // self._n]
        if not with_logprobs:
            return sent, None
        prompt = [SampleResult(prompt_ids[0]), *(prompt_logprobs or [])[1:]]
        # text sent as text: the tokenizer's own offsets into it (a BOS it added: 0; a normalizer or an added
        # prefix space changes the decoded text, not these)
        encoded = self._tokenizer(sent, return_offsets_mapping=True)
        if list(encoded["input_ids"]) == list(prompt_ids):
            return sent, self._entries(prompt, _starts(sent, encoded["offset_mapping"]))
        # token ids: offsets into their decoded text: special tokens written in it count their characters, those the
        # tokenizer added before it (BOS) none; the detokenizing that gives back the text as sent tells which
        first = shifted = None
        for skip in (self._skip_special, not self._skip_special):
            stream = self._offsets([], skip)
            entries = self._entries(prompt, stream.placed(prompt))
            if stream.text.text == sent:
                return sent, entries
            added = len(stream.text.text) - len(sent)
            if not skip and added > 0 and stream.text.text.endswith(sent):
                shifted = entries | {"text_offset": [max(0, at - added) for at in entries["text_offset"]]}
            first = first or entries
        return sent, shifted or first

    def _output_logprobs(self, index: int, samples: list[SampleResult] | tuple[SampleResult, ...],
                         with_logprobs: bool) -> dict | None:
        """The output's entries, their offsets after an echoed prompt's text."""
        if not with_logprobs:
            return None
        entries = self.logprobs(index, samples)
        shift = len(self._prompt_texts[index // self._n]) if self.echo else 0
        entries["text_offset"] = [shift + at for at in entries["text_offset"]]
        return entries

    def opening(self, num_choices: int) -> list[dict]:
        return []

    def chunk_choice(self, index: int, output: RequestOutput, with_logprobs: bool) -> dict | None:
        alone, opening = not self.shows_output, bool(self.echo) and index not in self._opened
        if alone and not output.finished:
            return None
        if not (opening or output.delta or output.finished or (with_logprobs and output.logprobs)):
            return None
        text, logprobs = "", None
        if opening:  # echo: the prompt (and its entries) before the choice's first text
            self._opened.add(index)
            prompt_logprobs = output.prompt_logprobs or (output.result.prompt_logprobs if output.result else None)
            text, logprobs = self._echoed(index, self._prompts[index // self._n], prompt_logprobs, with_logprobs)
        if not alone:
            text += output.delta
            logprobs = _joined(logprobs, self._output_logprobs(index, output.logprobs, with_logprobs))
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": ("length" if alone else finish_reason(output.result.finish_reason))
                if output.result else None,
                "stop_reason": None if alone else stop_reason(output.result)}


def _starts(text: str, spans: list[tuple[int, int]]) -> list[int]:
    """Where each token's text begins, from the tokenizer's character spans of `text`: whitespace between a span and
    the previous one is the token's, which the tokenizer left out (ByteLevel's trim_offsets); a token it added after
    the text (an EOS: span (0, 0)) is where the text ends, as one added before it (a BOS) is at 0."""
    starts, end = [], 0
    for start, stop in spans:
        trimmed = start > end and text[end:start].isspace()
        starts.append(end if trimmed or (start == stop == 0 and end > 0) else start)
        end = max(end, stop)
    return starts


def _joined(first: dict | None, second: dict | None) -> dict | None:
    return second if first is None else first if second is None else {key: first[key] + second[key] for key in first}


class ChatShape(_Shape):
    object, chunk_object = "chat.completion", "chat.completion.chunk"
    prefix = "chatcmpl"

    def __init__(self, model: str, tokenizer, tools: ToolChoice | None = None, echo: str = "",
                 response_id: str | None = None) -> None:
        """tools: the request's function calling (its output read into tool calls), or None. echo: text each
        choice's content begins with (vLLM's echo of a begun assistant message)."""
        super().__init__(model, tokenizer, response_id)
        self._tools = tools if tools is not None and tools.kind != "none" else None
        self._readers: dict[int, Any] = {}
        self._echo = echo

    def logprobs(self, samples: list[SampleResult] | tuple[SampleResult, ...]) -> dict:
        def entry(token_id: int, logprob: float | None) -> dict:
            text, raw = self.tokens.get(token_id)
            return {"token": text, "logprob": _logprob(logprob), "bytes": raw}

        return {"content": [{**entry(s.token_id, s.logprob), "top_logprobs": [entry(t, lp) for t, lp in
                                                                             s.top_logprobs or ()]}
                            for s in samples]}

    def choice(self, index: int, result: GenerationResult, with_logprobs: bool) -> dict:
        message, reason = {"role": "assistant", "content": result.text}, finish_reason(result.finish_reason)
        if self._tools is not None:
            reader = self._tools.reader(continuing=bool(self._echo))  # after the echo: the content's start kept
            (content, calls), (rest, more) = reader.feed(result.text), reader.finish()
            message = {"role": "assistant", "content": content + rest or None}
            if calls + more:
                message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in calls + more]
            reason = self._tools.finish_reason(reader, reason)
        if self._echo:
            message["content"] = self._echo + (message["content"] or "")
        return {"index": index, "message": message,
                "logprobs": self.logprobs(result.logprobs or []) if with_logprobs else None,
                "finish_reason": reason, "stop_reason": stop_reason(result)}

    def opening(self, num_choices: int) -> list[dict]:
        """The assistant role first, as OpenAI streams it."""
        return [{"index": i, "delta": {"role": "assistant", "content": self._echo}, "logprobs": None,
                 "finish_reason": None} for i in range(num_choices)]

    def chunk_choice(self, index: int, output: RequestOutput, with_logprobs: bool) -> dict | None:
        content, calls = output.delta, []
        reason = finish_reason(output.result.finish_reason) if output.result else None
        if self._tools is not None:
            reader = self._readers.get(index) or self._readers.setdefault(
                index, self._tools.reader(continuing=bool(self._echo)))
            content, calls = reader.feed(output.delta)
            if output.finished:
                rest, more = reader.finish()
                content, calls = content + rest, calls + more
            reason = reason and self._tools.finish_reason(reader, reason)
        if not (content or calls or output.finished or (with_logprobs and output.logprobs)):
            return None
        delta = {**({"content": content} if content else {}), **({"tool_calls": calls} if calls else {})}
        return {"index": index, "delta": delta, "logprobs": self.logprobs(output.logprobs) if with_logprobs else None,
                "finish_reason": reason, "stop_reason": stop_reason(output.result)}
