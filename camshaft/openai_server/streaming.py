"""Responses that stream: server-sent events closed however the response ends, and work abandoned when the client
goes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from camshaft.openai_server.errors import from_exception
from camshaft.openai_server.generation import Generation
from camshaft.openai_server.responses import ChatShape, CompletionShape, sse, usage

T = TypeVar("T")


class EventStream(StreamingResponse):
    """Server-sent events whose generator is closed however the response ends (a disconnect cancels it)."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """The result of `work`, or None once the client has gone (work is then cancelled)."""
    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        task.cancel()
    return task.result() if task.done() and not task.cancelled() else None


async def events(generation: Generation, shape: CompletionShape | ChatShape, with_logprobs: bool,
                  stream_usage: str | None) -> AsyncIterator[str]:
    """stream_usage (protocol's): None, "final" (a last chunk with the usage, null on the others) or "continuous"
    (vLLM's continuous_usage_stats: each chunk also carries its choice's usage so far: that choice's prompt and
    output tokens)."""
    continuous, with_usage = stream_usage == "continuous", stream_usage is not None
    completion_tokens, per_choice = 0, [0] * generation.num_choices
    try:
        opening = shape.opening(generation.num_choices)  # chat's: one prompt, no output yet
        if opening:
            yield sse(shape.chunk(opening, usage(generation.prompt_tokens, 0) if continuous else None,
                                  with_usage=with_usage))
        async for index, output in generation:
            tokens = len(output.token_ids) if shape.shows_output else 0
            completion_tokens += tokens
            per_choice[index] += tokens
            choice = shape.chunk_choice(index, output, with_logprobs)
            if choice is not None:
                so_far = usage(generation.choice_prompt_tokens(index), per_choice[index]) if continuous else None
                yield sse(shape.chunk([choice], so_far, with_usage=with_usage))
            # outputs already queued are read without waiting, and a gone client's sends return at once: a pause
            # per output lets the other requests (and the disconnect that cancels this one) run
            await asyncio.sleep(0)
        if with_usage:
            yield sse(shape.chunk([], usage(generation.prompt_tokens, completion_tokens)))
    except Exception as exc:  # the response has started: the error goes in the stream
        generation.failed(exc)
        yield sse(from_exception(exc).body())
    finally:
        generation.abort()
    yield sse("[DONE]")
