"""Errors as OpenAI-style objects, `{"error": {"message", "type", "param", "code"}}`, never a traceback; on the
Anthropic Messages routes in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`."""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("cmpchat.server")

_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "unavailable_error",
}

ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
"""Routes whose errors take Anthropic's shape, as the anthropic client reads them."""

_ANTHROPIC_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    500: "api_error",
    503: "overloaded_error",
}


class ApiError(Exception):
    """A request that cannot be served, with the HTTP status and the error object's fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, object]:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self, path: str = "") -> JSONResponse:
        """The error as the client of the API at `path` reads it."""
        headers: dict[str, str] = {}
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        elif self.status == 503:
            headers["Retry-After"] = "1"  # busy or loading: worth retrying soon, as clients do on their own
        body = anthropic_error_body(self.status, self.message) if path in ANTHROPIC_PATHS else self.body()
        return JSONResponse(body, status_code=self.status, headers=headers)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, object]:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def anthropic_error_body(status: int, message: str) -> dict[str, object]:
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


async def handle_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response(request.url.path)


async def handle_http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (unknown route, wrong method) in the same shape."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no route for {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return ApiError(exc.status_code, message).response(request.url.path)


async def handle_user_error(request: Request, exc: Exception) -> Response:
    """A `CmpchatError` that escaped request preparation: by its contract, something the client can fix."""
    return ApiError(400, str(exc)).response(request.url.path)


async def handle_unexpected(request: Request, exc: Exception) -> Response:
    """An exception that escaped `UnexpectedErrorMiddleware` (one raised by a layer outside it)."""
    # Starlette re-raises the exception after this response, which logs it and makes uvicorn close the
    # connection: say so, or the client's next request on it is reset.
    response = _unexpected(exc).response(request.url.path)
    response.headers["Connection"] = "close"
    return response


class UnexpectedErrorMiddleware:
    """Answers an exception that no handler took with a JSON 500 and logs its traceback.

    Starlette's own last-resort handler re-raises the exception after its response, and uvicorn then drops the
    kept-alive connection without a `Connection: close`; answering here keeps the connection usable.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_watched)
        except Exception as exc:
            if started:
                raise  # part of a response is out: the connection can only be cut
            log.exception("unexpected error serving %s %s", scope["method"], scope["path"])
            await _unexpected(exc).response(scope["path"])(scope, receive, send)


def _unexpected(exc: Exception) -> ApiError:
    return ApiError(500, f"internal server error ({type(exc).__name__}); the server log has the details")
