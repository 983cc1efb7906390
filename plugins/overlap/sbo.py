"""`sbo`: single-batch overlap — shared experts run while the routed tokens' dispatch is in flight."""

from __future__ import annotations

from moeplex.interfaces import BatchMeta, OverlapCaps, OverlapStrategy


class SingleBatchOverlap(OverlapStrategy):
    caps = OverlapCaps(needs_async_halves=True, shared_during_dispatch=True)

    def plan(self, meta: BatchMeta):
        return None
