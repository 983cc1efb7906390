"""Drafters with the bugs the drafter suite exists to catch, registered through a real dist-info folder.

Each is a prompt-lookup drafter (moeplex's ngram) with one realistic mistake. On a random model's output
such drafters often propose nothing, which is how the suite used to pass them.
"""

from __future__ import annotations

from typing import Sequence

from moeplex.interfaces import DraftRequest, Drafts
from moeplex.plugins.drafters.ngram import NgramDrafter


class OffsetIds(NgramDrafter):
    """Returns ids shifted by a tokenizer offset the target does not have: outside its vocabulary."""

    def propose(self, requests: Sequence[DraftRequest]) -> Drafts:
        return Drafts([[t + 512 for t in tokens] for tokens in super().propose(requests).tokens])


class MisreadsNumCached(NgramDrafter):
    """Drafts only "when more than one token is uncached", which never happens: it proposes nothing."""

    def propose(self, requests: Sequence[DraftRequest]) -> Drafts:
        drafts = super().propose(requests).tokens
        return Drafts([d if len(r.token_ids) > r.num_cached + 1 else [] for d, r in zip(drafts, requests)])


class KeepsHistoryPastFinished(NgramDrafter):
    """Keeps each request's ids by rid, adding only what is new, and ignores finished(): a reused rid drafts
    from the previous request's history."""

    def __init__(self, num_steps: int):
        super().__init__(num_steps)
        self.history: dict[str, list[int]] = {}

    def propose(self, requests: Sequence[DraftRequest]) -> Drafts:
        views = []
        for r in requests:
            seen = self.history.setdefault(r.rid, [])
            seen += list(r.token_ids[len(seen):])
            views.append(DraftRequest(r.rid, list(seen), r.num_cached, r.pages))
        return super().propose(views)


class AnswersInRidOrder(NgramDrafter):
    """Answers in the order of the requests' ids, not in the order asked."""

    def propose(self, requests: Sequence[DraftRequest]) -> Drafts:
        return super().propose(sorted(requests, key=lambda r: r.rid))


ENTRY_POINTS = {"moeplex.drafters": {
    "broken-offset-ids": "broken_drafters:OffsetIds",
    "broken-misreads-num-cached": "broken_drafters:MisreadsNumCached",
    "broken-keeps-history": "broken_drafters:KeepsHistoryPastFinished",
    "broken-rid-order": "broken_drafters:AnswersInRidOrder",
}}


def write_distribution(folder) -> None:
    info = folder / "broken_drafters-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-drafters\nVersion: 0.1\n")
    lines = [f"[{group}]" for group in ENTRY_POINTS]
    lines += [f"{name} = {target}" for entries in ENTRY_POINTS.values() for name, target in entries.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
