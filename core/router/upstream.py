"""One exchange with one worker, up to its first byte, and the response that passes the rest through.

What counts as "before the first byte" is what the client has seen: a buffered answer is read whole
before anything is sent, a server-sent-events answer up to its first chunk. A failure until then can
be retried on another worker; after it, the client already holds part of the answer.
"""

from __future__ import annotations

import logging
from typing import AsyncIterator, Callable

import httpx
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)

# the worker cannot serve now (overloaded, draining, or a proxy in front of it says it is gone)
RETRYABLE_STATUS = frozenset({502, 503, 504})
# hop-by-hop headers, and those the router's own server writes
DROPPED_REQUEST_HEADERS = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade"})
DROPPED_RESPONSE_HEADERS = frozenset({"content-length", "connection", "keep-alive", "transfer-encoding", "date", "server"})


class WorkerClients:
    """One pooled HTTP client per worker URL, kept for the router's life.

    httpcore checks every idle connection of a pool (a poll and a few socket calls each) whenever it
    hands out or takes back a connection, so one pool per worker keeps that scan to one worker's share
    of the connections. A removed worker's client stays (requests in flight on it finish; its idle
    connections end with the worker's keep-alive timeout) and serves the worker again if it is re-added.
    """

    def __init__(self, limits: httpx.Limits, timeout: httpx.Timeout):
        self.limits = limits
        self.timeout = timeout
        self._clients: dict[str, httpx.AsyncClient] = {}

    def client_for(self, url: str) -> httpx.AsyncClient:
        client = self._clients.get(url)
        if client is None:
            client = self._clients[url] = httpx.AsyncClient(limits=self.limits, timeout=self.timeout)
        return client

    async def close_all(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.aclose()


class WorkerUnavailable(Exception):
    """The worker answered with a status that says another worker should try."""

    def __init__(self, url: str, status: int):
        super().__init__(f"{url} answered {status}")
        self.status = status


class Upstream:
    """An opened worker response: status, headers, and either the whole body or the first chunk of a stream."""

    def __init__(self, response: httpx.Response, body: bytes, chunks: AsyncIterator[bytes] | None):
        self.response = response
        self.body = body  # the whole body, or the first chunk of a stream
        self.chunks = chunks  # the rest of a stream; None when buffered

    def headers(self) -> dict[str, str]:
        return {k: v for k, v in self.response.headers.items() if k.lower() not in DROPPED_RESPONSE_HEADERS}

    def to_response(self, on_close: Callable[[bool], None]) -> Response:
        """The client's response; `on_close(failed)` runs once the worker is done with it."""
        if self.chunks is None:
            on_close(False)
            return Response(self.body, status_code=self.response.status_code, headers=self.headers())
        return PassThrough(self, on_close)


async def open_upstream(client: httpx.AsyncClient, url: str, method: str, headers: list, body: bytes) -> Upstream:
    """Send one request and read up to the client's first byte; raise on a failure before it."""
    request = client.build_request(method, url, headers=headers, content=body)
    response = await client.send(request, stream=True)
    try:
        if response.status_code in RETRYABLE_STATUS:
            raise WorkerUnavailable(url, response.status_code)
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            return Upstream(response, b"".join([chunk async for chunk in response.aiter_raw()]), None)
        chunks = response.aiter_raw()
        first = await anext(chunks, b"")
        return Upstream(response, first, chunks)
    except BaseException:
        await response.aclose()
        raise


def forwarded_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in raw if k.decode("latin-1").lower() not in DROPPED_REQUEST_HEADERS]


class PassThrough(StreamingResponse):
    """A worker's stream, chunk by chunk as it arrives; the upstream closes however the stream ends.

    Starlette cancels the stream when the client disconnects; closing the upstream then closes the
    connection to the worker, which aborts the generation there and frees its KV cache.
    """

    def __init__(self, upstream: Upstream, on_close: Callable[[bool], None]):
        super().__init__(self._chunks(upstream), status_code=upstream.response.status_code, headers=upstream.headers())
        self.upstream = upstream
        self.on_close = on_close

    @staticmethod
    async def _chunks(upstream: Upstream) -> AsyncIterator[bytes]:
        if upstream.body:
            yield upstream.body
        async for chunk in upstream.chunks:
            yield chunk

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        failed = False
        try:
            await super().__call__(scope, receive, send)
        except httpx.TransportError as exc:
            # the worker failed mid-stream: the response stays unterminated, so the client sees a broken
            # stream rather than a short one that looks complete
            failed = True
            log.warning("%s failed in the middle of a stream: %s", self.upstream.response.url, exc)
        finally:
            self.on_close(failed)
            await self.upstream.response.aclose()
