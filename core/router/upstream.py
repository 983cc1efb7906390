"""One exchange with one worker, up to its first byte, and the response that passes the rest through.

What counts as "before the first byte" is what the client has seen: a buffered answer is read whole
before anything is sent, a server-sent-events answer up to its first chunk. A failure until then can
be retried on another worker; after it, the client already holds part of the answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator, Callable

import aiohttp
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from .deadlines import Deadlines
from .http1 import Pool, Response as WorkerResponse, UpstreamError

log = logging.getLogger(__name__)

# the worker cannot serve now (overloaded, draining, or a proxy in front of it says it is gone)
RETRYABLE_STATUS = frozenset({502, 503, 504})
# the only client headers a worker sees: what the body is and what answer the client takes, and tracing ids.
# An allow-list, not a deny-list: credentials of any spelling (Authorization, X-Api-Key, Cookie, ...) are the
# router's business and never reach a worker; the router sends its own --worker-api-key instead.
FORWARDED_REQUEST_HEADERS = frozenset({"content-type", "content-encoding", "accept", "accept-encoding", "user-agent",
                                       "x-request-id", "traceparent", "tracestate"})
DROPPED_RESPONSE_HEADERS = frozenset({"content-length", "connection", "keep-alive", "transfer-encoding", "date", "server"})
DROPPED_RAW_RESPONSE_HEADERS = frozenset(name.encode() for name in DROPPED_RESPONSE_HEADERS)
# a worker that cannot be reached, breaks the connection or goes silent past the read timeout
TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, UpstreamError)


def worker_session(max_connections: int, read_timeout: float, connect_timeout: float, deadlines: Deadlines) -> Pool:
    """The pooled client every forward goes through (keep-alive connections per worker; bodies passed
    through as they are, compressed or not): http1.Pool, a fraction of aiohttp's CPU per exchange
    (benchmarks/results/router_vs_sglang.md)."""
    return Pool(max_connections, read_timeout, connect_timeout, deadlines)


# a decode server's answer names the server whose failure it passes on (its prefill server): core/server/errors.py
FAILED_SERVER = b"x-moeplex-failed-server"


class WorkerUnavailable(Exception):
    """The worker answered with a status that says another worker should try. `failed_server`: the role of the
    server the worker says failed ('prefill'), when it is not the worker itself."""

    def __init__(self, url: str, status: int, failed_server: str = ""):
        super().__init__(f"{url} answered {status}" + (f" ({failed_server} server failed)" if failed_server else ""))
        self.status = status
        self.failed_server = failed_server


class Upstream:
    """An opened worker response: status, headers, and either the whole body or the first chunk of a stream."""

    def __init__(self, response: WorkerResponse, body: bytes, chunks: AsyncIterator[bytes] | None):
        self.response = response
        self.body = body  # the whole body, or the first chunk of a stream
        self.chunks = chunks  # the rest of a stream; None when buffered

    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        """The worker's response headers as ASGI sends them, less those the router's server writes."""
        kept = []
        for name, value in self.response.raw_headers:
            name = name.lower()
            if name not in DROPPED_RAW_RESPONSE_HEADERS:
                kept.append((name, value))
        return kept

    def to_response(self, on_close: Callable[[bool], None]) -> Response:
        """The client's response; `on_close(failed)` runs once the worker is done with it."""
        if self.chunks is None:
            on_close(False)
            return Buffered(self.response.status, self.raw_headers(), self.body)
        return PassThrough(self, on_close)


class Buffered(Response):
    """A whole answer, sent as two ASGI messages with no header rebuilding (the router's hot path)."""

    def __init__(self, status: int, raw_headers: list[tuple[bytes, bytes]], body: bytes):
        self.status_code = status
        self.body = body
        self.background = None
        self.raw_headers = [(b"content-length", b"%d" % len(body)), *raw_headers]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.body})


async def open_upstream(pool: Pool, base: str, path: str, method: str, headers: list, body: bytes) -> Upstream:
    """Send one request to the worker at `base` and read up to the client's first byte; raise on a failure before it."""
    response = await pool.request(base, method, path, headers, body)
    try:
        if response.status in RETRYABLE_STATUS:
            raise WorkerUnavailable(base + path, response.status, response.header(FAILED_SERVER).decode("latin-1"))
        if not response.header(b"content-type").startswith(b"text/event-stream"):
            return Upstream(response, await response.read(), None)
        chunks = response.iter_any()
        first = await anext(chunks, b"")
        return Upstream(response, first, chunks)
    except BaseException:
        response.close()
        raise


def forwarded_headers(raw: list[tuple[bytes, bytes]], worker_api_key: str | None = None) -> list[tuple[str, str]]:
    """The client's headers a worker sees (those of FORWARDED_REQUEST_HEADERS), and the router's worker key."""
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw]
    kept = [(k, v) for k, v in headers if k.lower() in FORWARDED_REQUEST_HEADERS]
    return kept + [("Authorization", f"Bearer {worker_api_key}")] if worker_api_key else kept


DONE = b"data: [DONE]"


def error_event(message: str) -> bytes:
    """The failure as the workers' own streams carry one (core/server/sse.py): an error event, then [DONE]."""
    error = {"message": message, "type": "internal_server_error", "param": None, "code": None}
    return b"data: " + json.dumps({"error": error}, separators=(",", ":")).encode() + b"\n\n" + DONE + b"\n\n"


class PassThrough(StreamingResponse):
    """A worker's stream, chunk by chunk as it arrives; the upstream closes however the stream ends.

    A stream the worker cuts (it dies, goes silent past the read timeout, or closes without `[DONE]`)
    ends with an error event, so the client never takes a cut answer for a short complete one.
    Starlette cancels the stream when the client disconnects; closing the upstream then closes the
    connection to the worker, which aborts the generation there and frees its KV cache.
    """

    def __init__(self, upstream: Upstream, on_close: Callable[[bool], None]):
        super().__init__(self._chunks(upstream), status_code=upstream.response.status)
        self.raw_headers += upstream.raw_headers()
        self.upstream = upstream
        self.on_close = on_close
        self.failed = False

    async def _chunks(self, upstream: Upstream) -> AsyncIterator[bytes]:
        tail = upstream.body[-64:]
        if upstream.body:
            yield upstream.body
        try:
            async for chunk in upstream.chunks:
                yield chunk
                tail = (tail + chunk)[-64:]
        except TRANSPORT_ERRORS as exc:
            self.failed = True
            log.warning("%s failed in the middle of a stream: %r", upstream.response.url, exc)
            yield error_event(f"the worker failed in the middle of the stream ({type(exc).__name__}); "
                              "the answer is incomplete")
            return
        if not tail.rstrip().endswith(DONE):
            self.failed = True
            log.warning("%s ended a stream without [DONE]", upstream.response.url)
            yield error_event("the worker ended the stream before finishing it; the answer is incomplete")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = self.upstream.response
        try:
            await super().__call__(scope, receive, send)
        finally:
            failed = self.failed
            self.on_close(failed)
            if response.at_eof() and not failed:
                response.release()  # the connection goes back to the pool
            else:
                response.close()  # a stream cut short: the worker sees the connection close and aborts
