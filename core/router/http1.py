"""The router's client to its workers: HTTP/1.1 over pooled keep-alive connections, parsed by httptools.

The forward is the router's hot path, and aiohttp's client spent more CPU per exchange than the rest
of the router together (request and response objects, payload wrappers, cookie and trace hooks). This
client does only what a forward needs: one write of head and body, the response's status, headers and
body (or its chunks as they arrive, for a stream), a read timeout between pieces, and the connection
back to its worker's pool when the answer was read to the end. Answers are framed by Content-Length
or chunked encoding, as every uvicorn-served worker sends them; one that ends only with the connection
counts as cut. A stream's pieces are buffered as they arrive (no backpressure towards the worker).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from typing import AsyncIterator
from urllib.parse import urlsplit

import httptools

from .deadlines import Deadlines


class UpstreamError(Exception):
    """The worker could not be reached, or broke the connection before its answer ended."""


class _Connection(asyncio.Protocol):
    """One TCP connection to a worker; one exchange at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.lost = False
        self.response: Response | None = None

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.lost = True
        if self.response is not None:
            self.response._failed(UpstreamError(f"the worker closed the connection ({exc or 'end of stream'})"))

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.response is not None:
                self.response._failed(UpstreamError(f"the worker's answer is not HTTP/1.1: {exc}"))
            self.transport.close()

    def eof_received(self):
        return False  # close; an answer not yet complete fails in connection_lost

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.response.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        response = self.response
        response.status = self.parser.get_status_code()
        response.keep_alive = self.parser.should_keep_alive()
        response._progress()
        if not response.head.done():
            response.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.response._piece(body)

    def on_message_complete(self) -> None:
        self.response._complete()


class Response:
    """A worker's answer: status and headers once `head` is done, then its body."""

    def __init__(self, pool: Pool, key: tuple, connection: _Connection, url: str, read_timeout: float):
        self.pool, self.key, self.connection, self.url = pool, key, connection, url
        self.read_timeout = read_timeout
        self.head: asyncio.Future = asyncio.get_running_loop().create_future()
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = False
        self.pieces: collections.deque[bytes] = collections.deque()
        self.complete = False
        self.error: Exception | None = None
        self.waiter: asyncio.Future | None = None
        self.closed = False
        self.deadline = pool.deadlines.add(read_timeout, self._silent)  # renewed by every piece that arrives

    def header(self, name: bytes) -> bytes:
        """The first value of header `name` (lower case), or b""."""
        for key, value in self.raw_headers:
            if key.lower() == name:
                return value
        return b""

    # fed by the connection
    def _piece(self, body: bytes) -> None:
        self.pieces.append(body)
        self._progress()
        self._wake()

    def _complete(self) -> None:
        self.complete = True
        self.pool.deadlines.remove(self.deadline)
        self._wake()

    def _progress(self) -> None:
        self.pool.deadlines.renew(self.deadline, self.read_timeout)

    def _silent(self) -> None:
        """The read timeout passed with nothing from the worker."""
        self._failed(asyncio.TimeoutError(f"{self.url} sent nothing for {self.read_timeout:g} s"))
        self.connection.transport.close()

    def _failed(self, error: Exception) -> None:
        if self.complete:
            return
        self.error = error
        self.pool.deadlines.remove(self.deadline)
        if not self.head.done():
            self.head.set_exception(error)
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def _wait(self) -> None:
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    # read by the router
    async def read(self) -> bytes:
        """The whole body; then the connection goes back to the pool."""
        while not self.complete:
            if self.error is not None:
                raise self.error
            await self._wait()
        body = b"".join(self.pieces)
        self.pieces.clear()
        self.release()
        return body

    async def iter_any(self) -> AsyncIterator[bytes]:
        """The body's pieces as they arrive."""
        while True:
            if self.pieces:
                yield self.pieces.popleft()
            elif self.complete:
                return
            elif self.error is not None:
                raise self.error
            else:
                await self._wait()

    def at_eof(self) -> bool:
        return self.complete and not self.pieces

    def release(self) -> None:
        """Back to the pool if the answer was read to its end on a kept-alive connection; closed otherwise."""
        if self.closed:
            return
        self.closed = True
        self.pool._slots.release()
        self.pool.deadlines.remove(self.deadline)
        connection = self.connection
        connection.response = None
        if self.at_eof() and self.keep_alive and not connection.lost and not connection.transport.is_closing():
            self.pool._idle[self.key].append(connection)
        else:
            connection.transport.close()

    def close(self, give_back: bool = True) -> None:
        """Drop the connection (the worker sees it close: a stream it was sending is aborted)."""
        if not self.closed:
            self.closed = True
            if give_back:
                self.pool._slots.release()
            self.pool.deadlines.remove(self.deadline)
            self.connection.response = None
            self.connection.transport.close()


