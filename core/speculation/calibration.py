"""What steps really take while serving, against what the step-cost table says they take.

The table (costs.py) is measured at start-up on bare forwards. Serving adds work it does not see: the drafter's host
work, acceptance, the bookkeeping of every request, and at large batches a host that outlasts the device (under the
overlap schedule a step costs the larger of the two). Where that work weighs more on verify steps than on plain ones,
the table prices verify steps too low and the policy drafts where drafting loses: on an H200, ngram at a steady batch
of 32 ran at 0.87x of plain decoding (0.79x over the decode-only steps) while the table promised a gain.

So every step inside a run (launched after a step of the same class, plain or verify, with the overlap schedule
unbroken between them: its wall time is then about the steady cost of such a step) is compared with the table's cost
of its shape, and per grid size the policy's verify costs are scaled by

    (verify steps' measured / table) / (plain steps' measured / table)

so that what slows both alike (the machine's load, the caller's loop) cancels. Each ratio is a decayed mean of logs;
their difference leans towards "as the table says" with the weight of PRIOR_WEIGHT steps against the evidence of the
class with less of it (no verify step measured: the table; no plain step, where the drafter drafts every step: the
table's plain cost stands). Once STALE plain steps went by without a verify step,
the verify ratio fades back towards 1, so a size where drafting was measured to lose is tried again by exploration
later, and measured again.

A drafter that drafts on the host (no overlapped verify steps) under the overlap schedule verifies in synchronous steps
that never form runs: each reads the step in flight, drafts, and waits for its own forward, so it costs far more than
the table's bare forward (on an H100 at 32 requests, 11.1 ms against 5.4), and a step inside a run never shows it.
For such a drafter (`isolated`) every synchronous verify step counts, alone, at what it took, break included: what
drafting really costs it there. Without this the adversary at 32 and 64 verified 37-40 times a run and ran at 0.95x.

Breaks of the overlap schedule are priced the same way. The start-up measure (setup.py's measure_break) times a bare
plain step read before the next is built; a break while serving exposes the engine's whole step instead: the read
of every request's tokens, their bookkeeping, the next step's scheduling and launch. At 64 requests on an H200
(session 17) ngram's runs of verify steps ended 39 times a round, its mixed steps (where runs end) averaged 6.17 ms
against plain decoding's 4.87, and ngram ran at 0.91x of plain decoding. So each broken step whose launch is asynchronous
counts with what it exposed (StepLog: from the read step's tokens reaching the host to the step's end), against the
table's break of its size, in a decayed mean of logs like the verify steps'; the break's scale leans towards 1 with
PRIOR_WEIGHT steps' worth of weight, and stays within SCALE_RANGE (never below the table).

A mixed step that verifies (prompt tokens beside the decodes: AdaptivePolicy.mixed_pays) is synchronous too, and
its shape (decoding rows, the prompt's beside them) is none the table measures. Each one that read the step in
flight for its drafts counts what it exposed, from that read to its end, against the table's verify step of its
decoding rows, in a decayed mean of logs like the breaks' (leaning towards the size's verify scale with
PRIOR_WEIGHT steps' weight, and fading back to it after STALE steps of any other kind): StepCosts.sync_cost. It
does not count as a verify step. (H100, session 26, deep DeepSeek-V3 shapes at 32: nextn's first four such steps
took 1.3 s each, its kernels' first compiles, and with plain steps alone fading that evidence, none came in the
three runs after, where session 25 had measured them at 61.6 ms of wall time, the step in flight's included.)

Decisions made from timings would differ between ranks that must decide alike (tensor-parallel ranks schedule the
same requests), so the scales reach the table only every PUBLISH_EVERY observed steps (and after the first EARLY ones), as the
slowest rank's (one
small all-gather; every rank observes the same steps, as it launches the same kinds), and only where they moved.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import attrs

from ..step_log import VERIFY_KINDS, TimedStep
from .costs import StepCosts

PRIOR_WEIGHT = 2.0  # steps' worth of "as the table says" each ratio starts with
DECAY = 0.95  # each observation of a class shrinks the weight of the earlier ones by this
STALE = 200  # plain steps without a verify step of the size: from then on each shrinks its verify evidence ...
FADE = 0.99  # ... by this (back towards the table)
CLIP = 4.0  # one step counts as at most this many times what its class is believed to take, or at least its inverse
# (a GC pause moves the belief little; a cost that stays is learned over a few steps, however large)
PUBLISH_EVERY = 16  # observed steps between updates of the table's scales (and early ones after the first few:
EARLY = (4, 8)  # a cost the table misses by far is acted on within a few steps, not after sixteen of them)
MOVE = 0.03  # a scale reaches the table only where it moved by more than this (each move rebuilds the policy's view)
# never below the table: calibration only ever makes the policy more careful. One scale covers a size's verify steps
# with and without drafts, and on an H100 (session 10, batch 1) overlapped steps with drafts ran well below the
# table (1.64 ms for 2.4) while steps of no draft did not (1.37 for 1.60, plain steps 1.24 for 1.45): a scale of
# 0.82 priced a step of no draft below a plain one, and runs of them went on for good, each 10% dearer than a plain
# step (ngram 0.97x there against 0.99x on the table alone)
SCALE_RANGE = (1.0, 32.0)

PLAIN_KINDS = frozenset({"decode"})
SYNC_VERIFY = "verify"  # a verify step that waits for its own forward (StepLog's kind)
UNTIMED_BREAKS = frozenset({SYNC_VERIFY, "none"})  # a broken step of these kinds exposes more than the break (its own
# forward) or nothing launched


@attrs.define
class _Ratio:
    """A decayed mean of log(measured / table)."""

    weight: float = 0.0
    total: float = 0.0
    idle: int = 0  # plain steps since the last observation

    def add(self, log_ratio: float) -> None:
        self.weight = self.weight * DECAY + 1.0
        self.total = self.total * DECAY + log_ratio
        self.idle = 0

    def add_clipped(self, log_ratio: float) -> None:
        """add(), the observation held within CLIP of what the class is believed to take (a pause moves it little)."""
        believed = self.mean()
        self.add(min(max(log_ratio, believed - math.log(CLIP)), believed + math.log(CLIP)))

    def wait(self) -> None:
        """A step of another class went by: evidence older than STALE of them fades."""
        self.idle += 1
        if self.idle > STALE:
            self.weight *= FADE
            self.total *= FADE

    def mean(self) -> float:
        return self.total / self.weight if self.weight > 0 else 0.0


class Calibration:
    """Feeds StepCosts.set_scale from the steps the engine times (observe). `slowest(values)`: each value as the
    largest any rank has (identity with one rank)."""

    def __init__(self, costs: StepCosts, slowest: Callable[[Sequence[float]], Sequence[float]] = lambda v: v,
                 isolated: bool = False):
        self.costs = costs
        self.slowest = slowest
        self.isolated = isolated  # synchronous verify steps count alone (the module docstring)
        self._plain: dict[int, _Ratio] = {}
        self._verify: dict[int, _Ratio] = {}
        self._breaks: dict[int, _Ratio] = {}  # per size: log(exposed / the table's break) of broken steps
        self._mixed: dict[int, _Ratio] = {}  # per size: log(exposed / the table's verify step) of mixed verify steps
        self._last_class: str | None = None
        self._observed = 0

    def observe(self, step: TimedStep) -> None:
        cls = "plain" if step.kind in PLAIN_KINDS else "verify" if step.kind in VERIFY_KINDS else None
        steady = cls is not None and cls == self._last_class and not step.broken and step.requests > 0 \
            and not step.prompt  # (a verify step holding a prompt is priced apart: _observe_mixed)
        alone = self.isolated and step.kind == SYNC_VERIFY and step.requests > 0 and not step.prompt
        self._last_class = cls
        if step.broken and step.kind not in UNTIMED_BREAKS:
            self._observe_break(step)
        if step.prompt and step.kind == SYNC_VERIFY and step.requests > 0 and step.exposed > 0.0:
            self._observe_mixed(step)
        else:  # any other step: a mixed verify step's evidence goes stale (nextn at 32 runs few plain ones)
            for ratio in self._mixed.values():
                ratio.wait()
        if not (steady or alone):
            return
        size = self.costs.size_of(step.requests)
        if size not in self.costs.measured:  # (never measured here: a step's end is no time to measure)
            return
        table = self.costs.table_cost(step.requests, max(step.rows, step.requests), cls == "verify")
        ratio = (self._plain if cls == "plain" else self._verify).setdefault(size, _Ratio())
        measured = math.log(max(step.seconds, 1e-9) / max(table, 1e-9))  # (every rank counts the step alike)
        ratio.add_clipped(measured)
        if cls == "plain":
            for ratio in self._verify.values():
                ratio.wait()
        self._count()

    def _observe_mixed(self, step: TimedStep) -> None:
        """A synchronous verify step that held prompt tokens, read the step in flight for its drafts: what it
        exposed (from that read to its end: drafting, its forward with the prompt's rows, acceptance on the host)
        against the table's verify step of its decoding rows (StepCosts.sync_cost). A ratio like the breaks'."""
        size = self.costs.size_of(step.requests)
        if size not in self.costs.measured:
            return
        ratio = self._mixed.setdefault(size, _Ratio())
        measured = math.log(step.exposed / max(self.costs.table_cost(step.requests, step.rows, True), 1e-9))
        ratio.add_clipped(measured)
        self._count()

    def _observe_break(self, step: TimedStep) -> None:
        """A broken step: what it exposed against the table's break of its size. Whether it counts depends only on
        what every rank sees alike (ranks publish together); its time only where the device ran ahead of the host."""
        n = max(step.requests, 1)
        size = self.costs.size_of(n)
        if size not in self.costs.measured or self.costs.table_break_cost(n) <= 0.0:
            return
        if step.exposed > 0.0:
            ratio = self._breaks.setdefault(size, _Ratio())
            measured = math.log(step.exposed / self.costs.table_break_cost(n))
            ratio.add_clipped(measured)
        self._count()

    def _count(self) -> None:
        self._observed += 1
        if self._observed % PUBLISH_EVERY == 0 or self._observed in EARLY:
            self._publish()

    def scales(self) -> dict[int, float]:
        """This rank's scale per grid size (1.0 where nothing was observed)."""
        low, high = SCALE_RANGE
        out = {}
        for size in self.costs.sizes:
            verify, plain = self._verify.get(size, _Ratio()), self._plain.get(size, _Ratio())
            # no verify step measured: nothing known; no plain step (a drafter that drafts every step): the table's
            # plain cost stands; both: the difference counts as much as the class with less evidence says
            evidence = min(verify.weight, plain.weight) if plain.weight > 0 else verify.weight
            shrunk = (verify.mean() - plain.mean()) * evidence / (evidence + PRIOR_WEIGHT)
            out[size] = min(max(math.exp(shrunk), low), high)
        return out

    def break_scales(self) -> dict[int, float]:
        """This rank's scale of the break per grid size (1.0 where no break was timed)."""
        low, high = SCALE_RANGE
        out = {}
        for size in self.costs.sizes:
            ratio = self._breaks.get(size, _Ratio())
            out[size] = min(max(math.exp(ratio.mean() * ratio.weight / (ratio.weight + PRIOR_WEIGHT)), low), high)
        return out

    def mixed_scales(self) -> dict[int, float]:
        """This rank's scale of a mixed verify step per grid size where one was timed (StepCosts.sync_cost),
        leaning towards the size's verify scale with PRIOR_WEIGHT steps' weight; 0.0 where none was timed."""
        low, high = SCALE_RANGE
        out = {}
        for size in self.costs.sizes:
            ratio = self._mixed.get(size)
            if ratio is None or ratio.weight <= 0.0:
                out[size] = 0.0
                continue
            prior = math.log(self.costs.scale(size))
            mean = (ratio.total + PRIOR_WEIGHT * prior) / (ratio.weight + PRIOR_WEIGHT)
            out[size] = min(max(math.exp(mean), low), high)
        return out

    def _publish(self) -> None:
        sizes = self.costs.sizes
        verify, breaks, mixed = self.scales(), self.break_scales(), self.mixed_scales()
        agreed = self.slowest([verify[size] for size in sizes] + [breaks[size] for size in sizes]
                              + [mixed[size] for size in sizes])
        count = len(sizes)
        for size, scale, broken, sync in zip(sizes, agreed[:count], agreed[count: 2 * count], agreed[2 * count:]):
            if abs(scale / self.costs.scale(size) - 1.0) > MOVE:
                self.costs.set_scale(size, scale)
            if abs(broken / self.costs.break_scales.get(size, 1.0) - 1.0) > MOVE:
                self.costs.set_break_scale(size, broken)
            if sync > 0.0 and abs(sync / self.costs.sync_scales.get(size, 1.0) - 1.0) > MOVE:
                self.costs.set_sync_scale(size, sync)
