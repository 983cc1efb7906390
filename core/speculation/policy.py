"""How many drafts each decoding request verifies in a step: fixed (with backoff) or adaptive.

Adaptive: each request keeps its running acceptance per draft position (a_k: the chance draft k is accepted
given drafts 1..k-1 were), so its j-th draft is worth prod_{k<=j} a_k expected tokens. The step's cost comes
from StepCosts (measured per (requests, rows per request) at start-up). Every step the policy adds drafts in
order of their worth, over all requests at once, and keeps the count that maximizes the batch's expected
tokens per second, (requests + worth of the drafts) / cost(requests, rows): a verify step costs more than a
plain one by a fixed part (host work outside the overlap schedule) and a part per row, so at batch 1 a
request with any record drafts fully, and where a verify row costs about what a decode row does it stops.

Whether the drafter proposes anything at all is a second record (offer_rate): where the drafter is asked
only for the requests the policy chose (its proposals cost forwards: nextn), a draft is worth its chance of
coming too; a drafter with cheap proposals (DrafterCaps.cheap_proposals: ngram) is asked first and the policy
then chooses among the drafts it actually made. The offer record also decides, before scheduling, whether
a step will draft at all (then it cannot run under the overlap schedule).

The record is recent: counts shrink by RECENCY at every verify of the request and by RECOVERY per token it
decodes without drafts, so a request whose drafts stopped landing drifts back to the prior (all requests'
record, itself recovering towards PRIOR with every new request) and is tried again later; a request that
never lands drafts costs one verify every few dozen tokens. Backoff (the fixed policy's pause after misses)
is this rule with the cost model replaced by "a miss costs a pause". Decisions depend only on tokens and on
the cost table (the same on every rank), never on timing during serving, so TP ranks decide alike.

Exploration: a record only changes when a request verifies, so where the prior says no draft pays (a verify step
that costs two or three plain ones: a drafter that cannot overlap, a small model whose steps are host work), a
drafter whose drafts would land is never found out. Where a sure draft could pay (may_draft), once per
`explore_every` tokens decoded by the whole batch the request that verified longest ago (none: first) drafts fully
once: that interval is set from the cost table so that trying costs the batch at most EXPLORE_LOSS of its plain
rate when every try misses (a try's verify step beyond a plain one, and under the overlap schedule the two breaks
of it a try out of plain steps makes: StepCosts.break_cost); tries in a row that come to nothing double it, up to
8x (MAX_EXPLORE_DOUBLINGS), and any accepted draft restores it: the adversary's tries cost 1.4% at batch 1 on CPU,
where a synchronous verify step costs more than the table says. The clock is the batch's because requests are
often shorter than the interval (150 tokens where a verify step costs 2.5 plain ones): counted per request, none
of them ever tried. In a fresh engine
(no request verified or was asked yet) every new request tries at once. A request whose
drafts all missed in cold_after() verify steps running drafts only when it is due to explore: its record leans on
the prior, which alone would have it try again every few tokens wherever a verify step costs little more than a
plain one (a drafter that never lands then cost 5-8% at batch 1 on CPU).

All requests' record is what a new request starts from, so it fades only a little with each new request
(NEW_REQUEST_FADE; its counts also shrink by 0.98 at every verify): a fade of 0.97^8 per new request forgot the
drafter within ten requests, and in a steady batch of short requests every newcomer started at PRIOR (0.6 per
position), where the drafter's real rate was 0.33: ngram at batch 8 on CPU chose 13 drafts for 7 new requests at
that worth, and ran at 0.85x of plain decoding. A drafter whose drafts start landing is found by exploration.
"""

from __future__ import annotations

import math
from typing import Sequence

import attrs
import numpy as np

from ..request import Request
from .costs import StepCosts

PRIOR = 0.6  # a new drafter's assumed acceptance per position, before any request has a record
PRIOR_WEIGHT = 2.0  # how many verifies the prior counts as
RECENCY = 0.8  # a request's counts shrink by this at each of its verify steps: the last few dominate
RECOVERY = 0.97  # ... and by this per token it decodes without drafts: the record fades back to the prior
EXPLORE_LOSS = 0.01  # the most of a batch's plain rate that trying drafts the records advise against may cost
COLD_AFTER = 2  # verify steps running in which all of a request's drafts missed: then it only drafts to explore ...
COLD_CHANCE = 0.01  # ... or more: as many as a request landing first drafts as all requests do misses with this chance
MAX_COLD = 8  # ... and at most this many
MAX_EXPLORE_DOUBLINGS = 3  # exploring tries in a row whose drafts all missed double the interval, up to 8x
NEW_REQUEST_FADE = 0.97  # all requests' record shrinks by this with each new request (see the module docstring)


