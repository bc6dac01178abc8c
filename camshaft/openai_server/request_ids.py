"""A generation request's id: the client's X-Request-Id (vLLM's header: a caller's trace id) or a new one. The
response's id is it behind the API's prefix (cmpl-ID, chatcmpl-ID), the response carries it back in X-Request-Id,
and the server's log lines about the request begin with the response's id."""

from __future__ import annotations

import re
import uuid

from fastapi import Request

from camshaft.openai_server.body_limit import ASGIApp, Message, Receive, Scope, Send
from camshaft.openai_server.errors import APIError

SENT_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")


def response_id(request: Request, prefix: str) -> str:
    """PREFIX-ID, ID the request's X-Request-Id or a new one (the response's X-Request-Id header from now on)."""
    sent = request.headers.get("x-request-id")
    if sent is not None and not SENT_ID.fullmatch(sent):
        raise APIError(400, f"X-Request-Id must be 1 to 128 letters, digits or . _ : / + = @ -, got {sent!r:.80}; "
                       "send a trace id of those, or leave the header out for one the server makes")
    request.state.request_id = sent or uuid.uuid4().hex
    request.state.response_id = f"{prefix}-{request.state.request_id}"
    return request.state.response_id


class EchoRequestId:
    """Responses to requests given an id (response_id) carry it in their X-Request-Id header, errors included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_id(message: Message) -> None:
            given = scope.get("state", {}).get("request_id")
            if message["type"] == "http.response.start" and given is not None:
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", given.encode())]
            await send(message)

        await self.app(scope, receive, send_id if scope["type"] == "http" else send)
