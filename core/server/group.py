"""The engine requests of one HTTP call (each prompt times n choices), read back through one queue."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import AsyncIterator, Sequence

from starlette.requests import Request as HttpRequest

from ..sampling import SamplingParams
from .engine_loop import EngineLoop
from .errors import ApiError
from .outputs import Completion, Output, Ticket


class RequestGroup:
    def __init__(self, loop: EngineLoop):
        if not loop.alive:
            raise ApiError(503, "the engine is not running")
        self.loop = loop
        self.id = uuid.uuid4().hex
        self.queue: asyncio.Queue[Output] = asyncio.Queue()
        self.submitted_at = time.monotonic()
        self.size = 0
        self.unfinished: dict[int, str] = {}  # index -> engine request id

    def add(self, prompt_ids: Sequence[int], params: SamplingParams, bootstrap=None, stream_interval: int | None = None) -> None:
        index, rid = self.size, f"{self.id}-{self.size}"
        self.loop.submit(Ticket(rid, index, list(prompt_ids), params, self.queue, self.submitted_at, bootstrap,
                                stream_interval))
        self.unfinished[index] = rid
        self.size += 1

    async def outputs(self) -> AsyncIterator[Output]:
        """Every Output of every request until all have finished, each request's in order; a failure raises ApiError.
        Outputs of one request that queued up meanwhile come as one (a busy event loop sends fewer, larger events)."""
        ready: list[Output] = []
        while self.unfinished:
            if not ready:
                ready = [await self.queue.get()]
                while not self.queue.empty():
                    ready.append(self.queue.get_nowait())
                ready = _joined(ready)
            output = ready.pop(0)
            if output.finished:
                self.unfinished.pop(output.index, None)
            if output.error:
                raise ApiError(output.status, output.error, code=output.code)
            yield output

    async def collect(self) -> list[Completion]:
        completions = [Completion(i) for i in range(self.size)]
        async for output in self.outputs():
            completions[output.index].add(output)
        return completions

    def abort(self) -> None:
        """Abort what has not finished (the client went away); a no-op once everything has."""
        for rid in self.unfinished.values():
            self.loop.abort(rid)
        self.unfinished.clear()

    async def collect_while_connected(self, http: HttpRequest) -> list[Completion] | None:
        """collect(), unless the client disconnects first: then abort and return None."""
        collecting = asyncio.ensure_future(self.collect())
        watching = asyncio.ensure_future(_disconnected(http))
        done: set = set()
        try:
            done, _ = await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watching.cancel()
            if collecting not in done:
                collecting.cancel()
            self.abort()  # the rest of the group, when one request failed or the client left
        return collecting.result() if collecting in done else None


def _joined(outputs: list[Output]) -> list[Output]:
    """Each request's unfinished output joined with the ones after it (a failure stays apart: what came before it
    is still sent), in order of each request's first output."""
    joined: list[Output] = []
    last: dict[int, int] = {}  # request index -> its position in `joined`
    for output in outputs:
        at = last.get(output.index)
        if at is not None and not joined[at].finished and not output.error:
            joined[at] = joined[at].then(output)
        else:
            last[output.index] = len(joined)
            joined.append(output)
    return joined


async def _disconnected(http: HttpRequest) -> None:
    # the body has been read, so the next ASGI message can only be the disconnect
    while (await http.receive())["type"] != "http.disconnect":
        pass
