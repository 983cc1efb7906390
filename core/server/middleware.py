"""ASGI middleware: the API key check and the count of HTTP answers by endpoint and status.

Plain ASGI rather than BaseHTTPMiddleware, so streaming responses and disconnect messages pass
through untouched.
"""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import ApiError
from .metrics import ServerMetrics

OPEN_PATHS = ("/health", "/health_generate", "/metrics")  # probes and scrapers carry no key


class ApiKeyAuth:
    """With a key set, every other path needs `Authorization: Bearer KEY` (401 otherwise)."""

    def __init__(self, app: ASGIApp, api_key: str | None):
        self.app = app
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.api_key is None or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key):
            reason = "missing API key" if not given else "invalid API key"
            await ApiError(401, f"{reason}: send the server's key as 'Authorization: Bearer KEY'").response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


class HttpMetrics:
    """Counts each answer in moeplex_http_requests_total{endpoint, status}; unknown paths count as 'other'."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, paths: tuple[str, ...]):
        self.app = app
        self.metrics = metrics
        self.paths = frozenset(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # if the app fails before answering

        async def send_counting(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        finally:
            endpoint = scope["path"] if scope["path"] in self.paths else "other"
            self.metrics.http_requests.labels(endpoint, str(status)).inc()