class Pool:
    """Keep-alive connections per worker (host, port), opened on demand, at most `limit` in all."""

    def __init__(self, limit: int, read_timeout: float, connect_timeout: float, deadlines: Deadlines):
        self.deadlines = deadlines
        self.read_timeout = read_timeout
        self.connect_timeout = connect_timeout
        self._slots = asyncio.Semaphore(limit)
        self._idle: dict[tuple, list[_Connection]] = collections.defaultdict(list)
        self._keys: dict[str, tuple] = {}  # worker URL -> (host, port, Host header, https?)
        self._tls_context: ssl.SSLContext | None = None

    async def __aenter__(self) -> Pool:
        return self

    async def __aexit__(self, *exc) -> None:
        for connections in self._idle.values():
            for connection in connections:
                connection.transport.close()
        self._idle.clear()

    def _tls(self) -> ssl.SSLContext:
        if self._tls_context is None:
            self._tls_context = ssl.create_default_context()
        return self._tls_context

    def _key(self, base: str) -> tuple:
        key = self._keys.get(base)
        if key is None:
            parts = urlsplit(base)
            secure = parts.scheme == "https"
            key = self._keys[base] = (parts.hostname or "127.0.0.1", parts.port or (443 if secure else 80),
                                      parts.netloc.encode("latin-1"), secure)
        return key

    async def _connect(self, key: tuple) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, connection = await loop.create_connection(_Connection, key[0], key[1], ssl=self._tls() if key[3] else None)
        except OSError as exc:
            raise UpstreamError(f"cannot connect to {key[0]}:{key[1]}: {exc}") from None
        return connection

    async def request(self, base: str, method: str, target: str, headers: list[tuple[str, str]], body: bytes) -> Response:
        """Send one request to the worker at `base` (http://host:port) and wait for its status and headers."""
        key = self._key(base)
        head = [f"{method} {target} HTTP/1.1\r\nHost: ".encode("latin-1"), key[2],
                f"\r\nContent-Length: {len(body)}\r\n".encode()]
        for name, value in headers:
            head.append(f"{name}: {value}\r\n".encode("latin-1"))
        head.append(b"\r\n")
        message = b"".join(head) + body
        await self._slots.acquire()  # given back when the response is released or closed
        try:
            idle = self._idle[key]
            while idle:
                connection = idle.pop()
                if connection.lost or connection.transport.is_closing():
                    continue
                try:
                    return await self._exchange(connection, key, base, message)
                except UpstreamError:
                    break  # the worker closed a kept-alive connection as the request went out: once more, on a fresh one
            return await self._exchange(await self._connect(key), key, base, message)
        except BaseException:
            self._slots.release()
            raise

    async def _exchange(self, connection: _Connection, key: tuple, base: str, message: bytes) -> Response:
        response = Response(self, key, connection, base, self.read_timeout)
        connection.response = response
        connection.transport.write(message)
        try:
            await response.head
        except BaseException:
            response.close(give_back=False)
            raise
        return response
