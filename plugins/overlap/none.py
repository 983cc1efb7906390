"""`none`: run every layer's operations in order on the whole batch."""

from __future__ import annotations

from moeplex.interfaces import BatchMeta, OverlapCaps, OverlapStrategy


class NoOverlap(OverlapStrategy):
    caps = OverlapCaps()

    def plan(self, meta: BatchMeta):
        return None
