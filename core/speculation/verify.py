"""Which drafts the target accepts, and the token it adds after them.

A request with m drafts has m + 1 verify rows of logits: row k is the target's distribution p_k of the
token after draft k (row 0: after its last accepted token). Greedy keeps the drafts equal to argmax p_k
and then adds argmax p_j at the first mismatch (or after the last draft): the tokens plain greedy decoding
gives. Sampling (Leviathan et al. 2023, Chen et al. 2023) accepts draft d_k with probability
min(1, p_k(d_k) / q_k(d_k)) (q_k(d_k) = 1 for a drafter of point masses), on rejection draws from the
normalized max(p_k - q_k, 0) and stops, and after m acceptances draws a bonus token from p_m: every
emitted token is distributed as the target's own. For point-mass drafts (ngram, nextn) this is done by
drawing the target's token at each row and keeping the draft while they agree (accept_drawn), which emits the
very tokens plain sampling draws from the same random stream. p_k is filtered (temperature, top-k, top-p, min-p) by
the same function as the non-speculative sampler; a request with a seed draws all of this from its own
random stream, so the same seed gives the same output. Greedy requests and sampled ones without a seed are
accepted by tensor ops for the whole step at once (accept.py); the rest here, one request at a time.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..request import Request
from ..sampler import FAILED, Sampler, _generator, filtered_probs
from ..transfer import to_device
from .accept import Accepted, accept, draft_grid


def verify(logits: torch.Tensor, requests: Sequence[Request], drafts: Sequence[Sequence[int]],
           draft_probs: Sequence[torch.Tensor | None] | None = None) -> list[list[int]]:
    """Per request, the accepted drafts followed by the target's token (FAILED in its place where a row's
    logits are not finite). `logits` holds len(drafts[i]) + 1 rows per request, in request order.

    Greedy requests and sampled ones without a seed are accepted on the device (accept.py, one read back for
    all of them); a seeded request draws from its own stream one token at a time (accept_drawn), and drafts
    with distributions go through accept_sampled."""
    starts, at = [], 0
    for draft in drafts:
        starts.append(at)
        at += len(draft) + 1
    out: list[list[int] | None] = [None] * len(requests)
    has_q = [draft_probs is not None and draft_probs[i] is not None for i in range(len(requests))]
    on_device = [i for i, r in enumerate(requests) if (r.params.greedy or r.params.seed is None) and not has_q[i]]
    if on_device:
        for i, tokens in zip(on_device, accept_on_device(logits, [requests[i] for i in on_device],
                                                         [drafts[i] for i in on_device],
                                                         [starts[i] for i in on_device]).to_host()):
            out[i] = tokens
    for i in (i for i in range(len(requests)) if out[i] is None):
        span = logits[starts[i] : starts[i] + len(drafts[i]) + 1]
        if not drafts[i]:  # no drafts: exactly the non-speculative sampler, from the request's own stream
            out[i] = [int(Sampler.draw(span, [requests[i]])[0])]
            continue
        probs = filtered_probs(span, [requests[i].params] * span.shape[0])
        generator = _generator(requests[i], logits.device)
        if not has_q[i]:  # point masses: the target's own draws, so no token depends on the drafts
            out[i] = accept_drawn(probs, drafts[i], generator)
        else:
            out[i] = accept_sampled(probs, drafts[i], generator, draft_probs[i])
    return out


def accept_on_device(logits: torch.Tensor, requests: Sequence[Request], drafts: Sequence[Sequence[int]],
                     starts: Sequence[int]) -> Accepted:
    """Requests without a stream of their own (accept.py): every verify row drawn at once by the plain sampler's
    draw, then the drafts kept on the [requests, steps + 1] grid. `starts[i]`: request i's first row in `logits`."""
    width = max(len(d) for d in drafts) + 1
    rows = [s + k for s, d in zip(starts, drafts) for k in range(len(d) + 1)]
    owners = [r for r, d in zip(requests, drafts) for _ in range(len(d) + 1)]
    if len(rows) < logits.shape[0]:
        logits = logits[to_device(logits.device, torch.tensor(rows, dtype=torch.int64))[0]]
    drawn = Sampler.draw(logits, owners)
    index, grid, counts = to_device(logits.device, *draft_grid(drafts, width))
    return accept(drawn[index], grid, counts)


def accept_greedy(draft: Sequence[int], best: Sequence[int], finite: Sequence[bool]) -> list[int]:
    out = []
    for k, token in enumerate(best):
        if not finite[k]:
            return out + [FAILED]
        if k == len(draft) or draft[k] != token:
            return out + [token]
        out.append(token)
    raise AssertionError("a verify span has one row more than its drafts")


def accept_drawn(probs: torch.Tensor, draft: Sequence[int], generator: torch.Generator | None) -> list[int]:
    """Drafts that are point masses: draw the target's token at each verify row as the plain sampler would
    (the same filtered probabilities, one multinomial draw from the request's stream per emitted token), keep
    the draft while it equals the draw, and emit the draw at the first difference. That is rejection sampling
    with q = the draft's point mass (draft d kept with probability p(d); on rejection the draw is distributed
    as p without d, renormalized), and it consumes a seeded request's stream exactly as plain decoding does: a
    seed gives the same tokens whatever was drafted, with any policy, and the same as without speculation."""
    mass = probs.sum(-1)
    drawable = (torch.isfinite(mass) & (mass > 0)).tolist()
    out = []
    for k in range(len(draft) + 1):
        if not drawable[k]:
            return out + [FAILED]
        token = int(torch.multinomial(probs[k], 1, generator=generator)[0])
        if k == len(draft) or token != draft[k]:
            return out + [token]
        out.append(token)
    raise AssertionError("a verify span has one row more than its drafts")


def accept_sampled(probs: torch.Tensor, draft: Sequence[int], generator: torch.Generator | None,
                   draft_probs: torch.Tensor | None = None) -> list[int]:
    """Rejection sampling over `probs` [m + 1, V] (filtered target distributions) for the m drafts; `draft_probs`
    [m, V] the drafter's distributions, or None for point masses."""
    mass = probs.sum(-1, keepdim=True)
    ok = torch.isfinite(mass) & (mass > 0)
    drawable = ok[:, 0].tolist()
    probs = torch.where(ok, probs / torch.where(ok, mass, 1.0), 0.0)  # top-p and min-p leave rows unnormalized
    out = []
    for k, d in enumerate(draft):
        if not drawable[k]:
            return out + [FAILED]
        p = probs[k]
        q = None if draft_probs is None else draft_probs[k]
        q_d = 1.0 if q is None else float(q[d])
        u = float(torch.rand(1, generator=generator, device=probs.device))
        if u * q_d < float(p[d]):
            out.append(d)
            continue
        residual = p.clone()
        if q is None:
            residual[d] = 0.0
        else:
            residual = (p - q).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p(d) rounds to q(d): nothing else to draw, d stands
            out.append(d)
            continue
        return out + [int(torch.multinomial(residual, 1, generator=generator))]
    if not drawable[len(draft)]:
        return out + [FAILED]
    return out + [int(torch.multinomial(probs[len(draft)], 1, generator=generator))]
