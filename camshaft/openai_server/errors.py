"""Every error as OpenAI's `{"error": {"message", "type", "param", "code"}}` with a fitting HTTP status."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from camshaft.errors import CapacityError, EngineError, RequestError, ServerBusyError, ServerClosedError
from camshaft.openai_server.metrics import Metrics


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def from_exception(exc: Exception) -> APIError:
    """The API error for an exception raised while serving a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ServerBusyError):
        return APIError(503, str(exc), type="server_busy_error", code="server_busy")
    if isinstance(exc, ServerClosedError):
        return APIError(503, str(exc), type="server_error", code="server_stopped")
    if isinstance(exc, CapacityError):
        return APIError(400, str(exc), param=exc.field, code="context_length_exceeded")
    if isinstance(exc, RequestError):
        return APIError(400, str(exc), param=exc.field)
    if isinstance(exc, EngineError):  # the engine's files (a chat template that does not parse): the server's fault
        return APIError(500, str(exc), type="server_error")
    return APIError(500, f"internal server error: {exc!r}", type="server_error")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return "the request body is not valid JSON", None
    parts, param = [], None
    for error in errors:
        loc = [str(x) for x in error.get("loc", ()) if x != "body"]
        param = param or (loc[0] if loc else None)
        parts.append(f"{'.'.join(loc) or 'body'}: {error.get('msg')}")
    return "invalid request: " + "; ".join(parts), param


def route_path(request: Request) -> str:
    """The matched route's template (bounded label values for metrics), or "other" for unknown paths."""
    route = request.scope.get("route")
    return getattr(route, "path", "other")


def install(app: FastAPI, metrics: Metrics) -> None:
    def respond(request: Request, error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
        metrics.http(route_path(request), error.status)
        request.state.refusal = error.body()["error"]  # request_ids logs it, where the request is not running
        headers = {**(headers or {}), **({"Retry-After": "1"} if error.status == 503 else {})}
        return JSONResponse(error.body(), status_code=error.status, headers=headers or None)

    @app.exception_handler(RequestValidationError)
    async def validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        kind = request.headers.get("content-type", "").split(";")[0].strip()
        unread = any(tuple(e.get("loc", ())) == ("body",) for e in exc.errors())  # the body as a whole
        if request.method == "POST" and "json" not in kind and unread:  # FastAPI reads such a body as no JSON
            sent = f"this request's: {kind}" if kind else "this request sent none"
            message = (f"the request body is read as JSON only with the header Content-Type: application/json "
                       f"({sent}); {message}")
        return respond(request, APIError(400, message, param=param))

    @app.exception_handler(HTTPException)
    async def http(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return respond(request, APIError(exc.status_code, str(exc.detail), type=kind), exc.headers)  # 405: Allow

    @app.exception_handler(APIError)
    @app.exception_handler(EngineError)
    @app.exception_handler(RequestError)
    @app.exception_handler(ServerBusyError)
    @app.exception_handler(ServerClosedError)
    async def refused(request: Request, exc: Exception) -> JSONResponse:
        return respond(request, from_exception(exc))

    @app.exception_handler(Exception)  # Starlette logs the traceback too
    async def other(request: Request, exc: Exception) -> JSONResponse:
        return respond(request, from_exception(exc))
