"""A step's tokens fed to their matchers, and the next step's masks filled, in a worker thread: started as soon as
the tokens are read, while the engine schedules, builds and runs the next forward (a CPU engine works on another
core; xgrammar drops the GIL while it fills). The outcome the step loop needs at once (go on, rejected, complete)
is read off the mask each token was drawn under, where the backend declares that its matchers accept every token
their mask allows and end exactly on an end token (GrammarBackendCaps.ends_at_end_token).

What is filled ahead is only good while no matcher moves otherwise: the book drops it before moving one."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

from .mask import StepMask

REJECTED = "rejected"  # the matcher refused the sampled token
TERMINATED = "terminated"  # the output is complete
OUTCOMES = (None, REJECTED, TERMINATED)  # as the leader of a DP group sends them: their index

Work = Callable[[], tuple[StepMask, list[str]]]  # -> the next mask (a row per request, in order), rids refused


def foreseen(mask: StepMask, rows: dict[str, int], pairs: Sequence[tuple[str, int]], end_ids) -> list[str | None] | None:
    """Each (rid, token)'s outcome, read off row rows[rid] of the mask it was drawn under; None where a request
    has no row there (then the matchers must tell)."""
    outcomes, words = [], mask.bitmask.numpy()  # numpy reads one word in a tenth of torch's time
    for rid, token in pairs:
        row = rows.get(rid)
        if row is None:
            return None
        allowed = (int(words[row, token >> 5]) >> (token & 31)) & 1
        outcomes.append(REJECTED if not allowed else TERMINATED if token in end_ids else None)
    return outcomes


class MasksAhead:
    def __init__(self):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask-ahead")
        self._job: Future | None = None
        self._rows: dict[str, int] = {}  # rid -> its row of the mask being filled

    @property
    def late(self) -> bool:
        """Whether the work is still running (taking its mask now waits)."""
        return self._job is not None and not self._job.done()

    def start(self, work: Work, rids: Sequence[str]) -> None:
        """Run `work` in the worker thread; its mask has one row per rid of `rids`, in order. Drop (or take) the
        work before first."""
        assert self._job is None, "the work ahead was neither taken nor dropped"
        self._rows = {rid: row for row, rid in enumerate(rids)}
        self._job = self._pool.submit(work)

    def take(self, words: int) -> tuple[StepMask | None, dict[str, int], list[str]]:
        """(the mask filled ahead, each request's row in it, the requests whose token was refused), waiting for it
        if the work still runs; no mask where there was none (or one of another width)."""
        job, rows = self._job, self._rows
        self._job, self._rows = None, {}
        if job is None:
            return None, {}, []
        mask, refused = job.result()
        return (mask if mask.words == words else None), rows, refused

    def drop(self) -> list[str]:
        """Wait for the work (the matchers are about to move) and forget its mask; the requests whose token was
        refused."""
        return self.take(-1)[2]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
