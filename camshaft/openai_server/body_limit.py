"""Request bodies are read whole, within a size and a time limit, before the app sees them: a body too large is a 413
and one that trickles in too slowly a 408, both as OpenAI-style errors, instead of memory or a connection held (the
header phase before it has no limit here: docs/openai.md)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from camshaft.openai_server.errors import APIError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

BODY_TIMEOUT_S = 30.0


def max_body_bytes(max_seq_len: int, max_batch_size: int, max_queue: int | None) -> int:
    """Room for every prompt one request may hold (batch + queue of them, at the context's length) at 16 bytes a
    token (escaped JSON text or ids), plus 1 MiB for the rest of the body."""
    return 2**20 + 16 * max_seq_len * (max_batch_size + (max_batch_size if max_queue is None else max_queue))


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, refused: Callable[[str, int], None],
                 timeout_s: float = BODY_TIMEOUT_S) -> None:
        """refused(path, status) counts a refusal (path: the request's, as the client sent it)."""
        self.app, self.max_bytes, self.refused, self.timeout_s = app, max_bytes, refused, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(scope, send, 413, self._too_large(f"{int(length)} bytes"))
        try:
            body = await asyncio.wait_for(self._read(receive), self.timeout_s)
        except TimeoutError:
            return await self._refuse(scope, send, 408, f"the request body did not arrive within {self.timeout_s:g} "
                                                        "s; send it at once")
        if body is None:
            return None  # the client left before sending it
        if len(body) > self.max_bytes:
            return await self._refuse(scope, send, 413, self._too_large(f"more than {self.max_bytes} bytes"))
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        return await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> bytes | None:
        """The whole body, or its first bytes past the limit; None if the client disconnects."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes or not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self, size: str) -> str:
        return (f"the request body has {size}; this server takes at most {self.max_bytes} (prompts no longer than "
                "the model's context, at most batch + queue of them in one request): send fewer or shorter prompts")

    async def _refuse(self, scope: Scope, send: Send, status: int, message: str) -> None:
        self.refused(scope.get("path", ""), status)
        await send_error(scope, send, status, message, headers=[(b"connection", b"close")])


async def send_error(scope: Scope, send: Send, status: int, message: str, code: str | None = None,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """An OpenAI-style error response, sent before the app sees the request (scope state "refusal": its error)."""
    error = APIError(status, message, code=code).body()
    scope.setdefault("state", {})["refusal"] = error["error"]
    body = json.dumps(error).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})
