"""Reading a request body: the one way every endpoint does it, so none can be made to hold more than the limit
or to wait on a client forever.

The declared Content-Length is checked before a byte is read, the streamed read stops at the limit (413),
and the whole body must arrive within the read timeout (408). A connection's headers have the same
deadline (`protocol_with_header_deadline`), before the app ever sees the request.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from .errors import ApiError, bad_request

CLIENT_CLOSED = 499  # nobody reads it; it shows in the access log and in the metrics


class BodyReader:
    def __init__(self, limit: int, timeout_s: float):
        self.limit = limit
        self.timeout_s = timeout_s

    async def read(self, http: HttpRequest) -> bytes:
        declared = http.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            raise ApiError(413, f"the request body has {declared} bytes; the limit is {self.limit}")
        body = bytearray()
        try:
            async with asyncio.timeout(self.timeout_s):
                async for piece in http.stream():
                    body += piece
                    if len(body) > self.limit:
                        raise ApiError(413, f"the request body is over the limit of {self.limit} bytes")
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.timeout_s:g} s (--read-timeout)") from None
        except ClientDisconnect:
            raise ApiError(CLIENT_CLOSED, "the client disconnected while sending the request") from None
        return bytes(body)

    async def json(self, http: HttpRequest, empty: Any = None) -> Any:
        """The body as JSON (`empty` for an empty body, if given); 400 if it is not JSON."""
        return parse_json(await self.read(http), empty)


def parse_json(body: bytes, empty: Any = None) -> Any:
    """`body` as JSON (`empty` for an empty body, if given), or a 400 saying why it is not."""
    if empty is not None and not body.strip():
        return empty
    try:
        return json.loads(body, parse_constant=_no_constants)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None


def _no_constants(name: str):
    raise ValueError(f"{name} is not valid JSON")


def protocol_with_header_deadline(timeout_s: float) -> type:
    """uvicorn's HTTP protocol, closing a connection that has not completed a request's headers within
    `timeout_s` of opening or of its last answer (uvicorn's keep-alive timer stops at the first byte)."""

    class HeaderDeadline(AutoHTTPProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_deadline()

        def _arm_header_deadline(self) -> None:
            self.loop.call_later(timeout_s, self._header_deadline, self.cycle)

        def _header_deadline(self, cycle_then) -> None:
            waiting = self.cycle is cycle_then and (self.cycle is None or self.cycle.response_complete)
            if waiting and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline
