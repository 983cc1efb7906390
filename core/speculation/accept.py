"""Acceptance on the device: which drafts a verify step keeps, as tensors, with no read back to the host.

A verify step draws one token per verify row, as the plain sampler would (greedy: the argmax; sampling: one
multinomial draw from the filtered distribution; FAILED where the row cannot be drawn). Request r's rows sit on
a fixed grid [R, W] (W = steps + 1; a request with fewer drafts repeats its last row, whose draw is never read),
so the shapes of a step depend only on its number of requests: what a captured graph, or a step launched before
this one is read, needs. Draft k is kept while every draw before it equalled its draft, the first differing draw
(or the draw after the last draft) is the token the step adds: for greedy that is accept_greedy, for point-mass
drafts it is accept_drawn (each emitted token a draw from the target's own distribution at its row, so the
emitted run is distributed as plain sampling's), computed for every request at once.

A request with its own seed does not come here: its stream must be consumed one draw per emitted token (as
plain decoding consumes it) so that a seed gives the same tokens whatever was drafted; verify.py draws those
on the host, in order. Drafts with distributions (gives_probs) go through accept_sampled there as well.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import torch


@attrs.frozen
class Accepted:
    """One verify step's outcome on the device, per request row r."""

    counts: torch.Tensor  # [R] int64: drafts accepted (0 .. its draft count)
    tokens: torch.Tensor  # [R, W] int64: tokens[r, :counts[r] + 1] are the tokens it emits (the last may be FAILED)

    @property
    def emitted(self) -> torch.Tensor:
        """[R] tokens each request emits this step (accepted drafts + the target's own)."""
        return self.counts + 1

    @property
    def last(self) -> torch.Tensor:
        """[R] each request's last emitted token: the first input of its next step."""
        return self.tokens.gather(1, self.counts[:, None])[:, 0]

    def to_host(self) -> list[list[int]]:
        """Per request, its emitted tokens (one read back for the whole step)."""
        both = torch.cat([self.counts[:, None], self.tokens], dim=1).tolist()
        return [row[1 : row[0] + 2] for row in both]


def draft_grid(drafts: Sequence[Sequence[int]], width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """On the host, from a step's drafts (per request, in request order, its rows len(draft) + 1 consecutive rows
    of the flat verify batch): [R, width] the flat row of each grid cell (request r's row k, or its last row
    where it has fewer: padding, whose draw is never emitted), [R, width - 1] the drafts (-1 beyond a request's
    own), [R] their counts. One to_device moves all three."""
    lens = [len(d) for d in drafts]
    index, grid, at = [], [], 0
    for draft, n in zip(drafts, lens):  # plain lists, one tensor each: a tensor per request costs more than the rows
        index += range(at, at + n + 1)
        index += [at + n] * (width - 1 - n)
        grid += draft
        grid += [-1] * (width - 1 - n)
        at += n + 1
    rows = len(drafts)
    return (torch.tensor(index, dtype=torch.int64).view(rows, width),
            torch.tensor(grid, dtype=torch.int64).view(rows, width - 1), torch.tensor(lens, dtype=torch.int64))


def accept(drawn: torch.Tensor, drafts: torch.Tensor, draft_counts: torch.Tensor) -> Accepted:
    """`drawn` [R, W] the token drawn at each verify row (FAILED where none could be), `drafts` [R, W - 1] (any
    value beyond a request's count), `draft_counts` [R]: the drafts kept and the tokens emitted, on the device.
    A FAILED draw never equals a draft (drafts are token ids), so a run stops at it and emits it."""
    steps = drafts.shape[1]
    positions = torch.arange(steps, device=drawn.device)
    agree = (drawn[:, :steps] == drafts) & (positions[None, :] < draft_counts[:, None])
    counts = torch.cumprod(agree.to(torch.int64), dim=1).sum(dim=1)  # the leading run of agreements
    return Accepted(counts, drawn)


def next_inputs(accepted: Accepted, next_drafts: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The next verify step's grid on the device: input ids [R, W] = (each request's last emitted token, its next
    drafts [R, W - 1]) and positions [R, W] = its next position onwards, from `positions` [R], the position of
    the step's first row (the request's last accepted token before it). Rows beyond a request's drafts read
    whatever padding the drafts hold; their logits are never read as tokens."""
    width = next_drafts.shape[1] + 1
    ids = torch.cat([accepted.last[:, None], next_drafts.clamp_min(0)], dim=1)
    start = positions + accepted.emitted
    return ids, start[:, None] + torch.arange(width, device=positions.device)[None, :]