class Acceptance:
    """Decayed counts of tried / accepted drafts per position: one request's, or all requests' (the prior)."""

    def __init__(self, steps: int):
        self.tried = np.zeros(steps)
        self.accepted = np.zeros(steps)

    def record(self, drafted: int, accepted: int, recency: float = RECENCY) -> None:
        """Drafts 1..accepted were accepted, draft accepted+1 (if drafted) was rejected, later ones were not reached."""
        self.tried *= recency
        self.accepted *= recency
        self.tried[: min(accepted + 1, drafted)] += 1.0
        self.accepted[:accepted] += 1.0

    def fade(self, factor: float) -> None:
        self.tried *= factor
        self.accepted *= factor

    def rates(self, prior: np.ndarray, weight: float = PRIOR_WEIGHT) -> np.ndarray:
        return (self.accepted + weight * prior) / (self.tried + weight)


@attrs.frozen
class SizeCosts:
    """What the choice needs of the cost table for steps of n requests: the plain step's tokens per second, the
    verify step's cost for every total of drafts 1 .. n x steps, whether any draft could pay, and the worth a
    draft must exceed for some count of drafts to pay."""

    plain_rate: float
    curve: np.ndarray
    curve_list: list[float]  # the same, as floats (the batch-1 choice runs in plain Python)
    may_draft: bool
    least_worth: float
    explore_every: int  # tokens of a request between tries of drafts its record advises against
    idle_extra: float  # what a verify step of no drafts (one row per request) costs beyond a plain step
    break_cost: float  # one break of the overlap schedule (StepCosts.break_cost)

    @classmethod
    def of(cls, costs: StepCosts, n: int, steps: int) -> SizeCosts:
        d = np.arange(1, n * steps + 1)
        curve = costs.verify_curve(n, n + d)
        plain_cost = costs.cost(n, n, verify=False)
        plain = n / plain_cost
        # one request's try: a step with its `steps` drafts in place of a plain one, once per explore_every steps
        # for each of the n requests; under the overlap schedule a try out of plain steps also breaks the schedule
        # twice (its step waits for the plain step in flight, the plain step after it for the try)
        broken = costs.break_cost(n)
        extra = max(float(curve[steps - 1]) - plain_cost, 0.0) + 2 * broken
        every = int(np.ceil(n * extra / (plain_cost * EXPLORE_LOSS) - 1e-6)) if plain_cost > 0 else 1
        idle_extra = max(costs.cost(n, n, verify=True) - plain_cost, 0.0)
        return cls(plain, curve, curve.tolist(), bool(np.max((n + d) / curve) > plain * (1 + 1e-9)),
                   float(np.min((plain * (1 + 1e-9) * curve - n) / d)) * (1 - 1e-6), max(every, 1), idle_extra,
                   broken)


