"""Request bodies under a cap: refused by their declared length before a byte is read, or as the stream passes it."""

from __future__ import annotations

from starlette.requests import Request

MANAGEMENT_BODY_BYTES = 64 << 10  # {"url": ...} is tens of bytes; nothing a management call sends needs more


class BodyTooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"the request body is over the router's limit of {limit} bytes")
        self.limit = limit


async def read_body(http: Request, limit: int) -> bytes:
    """The whole body, read a piece at a time; BodyTooLarge once it (or its Content-Length) passes `limit`.

    Nothing past the limit is buffered: a 200 MB body costs the router at most `limit` bytes and one piece.
    """
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    body = bytearray()
    async for piece in http.stream():
        body += piece
        if len(body) > limit:
            raise BodyTooLarge(limit)
    return bytes(body)
