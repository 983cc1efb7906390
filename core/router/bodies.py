"""Request bodies under a cap: refused by their declared length before a byte is read, or as the stream passes it."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.types import Receive, Scope

from .deadlines import Deadlines

MANAGEMENT_BODY_BYTES = 64 << 10  # {"url": ...} is tens of bytes; nothing a management call sends needs more


class BodyRefused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


async def read_body(http: Request, limit: int, timeout: float) -> bytes:
    """The whole body, read a piece at a time; BodyRefused with 413 once it (or its Content-Length) passes
    `limit`, with 408 when it has not all arrived within `timeout` seconds (a client holding the connection).

    Nothing past the limit is buffered: a 200 MB body costs the router at most `limit` bytes and one piece.
    """
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyRefused(413, f"the request body is over the router's limit of {limit} bytes")
    body = bytearray()
    try:
        async with asyncio.timeout(timeout):
            async for piece in http.stream():
                body += piece
                if len(body) > limit:
                    raise BodyRefused(413, f"the request body is over the router's limit of {limit} bytes")
    except TimeoutError:
        raise BodyRefused(408, f"the request body did not arrive within {timeout:g} s") from None
    return bytes(body)


class ClientLeft(Exception):
    """The client disconnected before its body arrived."""


async def read_asgi_body(scope: Scope, receive: Receive, limit: int, timeout: float, deadlines: Deadlines) -> bytes:
    """read_body for a raw ASGI request (the router's hot path): the same caps, no Request object, and
    the timeout kept by `deadlines` (no timer per request); ClientLeft when the client disconnects first."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            if value.isdigit() and int(value) > limit:
                raise BodyRefused(413, f"the request body is over the router's limit of {limit} bytes")
            break
    task = asyncio.current_task()
    late = []

    def expire() -> None:
        late.append(True)
        task.cancel()

    key = deadlines.add(timeout, expire)
    body = bytearray()
    try:
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise ClientLeft()
            piece = message.get("body", b"")
            if not body and not message.get("more_body", False) and len(piece) <= limit:
                return piece  # the usual case: the whole body in one message, no copy
            body += piece
            if len(body) > limit:
                raise BodyRefused(413, f"the request body is over the router's limit of {limit} bytes")
            if not message.get("more_body", False):
                return bytes(body)
    except asyncio.CancelledError:
        if late and task.uncancel() == 0:
            raise BodyRefused(408, f"the request body did not arrive within {timeout:g} s") from None
        raise
    finally:
        deadlines.remove(key)
