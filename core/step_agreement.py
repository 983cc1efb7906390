"""The per-step agreement of DP attention: one small collective, the same decisions on every rank.

Each rank contributes four integers (its Vote): its token count, whether it extends, whether it
can split for overlap, and whether its batch fits the captured decode graphs (an idle rank's always
does). Every rank then derives the same Agreement from the same rows: the counts, whether to split
(every rank with tokens can), whether the step is all decode (no rank with tokens extends), and the
captured size every rank replays: the smallest holding the largest count, when every rank can
replay and the step is all decode; otherwise every rank runs eagerly. Padding to one size is what
lets the ranks' graphs issue the same collectives with the same shapes; a rank with fewer requests,
or none, fills the rest with padding rows on the scratch page.
"""

from __future__ import annotations

from typing import Sequence

import attrs

from .cuda_graph import padded_size


@attrs.frozen
class Vote:
    num_tokens: int
    extends: bool
    can_split: bool
    can_graph: bool

    def row(self) -> list[int]:
        return [self.num_tokens, int(self.extends), int(self.can_split), int(self.can_graph)]


@attrs.frozen
class Agreement:
    counts: tuple[int, ...]  # every rank's token count
    split: bool  # every rank cuts its batch into micro-batches (idle ranks run empty ones)
    all_decode: bool  # no rank with tokens extends
    graph_size: int | None  # the captured size every rank replays (None: every rank runs eagerly)


def agree(rows: Sequence[Sequence[int]], graph_sizes: Sequence[int]) -> Agreement | None:
    """The decisions of one step from every rank's Vote row (None: no rank has tokens, nobody steps)."""
    counts = tuple(int(row[0]) for row in rows)
    if not any(counts):
        return None
    busy = [row for row in rows if row[0]]
    split = all(row[2] for row in busy)
    all_decode = not any(row[1] for row in busy)
    graph_size = None
    if all_decode and all(row[3] for row in rows):
        graph_size = padded_size(max(counts), graph_sizes)
    return Agreement(counts, split, all_decode, graph_size)
