"""A completion or chat request's id: the client's X-Request-Id (vLLM's header: a caller's trace id) or a new one.
The response's id is it behind the API's prefix (cmpl-ID, chatcmpl-ID), every response to the request carries it
back in X-Request-Id (a refusal too), and the server's log says in one line naming the response's id how the request
ended: Generation's line once it runs, else this module's refusal line."""

from __future__ import annotations

import logging
import re
import uuid
from typing import Any

from camshaft.openai_server.body_limit import ASGIApp, Message, Receive, Scope, Send

LOG = logging.getLogger("camshaft.openai_server")
PREFIXES = {"/v1/completions": "cmpl", "/v1/chat/completions": "chatcmpl"}
SENT_ID = re.compile(r"[!-~]{1,256}")  # printable ASCII without spaces: another value gets a new id


class RequestIds:
    """Sets scope state request_id (the header's value) and response_id; puts X-Request-Id on the response and logs
    a refusal (a status >= 400 before state "generating" was set), with what state "refusal" says of it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        prefix = PREFIXES.get(scope.get("path", "").rstrip("/")) if scope["type"] == "http" else None
        if prefix is None:
            return await self.app(scope, receive, send)
        sent = next((v for k, v in scope["headers"] if k == b"x-request-id"), b"").decode("latin-1").strip()
        given = sent if SENT_ID.fullmatch(sent) else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"], state["response_id"] = given, f"{prefix}-{given}"

        async def send_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", given.encode())]
                if message["status"] >= 400 and not state.get("generating"):
                    log_refusal(state["response_id"], message["status"], state.get("refusal"))
            await send(message)

        await self.app(scope, receive, send_id)


def log_refusal(response_id: str, status: int, refusal: dict[str, Any] | None) -> None:
    """One line: the status, the error's type, param and code; a server error's message too (a client's error's
    may quote the request, which is never logged)."""
    refusal = refusal or {}
    said = ", ".join(f"{key} {refusal[key]}" for key in ("param", "code") if refusal.get(key))
    line = f"{response_id}: refused, {status}{' ' + refusal['type'] if refusal.get('type') else ''}"
    line += f" ({said})" if said else ""
    if status >= 500 and status != 503:
        LOG.error("%s: %s", line, refusal.get("message", "?"))
    else:
        (LOG.warning if status == 503 else LOG.info)(line)
