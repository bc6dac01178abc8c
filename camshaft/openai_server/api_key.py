"""`--api-key`: every route but the operator's (/health, /metrics, /version) asks for `Authorization: Bearer KEY`
(vLLM's `--api-key` guards its /v1 routes; this guards /tokenize, /detokenize and the API docs too); a missing or
wrong key is a 401 in OpenAI's error shape."""

from __future__ import annotations

import hmac
from collections.abc import Callable

from camshaft.openai_server.body_limit import ASGIApp, Receive, Scope, Send, send_error

OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})


class ApiKey:
    def __init__(self, app: ASGIApp, key: str, refused: Callable[[str, int], None]) -> None:
        self.app, self.refused = app, refused
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path", "").rstrip("/") in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if given[:7].lower() == b"bearer ":
            given = b"Bearer " + given[7:].strip()
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        self.refused(scope.get("path", ""), 401)
        message = ("this server needs an API key: send the header 'Authorization: Bearer KEY' (the openai client's "
                   "api_key)" if not given else "the API key is not this server's; check the key the client sends")
        await send_error(scope, send, 401, message, code="invalid_api_key", headers=[(b"www-authenticate", b"Bearer")])