class AdaptivePolicy:
    name = "adaptive"

    def __init__(self, steps: int, costs: StepCosts):
        self.steps, self.costs = steps, costs
        self.all = Acceptance(steps)
        self._own: dict[str, Acceptance] = {}
        self._seen_at: dict[str, int] = {}  # per request: its output length when its record last changed
        self._offers: dict[str, tuple[float, float, int]] = {}  # per request: decayed (asked, proposed something),
        # and its output length then
        self.offers = (0.0, 0.0)  # the same over all requests
        self._sizes: dict[int, SizeCosts] = {}  # per batch size: the cost table's numbers the choice reads
        self._sizes_version = -1
        self._best_own: float | None = None  # max over the records of accepted / tried at the first draft
        self._clock = 0  # tokens decoded by all requests (seen in _explore): exploration's clock
        self._clock_seen: dict[str, int] = {}  # per request: its output length when the clock last counted it
        self._tried_clock: dict[str, int] = {}  # per request: the clock when it last verified or was asked
        self._ever_tried = False  # whether any request ever verified or was asked
        self._last_try = 0  # the clock at the last try _explore chose (once recorded or offered)
        self._due: str | None = None  # the request _explore chose to try, until its try is recorded or offered
        self._cold: dict[str, int] = {}  # per request: its verify steps running in which every draft missed
        self._prior: list[float] | None = None  # prior(), while all requests' record is unchanged
        self._cold_after: int | None = None  # cold_after(), likewise
        self._missed_tries = 0  # exploring tries in a row that came to nothing (no draft, or none accepted)
        self._trying: str | None = None  # the request of the exploring try under way, until its outcome

    def prior(self) -> np.ndarray:
        """All requests' acceptance per position, each position leaning on the one before it (the first on PRIOR):
        where drafts miss at the first position the later ones are never tried, and a fixed prior there would
        keep them worth a verify step's cheap extra rows."""
        return np.array(self._prior_rates())

    def _prior_rates(self) -> list[float]:
        """prior() as floats, computed once per change of all requests' record (record() drops it)."""
        if self._prior is None:
            rates, before = [], PRIOR
            for accepted, tried in zip(self.all.accepted.tolist(), self.all.tried.tolist()):
                before = (accepted + PRIOR_WEIGHT * before) / (tried + PRIOR_WEIGHT)
                rates.append(before)
            self._prior = rates
        return self._prior

    def worth(self, request: Request) -> np.ndarray:
        """Expected tokens each of the request's drafts 1..steps adds (nonincreasing)."""
        return self._worth_matrix([request])[0]

    def offer_rate(self, request: Request) -> float:
        """The chance the drafter proposes something when asked for this request."""
        everyone = (self.offers[1] + PRIOR_WEIGHT) / (self.offers[0] + PRIOR_WEIGHT)
        asked, given, at = self._offers.get(request.rid, (0.0, 0.0, 0))
        fade = RECOVERY ** max(len(request.output_ids) - at, 0)  # as the acceptance record fades
        return (given * fade + PRIOR_WEIGHT * everyone) / (asked * fade + PRIOR_WEIGHT)

    def choose(self, requests: Sequence[Request], rooms: Sequence[int], expect_offers: bool = False) -> list[int]:
        """Drafts per request (0..min(steps, room)) for a step of these decoding requests. `expect_offers`: the
        drafter is not asked yet (its drafts may not come), so each draft is worth its chance of coming too.
        Vectorized over the batch: it runs on the host every step."""
        n, steps = len(requests), self.steps
        if n == 0:
            return []
        if not self.may_draft(n) or not any(room > 0 for room in rooms):
            return [0] * n
        cold = self._cold_flags(requests)
        if n == 1 and not cold[0]:
            return self._choose_one(requests[0], rooms[0], expect_offers)  # exact, and cheaper than the bounds below
        if all(cold) or self._nothing_pays(requests, expect_offers, n):
            return self._explore(requests, rooms, n)  # the exact choice below would give none, at several times the cost
        worth = self._worth_matrix(requests)
        if expect_offers:
            worth *= np.array([self.offer_rate(r) for r in requests])[:, None]
        allowed = (np.arange(steps)[None, :] < np.clip(np.asarray(rooms), 0, steps)[:, None]) & ~np.array(cold)[:, None]
        flat = np.where(allowed, worth, -1.0).ravel()
        order = np.argsort(-flat, kind="stable")[: int(allowed.sum())]  # equal worth: the earlier request first
        size = self._size(n)
        plain = size.plain_rate
        if not len(order):
            return self._explore(requests, rooms, n)
        rates = (n + np.cumsum(flat[order])) / size.curve[: len(order)]
        best = int(np.argmax(rates))
        if rates[best] <= plain * (1 + 1e-9):
            return self._explore(requests, rooms, n)
        chosen = np.bincount(order[: best + 1] // steps, minlength=n).tolist()
        return [max(a, b) for a, b in zip(chosen, self._explore(requests, rooms, n, drafting=chosen))]

    def _choose_one(self, request: Request, room: int, expect_offers: bool) -> list[int]:
        """choose() for one warm request, in plain Python (numpy's per-call cost is most of a step's policy time
        at batch 1, where a step's host work is a millisecond or two): its drafts in position order, the count with
        the best rate."""
        offer = self.offer_rate(request) if expect_offers else 1.0
        size = self._size(1)
        best, best_rate, total, worth = 0, size.plain_rate * (1 + 1e-9), 1.0, 1.0
        for d, (accept, cost) in enumerate(zip(self._rates_one(request)[: min(room, self.steps)], size.curve_list)):
            worth *= accept
            total += worth * offer
            rate = total / cost
            if rate > best_rate:
                best, best_rate = d + 1, rate
        return [max(best, self._explore([request], [room], 1)[0])]

    def candidates(self, requests: Sequence[Request], rooms: Sequence[int]) -> list[int]:
        """Drafts to ask a cheap drafter for (choose() then picks among what it proposes): each request's room,
        or none where no draft can pay for these requests whatever comes (but those due to try again)."""
        n = len(requests)
        if not self.may_draft(n) or not any(room > 0 for room in rooms):
            return [0] * n
        if all(self._cold_flags(requests)) or self._nothing_pays(requests, False, n):
            return self._explore(requests, rooms, n)
        return [max(min(room, self.steps), 0) for room in rooms]

    def _cold_flags(self, requests: Sequence[Request]) -> list[bool]:
        """Per request: whether its drafts all missed in cold_after() verify steps running (it drafts only to
        explore)."""
        after = self.cold_after()
        return [self._cold.get(r.rid, 0) >= after for r in requests]

    def cold_after(self) -> int:
        """All-miss verify steps in a row after which a request drafts only to explore: COLD_AFTER, or as many as
        a request whose first drafts land as often as all requests' have landed (their record without the prior)
        would miss with COLD_CHANCE (at most MAX_COLD). With first drafts landing 0.8 of the time two misses in a
        row come every 25 verify steps: a request decoding 64 tokens went cold about every other time (H100, nextn
        on the synthetic checkpoint, 24 layers at batch 1: 1.40x against 1.70x for the fixed policy); three make
        it one in 125."""
        if self._cold_after is not None:
            return self._cold_after
        tried = self.all.tried[0]
        miss = 1.0 - self.all.accepted[0] / tried if tried > 0 else 1.0
        if miss <= 0.0:
            after = MAX_COLD
        elif miss >= 1.0:
            after = COLD_AFTER
        else:
            after = min(max(math.ceil(math.log(COLD_CHANCE) / math.log(miss)), COLD_AFTER), MAX_COLD)
        self._cold_after = after  # (until all requests' record changes: record() drops it)
        return after

    def _explore(self, requests: Sequence[Request], rooms: Sequence[int], n: int,
                 drafting: Sequence[int] = ()) -> list[int]:
        """Where the records say no draft pays: full drafts for the request due to try again (module docstring),
        none for the rest. The clock is the batch's: one try per explore_every tokens decoded over all requests,
        by the request whose last try (or none) is oldest, so requests shorter than the interval are tried too.
        The same requests at the same tokens get the same answer (a try moves the clock's mark only once it is
        recorded or offered). Requests `drafting` drafts already are not the one due."""
        every = self._size(n).explore_every << min(self._missed_tries, MAX_EXPLORE_DOUBLINGS)
        for request in requests:  # the clock: every token any request decoded since it was last seen here
            now = len(request.output_ids)
            self._clock += max(now - self._clock_seen.get(request.rid, now), 0)
            self._clock_seen[request.rid] = now
        counts = [0] * n
        if not self._ever_tried:  # a fresh engine: every request not tried yet tries at once (not where the records
            # faded below one try: all requests' record fades with every new request, and where tries are rarer than
            # new requests every newcomer would then try at once)
            for i, (request, room) in enumerate(zip(requests, rooms)):
                if room > 0 and request.rid not in self._tried_clock:
                    counts[i] = min(room, self.steps)
            return counts
        if self._clock - self._last_try < every:
            return counts
        due = [i for i, (request, room) in enumerate(zip(requests, rooms))
               if room > 0 and not (i < len(drafting) and drafting[i])
               and self._clock - self._tried_clock.get(request.rid, self._last_try) >= every]
        if due:
            oldest = min(due, key=lambda i: self._tried_clock.get(requests[i].rid, -1))  # never tried: first
            counts[oldest] = min(rooms[oldest], self.steps)
            self._due = self._trying = requests[oldest].rid
        return counts

    def _tried(self, request: Request) -> None:
        """The request verified or was asked: its clock, and the batch's where it was the one due to try."""
        self._tried_clock[request.rid] = self._clock
        self._ever_tried = True
        if request.rid == self._due:
            self._last_try, self._due = self._clock, None

    def may_draft(self, n: int) -> bool:
        """Whether any draft could pay in a step of n decoding requests: a draft adds at most one token, so where
        (n + d) / cost(n, n + d) never beats the plain step's n / cost for any d, nothing is worth looking at
        (where a verify row costs what a decode row does: large batches)."""
        return self._size(n).may_draft

    def keeps_run(self, n: int, idle: int) -> bool:
        """Whether a run of overlapped verify steps of n requests, in which this step drafts for none of them, goes
        on with a verify step of no drafts (the `idle`-th in a row) rather than ending. Ending breaks the overlap
        schedule now, and again when drafts are wanted (two breaks); going on costs each step what a verify step
        of one row per request costs beyond a plain one. Not knowing when drafts will be wanted again, the run
        goes on while its idle steps' extra cost stays within the two breaks (the ski-rental rule: never more than
        twice what the better choice would have cost, had it been known). Where no draft could pay at this
        batch size, or breaks cost nothing (verify steps that do not overlap), the run ends at once."""
        if not self.may_draft(n):
            return False
        size = self._size(n)
        return idle * size.idle_extra < 2 * size.break_cost

    def run_pays(self, requests: Sequence[Request], counts: Sequence[int], steps: float, breaks: int = 2) -> bool:
        """Whether a run of overlapped verify steps entered now from plain ones (choose() gave `counts`) pays for
        the `breaks` breaks of the overlap schedule it makes: where the plain step in flight is read for drafts
        one now, and one when the run ends, at the next step that holds a prompt, `steps` steps on as the engine
        has seen them come (PromptGaps). The step's expected tokens would take plain steps `saving` seconds longer
        than it; the run pays where its steps save more than the breaks cost. A try no record advises
        (exploration: no saving) was priced with its breaks already (explore_every). At 32-64 requests with a
        prompt every 2-3 steps, ngram on random weights (decode-only steps 1.13-1.15x of plain ones) entered runs
        at every admission and ran at 0.88-0.94x of plain decoding (H100, Qwen3 12 layers)."""
        n = len(requests)
        size = self._size(n)
        if size.break_cost <= 0.0 or math.isinf(steps) or not any(counts):
            return True
        saving = self._expected_tokens(requests, counts) / size.plain_rate - float(size.curve[sum(counts) - 1])
        return saving <= 0.0 or saving * steps >= breaks * size.break_cost

    def mixed_pays(self, requests: Sequence[Request], counts: Sequence[int]) -> bool:
        """Whether a step holding prompt tokens beside these decoding requests should verify the drafts choose()
        gave (`counts`) rather than decode plainly. Such a step is synchronous: the step in flight is read for its
        drafts, and the step after it launches with nothing in flight, so it costs what serving measured such steps
        at (StepCosts.sync_cost: from the read to its end) plus one break, against a plain step overlapped as
        usual; the prompt's rows are in both. Their expected tokens per second decide. (H100, session 25: always
        verifying there cost ngram on random weights, 2.0 tokens a request, 3-9% at steady 32-64 on Qwen3 12
        layers, and gained nextn on the deep DeepSeek-V3 shapes, 2.9 tokens a request, 7% at 32. Session 26, with
        this rule: ngram stopped after one or two tries; nextn verified in 8-9 mixed steps a run, 1.11x of plain
        decoding against 1.10x without.)"""
        n = len(requests)
        if not any(counts):
            return False
        size = self._size(n)
        cost = self.costs.sync_cost(n, n + sum(counts)) + size.break_cost
        return self._expected_tokens(requests, counts) / cost > size.plain_rate * (1 + 1e-9)

    def _expected_tokens(self, requests: Sequence[Request], counts: Sequence[int]) -> float:
        """A step's expected tokens where request i verifies counts[i] drafts (each also to come from the drafter)."""
        worth = self._worth_matrix(requests) * np.array([self.offer_rate(r) for r in requests])[:, None]
        taken = np.arange(self.steps)[None, :] < np.asarray(counts)[:, None]
        return len(requests) + float(worth[taken].sum())

    def least_paying_worth(self, n: int) -> float:
        """The worth a draft must exceed for any count of drafts to pay in a step of n requests: every draft is
        worth at most the best first draft w, so the choice is none while (n + d w) / cost(n, n + d) <= n / plain
        for every d, i.e. w <= min_d (plain_rate cost(n, n + d) - n) / d."""
        return self._size(n).least_worth

    def _size(self, n: int) -> SizeCosts:
        """The cost table's numbers for steps of n requests, computed once per n and again after a size is
        measured (a new size can lower the smaller sizes' costs)."""
        if self._sizes_version != self.costs.version:
            self._sizes.clear()
        size = self._sizes.get(n)
        if size is None:
            size = SizeCosts.of(self.costs, n, self.steps)  # may measure a size
            if self._sizes_version != self.costs.version:
                self._sizes.clear()
                self._sizes_version = self.costs.version
            self._sizes[n] = size
        return size

    def _nothing_pays(self, requests: Sequence[Request], expect_offers: bool, n: int) -> bool:
        """Whether no draft can pay, from bounds on the best first draft: first one that costs nothing per request
        (every request's first-draft rate is a weighted mean of the prior and its own accepted / tried, which
        fading leaves alone; the chance of an offer is at most 1), then each request's own rate."""
        least = self.least_paying_worth(n)
        if self._best_own is None:  # recomputed only after a record changed
            self._best_own = max((own.accepted[0] / own.tried[0] for own in self._own.values() if own.tried[0] > 0),
                                 default=0.0)
        prior = self._prior_rates()[0]
        return max(prior, self._best_own) <= least or self._best_first_worth(requests, expect_offers) <= least

    def _best_first_worth(self, requests: Sequence[Request], expect_offers: bool) -> float:
        """max over the requests of their first draft's worth (times its chance of coming): the rates of
        _worth_matrix's first column, in plain Python (a few operations per request; it reads and fades nothing)."""
        prior = self._prior_rates()[0]
        best = 0.0
        for request in requests:
            own = self._own.get(request.rid)
            if own is None:
                rate = prior
            else:
                fade = self._fade(request)
                rate = (own.accepted[0] * fade + PRIOR_WEIGHT * prior) / (own.tried[0] * fade + PRIOR_WEIGHT)
            if expect_offers:
                rate *= self.offer_rate(request)
            best = max(best, rate)
        return float(best)

    def _rates_one(self, request: Request) -> list[float]:
        """One request's acceptance per position (its record faded to now, leaning on the prior), as floats."""
        prior = self._prior_rates()
        own = self._own.get(request.rid)
        if own is None:
            return prior
        fade = self._fade(request)
        return [(a * fade + PRIOR_WEIGHT * p) / (t * fade + PRIOR_WEIGHT)
                for a, t, p in zip(own.accepted.tolist(), own.tried.tolist(), prior)]

    def _fade(self, request: Request) -> float:
        """The factor the request's record fades by for the tokens it decoded without drafts since it last changed
        (applied to its counts only when it changes next: record)."""
        return RECOVERY ** max(len(request.output_ids) - self._seen_at[request.rid], 0)

    def _fade_own(self, request: Request, own: Acceptance) -> None:
        """Fade the request's record by the tokens it decoded without drafts since it last changed."""
        faded = len(request.output_ids) - self._seen_at[request.rid]
        if faded > 0:
            own.fade(RECOVERY ** faded)
            self._seen_at[request.rid] = len(request.output_ids)

    def _worth_matrix(self, requests: Sequence[Request]) -> np.ndarray:
        """[requests, steps]: worth() of each request, at once."""
        tried, accepted = np.zeros((len(requests), self.steps)), np.zeros((len(requests), self.steps))
        fades = np.ones((len(requests), 1))
        for i, request in enumerate(requests):
            own = self._own.get(request.rid)
            if own is None:
                continue
            fades[i, 0] = self._fade(request)
            tried[i], accepted[i] = own.tried, own.accepted
        tried *= fades
        accepted *= fades
        prior = self.prior()[None, :]
        return np.cumprod((accepted + PRIOR_WEIGHT * prior) / (tried + PRIOR_WEIGHT), axis=1)

    def record(self, request: Request, drafted: int, accepted: int) -> None:
        own = self._own.get(request.rid)
        if own is not None:
            self._fade_own(request, own)
        else:
            own = self._own[request.rid] = Acceptance(self.steps)
            # each new request moves all requests' record a little back to PRIOR (record() drops the cached prior)
            self.all.fade(NEW_REQUEST_FADE)
            self.offers = (self.offers[0] * NEW_REQUEST_FADE, self.offers[1] * NEW_REQUEST_FADE)
        own.record(drafted, accepted)
        self._try_ended(request, landed=accepted > 0)
        self._tried(request)
        self._cold[request.rid] = 0 if accepted else self._cold.get(request.rid, 0) + 1
        self._best_own = self._prior = self._cold_after = None
        self.all.record(drafted, accepted, recency=0.98)
        self._seen_at[request.rid] = len(request.output_ids)

    def _try_ended(self, request: Request, landed: bool) -> None:
        """A request's drafts came to an outcome: any landed draft restores the exploring interval; the exploring
        try under way that came to nothing doubles it (MAX_EXPLORE_DOUBLINGS)."""
        if landed:
            self._missed_tries = 0
        elif request.rid == self._trying:
            self._missed_tries += 1
        if request.rid == self._trying:
            self._trying = None

    def offered(self, request: Request, given: bool) -> None:
        """The drafter was asked for the request, and proposed something (or nothing)."""
        asked, got, at = self._offers.get(request.rid, (0.0, 0.0, 0))
        fade = RECENCY * RECOVERY ** max(len(request.output_ids) - at, 0)
        if not given:  # (a try given drafts ends when they are verified: record)
            self._try_ended(request, landed=False)
        self._tried(request)
        self._offers[request.rid] = (asked * fade + 1.0, got * fade + float(given), len(request.output_ids))
        self.offers = (self.offers[0] * 0.98 + 1.0, self.offers[1] * 0.98 + float(given))

    def finished(self, rid: str) -> None:
        self._best_own = None
        if rid == self._trying:  # its try never came to an outcome
            self._trying = None
        self._offers.pop(rid, None)
        self._own.pop(rid, None)
        self._seen_at.pop(rid, None)
        self._clock_seen.pop(rid, None)
        self._tried_clock.pop(rid, None)
        self._cold.pop(rid, None)


MAX_PAUSE = 64  # tokens: the longest a request goes without drafts after its drafts kept missing
IDLE_PAUSE = 8  # tokens: the longest after the drafter had nothing to say (asking again is cheap)


class FixedPolicy:
    """Every due request drafts `steps`; with backoff, after two verify steps running in which its drafts all
    missed a request pauses for 2, 4, ... MAX_PAUSE of its tokens (IDLE_PAUSE where the drafter had nothing to say)."""

    name = "fixed"

    def __init__(self, steps: int, backoff: bool = True):
        self.steps, self.backoff = steps, backoff
        self._misses: dict[str, int] = {}
        self._resume_at: dict[str, int] = {}

    def due(self, request: Request) -> bool:
        return len(request.output_ids) >= self._resume_at.get(request.rid, 0)

    def may_draft(self, n: int) -> bool:
        return True

    def keeps_run(self, n: int, idle: int) -> bool:
        """A run of overlapped verify steps ends with the first step the policy drafts nothing for."""
        return False

    def run_pays(self, requests: Sequence[Request], counts: Sequence[int], steps: float, breaks: int = 2) -> bool:
        """Every run the choice wants is entered."""
        return True

    def mixed_pays(self, requests: Sequence[Request], counts: Sequence[int]) -> bool:
        """A step holding a prompt verifies whatever the choice drafts."""
        return any(counts)

    def candidates(self, requests: Sequence[Request], rooms: Sequence[int]) -> list[int]:
        return self.choose(requests, rooms)

    def choose(self, requests: Sequence[Request], rooms: Sequence[int], expect_offers: bool = False) -> list[int]:
        return [min(self.steps, max(room, 0)) if self.due(r) else 0 for r, room in zip(requests, rooms)]

    def record(self, request: Request, drafted: int, accepted: int) -> None:
        if accepted:
            self.finished(request.rid)
        elif drafted:
            self.missed(request)

    def offered(self, request: Request, given: bool) -> None:
        if not given:
            self.missed(request, IDLE_PAUSE)

    def missed(self, request: Request, longest: int = MAX_PAUSE) -> None:
        if not self.backoff:
            return
        misses = self._misses[request.rid] = self._misses.get(request.rid, 0) + 1
        if misses >= 2:
            self._resume_at[request.rid] = len(request.output_ids) + min(2 ** (misses - 1), longest)

    def finished(self, rid: str) -> None:
        self._misses.pop(rid, None)
        self._resume_at.pop(rid, None)
