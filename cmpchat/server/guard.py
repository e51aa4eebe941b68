"""What stands between the network and the handlers: the API key check and the request body limit."""

from __future__ import annotations

import hmac
import json
import re
from typing import Any, NoReturn

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from cmpchat.server.errors import ApiError
from cmpchat.tokenizer import without_surrogates

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
"""Where a JSON text can hold a UTF-16 surrogate: only in an escape (UTF-8 cannot encode one)."""

OPEN_PATHS = frozenset({"/health", "/v1/health"})
"""Routes that answer without the API key (load balancers and supervisors poll them)."""


class ApiKeyMiddleware:
    """Requires `Authorization: Bearer <key>`, or `X-Api-Key: <key>` as llama-server also takes it, on every HTTP
    route but the open ones (401 otherwise)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(Headers(scope=scope)):
            await self.app(scope, receive, send)
            return
        error = ApiError(
            401,
            "invalid or missing API key: send the header 'Authorization: Bearer <key>' or 'X-Api-Key: <key>'",
            code="invalid_api_key",
        )
        await error.response(scope["path"])(scope, receive, send)

    def _authorized(self, headers: Headers) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._key):
            return True
        key = headers.get("x-api-key")
        return key is not None and hmac.compare_digest(key.strip().encode(), self._key)


async def read_json(request: Request, limit: int) -> Any:
    """The request body decoded as JSON, every string in it Unicode (lone surrogates as U+FFFD, so that none reaches
    a template, a response or a log); 413 past `limit` bytes, 400 when it is not JSON."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        _too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            _too_large(limit)
    if not body.strip():
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        value = json.loads(body, parse_constant=_reject_constant)
        return _unicode(value) if _SURROGATE_ESCAPE.search(body) else value
    except (ValueError, RecursionError) as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}") from None


def _unicode(value: Any) -> Any:
    if isinstance(value, str):
        return without_surrogates(value)
    if isinstance(value, list):
        return [_unicode(item) for item in value]
    if isinstance(value, dict):
        return {_unicode(key): _unicode(item) for key, item in value.items()}
    return value


def _too_large(limit: int) -> NoReturn:
    raise ApiError(
        413, f"the request body is larger than the server's limit of {limit} bytes", code="request_too_large"
    )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")
