"""The next step's masks, filled in a worker thread as soon as a step's tokens are accepted: the engine then
schedules, builds and runs the next forward while the masks fill (a CPU engine fills on another core; a GPU engine
under the overlap schedule fills while the device computes anyway and asks for none).

A mask filled ahead is only good while no matcher has moved since: the book drops it before any matcher moves."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

from ..interfaces import GrammarMatcher
from .mask import StepMask

Fill = Callable[[Sequence[GrammarMatcher], "object", Sequence[int]], None]  # backend.fill_masks


class MasksAhead:
    def __init__(self):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask-ahead")
        self._job: Future | None = None
        self._rows: dict[str, int] = {}  # rid -> its row of the mask being filled

    def start(self, fill: Fill, rids: Sequence[str], matchers: Sequence[GrammarMatcher], words: int) -> None:
        """Fill one row per request, in this order, in the worker thread."""
        self.drop()
        if rids:
            self._rows = {rid: row for row, rid in enumerate(rids)}
            self._job = self._pool.submit(self._fill, fill, list(matchers), words)

    @staticmethod
    def _fill(fill: Fill, matchers: list[GrammarMatcher], words: int) -> StepMask:
        mask = StepMask.allowing_all(len(matchers), words)
        fill(matchers, mask.bitmask, range(len(matchers)))
        return mask

    @property
    def late(self) -> bool:
        """Whether a mask is still filling (taking it now waits)."""
        return self._job is not None and not self._job.done()

    def take(self, words: int) -> tuple[StepMask, dict[str, int]] | None:
        """The mask filled ahead and each request's row in it (waiting for it if it is still filling), or None."""
        job, rows = self._job, self._rows
        self._job, self._rows = None, {}
        if job is None:
            return None
        mask = job.result()
        return (mask, rows) if mask.words == words else None

    def drop(self) -> None:
        """Forget the mask being filled, once the worker is done with the matchers (they are about to move)."""
        if self._job is not None:
            self._job.exception()  # waits; a fill that raised is filled again on the step loop, raising there
            self._job, self._rows = None, {}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
