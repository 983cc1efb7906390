"""`tbo`: two-batch overlap — one micro-batch computes while the other's dispatch or combine is in flight."""

from __future__ import annotations

from typing import Iterator, Sequence

from moeplex.interfaces import BatchMeta, ForwardMode, OverlapCaps, OverlapStrategy

BALANCE_TOLERANCE = 0.1  # a request boundary within 10% of the middle is good enough to cut at


def two_batch_cut(meta: BatchMeta, tolerance: float = BALANCE_TOLERANCE) -> int | None:
    """The token offset splitting a batch into two micro-batches, or None when it cannot be split.

    Decode: the first half of the requests (one token each). Extend: the request boundary
    nearest the middle when it leaves each side within `tolerance` of half the tokens;
    otherwise the exact middle, cutting one sequence in two (its second part then reads
    the first part's KV, which the first micro-batch writes earlier in every layer).
    """
    total = meta.num_tokens
    if meta.mode == ForwardMode.IDLE or total < 2:
        return None
    if meta.mode == ForwardMode.DECODE:
        return None if len(meta.extend_lens) < 2 else sum(meta.extend_lens[: len(meta.extend_lens) // 2])
    boundaries, running = [], 0
    for n in meta.extend_lens[:-1]:
        running += n
        boundaries.append(running)
    best = min(boundaries, key=lambda b: (abs(2 * b - total), b), default=None)
    if best is not None and 0 < best < total and abs(2 * best - total) <= 2 * tolerance * total:
        return best
    return total // 2


LEAD = 2  # segments the first micro-batch runs ahead: its attention, then its dispatch launch
_DONE = object()


class TwoBatchOverlap(OverlapStrategy):
    """Micro-batch A runs two segments (yield point to yield point) ahead, then A and B take turns.

    A MoE layer's segments are: attention | gate + dispatch launch | (shared experts +) dispatch
    finish | experts | combine launch | combine finish. With A two ahead, each transfer one micro-batch
    launches is in flight while the other computes (B's attention behind A's dispatch, A's experts
    behind B's dispatch, B's experts behind A's combine, A's next attention behind B's combine), and
    no transfer starts before the other micro-batch's last one finished: one transfer in flight at a
    time, which DeepEP's low-latency buffers require.
    """

    caps = OverlapCaps(needs_async_halves=True, min_tokens=2, shared_during_dispatch=True, transfers_in_flight=1)

    def plan(self, meta: BatchMeta) -> Sequence[int] | None:
        cut = two_batch_cut(meta)
        return None if cut is None else [cut]

    def run(self, programs: Sequence[Iterator]) -> None:
        if len(programs) != 2:
            return super().run(programs)
        lead, trail = programs
        for _ in range(LEAD):
            if next(lead, _DONE) is _DONE:
                break
        active = [trail, lead]
        while active:
            for program in list(active):
                if next(program, _DONE) is _DONE:
                    active.remove(program)
