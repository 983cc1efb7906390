"""Server-sent events: `data: {json}` per chunk, an error event if the engine fails, then `data: [DONE]`."""

from __future__ import annotations

import json
import logging
from typing import AsyncIterator, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from .errors import ApiError

DONE = b"data: [DONE]\n\n"
log = logging.getLogger("moeplex.server")

HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# one encoder for every event: json.dumps with separators builds a new JSONEncoder per call (a step sends one
# event per running request). ASCII only: U+2028, U+0085 and kin stay escaped, so no client's line splitting
# can cut an event.
ENCODER = json.JSONEncoder(separators=(",", ":"))


def event(chunk: dict) -> bytes:
    return b"data: " + ENCODER.encode(chunk).encode() + b"\n\n"


async def events(chunks: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield event(chunk)
    except ApiError as exc:  # headers are gone already: the failure travels as an event (as vLLM does)
        yield event(exc.body())
    except Exception as exc:  # never a cut that reads like a short complete answer
        log.exception("a stream failed")
        yield event(ApiError(500, f"internal error: {type(exc).__name__}: {exc}").body())
    yield DONE


class EventStream(StreamingResponse):
    """An SSE response that calls `on_close` however it ends: finished, failed, or the client gone.

    Starlette cancels the stream when the client disconnects; `on_close` then aborts the requests
    that were still generating, which frees their KV pages.
    """

    def __init__(self, chunks: AsyncIterator[dict], on_close: Callable[[], None], headers: dict | None = None):
        super().__init__(events(chunks), media_type="text/event-stream", headers={**HEADERS, **(headers or {})})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
