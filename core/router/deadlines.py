"""Deadlines checked by one periodic task, in place of a timer per request.

asyncio.timeout arms and disarms an event-loop timer; on the router's hot path (a body read and a
worker's answer per request) those timers were a tenth of the router's CPU. A deadline here is an
entry in a dict, checked every `tick` seconds, so it fires up to one tick late.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Callable

log = logging.getLogger(__name__)


class Deadlines:
    def __init__(self, tick: float = 0.05):
        self.tick = tick
        self.now = 0.0  # the loop's time at the last tick (or start)
        self._entries: dict[int, tuple[float, Callable[[], None]]] = {}
        self._ids = itertools.count()
        self._task: asyncio.Task | None = None

    def add(self, seconds: float, expire: Callable[[], None]) -> int:
        """Call `expire` once, about `seconds` from now, unless `remove`d first; the entry's id."""
        if self._task is None or self._task.done():
            loop = asyncio.get_running_loop()
            self.now = loop.time()
            self._task = loop.create_task(self._run())
        key = next(self._ids)
        self._entries[key] = (self.now + seconds, expire)
        return key

    def renew(self, key: int, seconds: float) -> None:
        """Move entry `key` to `seconds` from now (progress was made)."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries[key] = (self.now + seconds, entry[1])

    def remove(self, key: int) -> None:
        self._entries.pop(key, None)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.tick)
            self.now = now = loop.time()
            expired = [key for key, (when, _) in self._entries.items() if when <= now]
            for key in expired:
                _, expire = self._entries.pop(key)
                try:
                    expire()
                except Exception:
                    log.exception("a deadline's callback failed")

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
