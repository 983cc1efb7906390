"""The step-cost model of the adaptive draft policy: seconds per step for (requests, rows per request).

Measured on the engine's own forward paths (setup.measure_step_costs) per batch size of a grid (1, 2, 4, ...
up to --max-running-requests), each size the first time a step of that many requests asks (then cached), for
rows per request 1 .. steps + 1: a plain step (one decode row per request, the overlap schedule's path where
it is on) and a verify step (the speculative path: built on the host, logits on every row, read back). A step
of n requests uses the smallest measured size >= n, as a graph replay pads to it.

Noise from other work on the machine only ever adds time, so each shape is run ROUNDS times interleaved with
the others (a burst of interference spoils one run of a shape, not all of them; more rounds while a round still
finds a shape faster), keeps its fastest run, and
costs at most what a step with more rows per request, or more requests, costs (fewer rows never do more work;
a plain step does no more than a verify step of one row per request).
"""

from __future__ import annotations

import bisect
import time
from typing import Callable, Sequence

import numpy as np

ROUNDS = 3  # timed runs of each shape, interleaved with the size's other shapes ...
MAX_ROUNDS = 8  # ... and more, up to this, while a round still finds a shape 10% faster

# run(n, k) runs one step of n requests and k rows each (k 0: the plain step), synchronized
Run = Callable[[int, int], None]


def grid_sizes(max_requests: int) -> list[int]:
    """1, 2, 4, ... below the largest batch, and the largest batch."""
    sizes, n = [], 1
    while n < max_requests:
        sizes.append(n)
        n *= 2
    return sizes + [max_requests]


def time_size(n: int, rows_per_request: int, run: Run, any_rank: Callable[[bool], bool] = lambda flag: flag,
              steps_per_run: Sequence[int] = ()) -> list[float]:
    """[plain, verify x1, ..., verify x rows_per_request] seconds for steps of n requests. `any_rank(flag)`:
    whether the flag is set on any rank (every rank must run as many rounds: the steps' collectives pair up).
    `steps_per_run[k]`: steps one run of shape k times (two where a step is timed back to back with the next, as
    the overlap schedule runs it; default one): each shape's time is per step before the envelope compares them
    (compared per run, two overlapped plain steps were capped at one synchronous verify step's time)."""
    shapes = range(rows_per_request + 1)
    for k in shapes:  # warm-up: first-use allocations, autotuning
        run(n, k)
    best = [float("inf")] * len(shapes)
    for round in range(MAX_ROUNDS):
        improved = False
        for k in shapes:
            start = time.perf_counter()
            run(n, k)
            took = time.perf_counter() - start
            improved |= took < best[k] * 0.9
            best[k] = min(best[k], took)
        if round + 1 >= ROUNDS and not any_rank(improved):
            break
    best = [b / (steps_per_run[k] if k < len(steps_per_run) else 1) for k, b in enumerate(best)]
    for k in reversed(range(rows_per_request)):  # the envelope: more rows never cost less
        best[k] = min(best[k], best[k + 1])
    return best


class StepCosts:
    """`cost(n, rows, verify)`: seconds of a plain step of n requests, or of a verify step of `rows` rows in all
    (rows / n per request, fractional where requests draft different counts: interpolated linearly).
    `measure_size(n)` gives [plain, verify x1, ...] for a grid size; it runs once per size, on first use.

    `break_cost(n)`: what one break of the overlap schedule costs a step of n requests (a step in flight read
    before the next is launched: the host's part of a step, which the schedule otherwise hides), from
    `measure_break(size)` (none given: 0, as where steps do not overlap). Entering a run of overlapped verify
    steps from plain ones costs one, leaving it another (the policy prices its tries with them).

    `set_scale(size, factor)`: verify steps of that size cost `factor` times the table from now on (calibration.py:
    what serving measures them at, against plain steps); `table_cost` is the table without it. `set_break_scale`
    does the same for a break (what the host work a break exposes takes while serving: a real step's reads and
    bookkeeping, which the start-up measure's bare steps do not have); `table_break_cost` is the measure alone.
    `set_sync_scale` does it for a synchronous verify step holding a prompt (`sync_cost`: everything from the read
    of the step in flight to the step's end, drafting, the prompt's rows and the host's acceptance included)."""

    def __init__(self, sizes: Sequence[int], measure_size: Callable[[int], Sequence[float]],
                 measure_break: Callable[[int], float] | None = None):
        self.sizes = list(sizes)
        self.measure_size = measure_size
        self.measure_break = measure_break
        self.measured: dict[int, list[float]] = {}
        self.breaks: dict[int, float] = {}
        self.scales: dict[int, float] = {}  # per size: verify steps' cost as served / as measured (calibration.py)
        self.break_scales: dict[int, float] = {}  # per size: a break's cost as served / as measured
        self.sync_scales: dict[int, float] = {}  # per size: a synchronous mixed verify step as served / the table
        self.version = 0  # moves whenever a size is measured (what was derived from the table may be stale)

    def cost(self, n: int, rows: int, verify: bool) -> float:
        return self.table_cost(n, rows, verify) * (self.scale(self.size_of(n)) if verify else 1.0)

    def table_cost(self, n: int, rows: int, verify: bool) -> float:
        """cost() as the table has it, without the calibration's scale."""
        size = self.size_of(n)
        costs = self.at(size)
        beyond = max(n / size, 1.0)  # beyond the grid: the largest size's cost per request
        if not verify:
            return costs[0] * beyond
        return _interpolate(costs[1:], rows / n) * beyond

    def verify_curve(self, n: int, rows: np.ndarray) -> np.ndarray:
        """cost(n, rows[i], verify=True) for every entry of `rows`, at once."""
        size = self.size_of(n)
        values = np.asarray(self.at(size)[1:])
        k = np.asarray(rows, dtype=np.float64) / n
        width = len(values)
        inside = np.interp(k, np.arange(1, width + 1), values)
        return np.where(k > width, values[-1] * k / width, inside) * max(n / size, 1.0) * self.scale(size)

    def scale(self, size: int) -> float:
        return self.scales.get(size, 1.0)

    def set_scale(self, size: int, factor: float) -> None:
        self.scales[size] = factor
        self.version += 1  # what the policy derived from the table is stale

    def size_of(self, n: int) -> int:
        """The grid size whose measurements a step of n requests uses (the smallest >= n, or the largest)."""
        return self.sizes[min(bisect.bisect_left(self.sizes, n), len(self.sizes) - 1)]

    def break_cost(self, n: int) -> float:
        return self.table_break_cost(n) * self.break_scales.get(self.size_of(n), 1.0)

    def table_break_cost(self, n: int) -> float:
        """break_cost() as measured at start-up, without the calibration's scale."""
        size = self.size_of(n)
        self.at(size)
        return self.breaks[size]

    def set_break_scale(self, size: int, factor: float) -> None:
        self.break_scales[size] = factor
        self.version += 1

    def sync_cost(self, n: int, rows: int) -> float:
        """A synchronous verify step of n decoding requests and `rows` verify rows that holds prompt tokens too (a
        mixed step that verifies): the table's verify step, scaled by what such steps took while serving (before
        any was timed, as calibrated verify steps cost)."""
        size = self.size_of(n)
        return self.table_cost(n, rows, verify=True) * self.sync_scales.get(size, self.scale(size))

    def set_sync_scale(self, size: int, factor: float) -> None:
        self.sync_scales[size] = factor  # (nothing derived from the table reads it: the version stays)

    def at(self, size: int) -> list[float]:
        if size not in self.measured:
            costs = self.measured[size] = list(self.measure_size(size))
            self.breaks[size] = max(float(self.measure_break(size)), 0.0) if self.measure_break is not None else 0.0
            self.version += 1
            for smaller in (n for n in self.measured if n < size):  # fewer requests never cost more
                self.measured[smaller] = [min(a, b) for a, b in zip(self.measured[smaller], costs)]
        return self.measured[size]

    def measure_all(self) -> None:
        for size in self.sizes:
            self.at(size)

    def table(self) -> str:
        """The sizes measured so far, in ms (a markdown table)."""
        if not self.measured:
            return "(no step measured yet)"
        width = len(next(iter(self.measured.values()))) - 1
        head = "| requests | plain | " + " | ".join(f"verify x{k + 1}" for k in range(width)) + " |"
        rows = [f"| {n} | " + " | ".join(f"{c * 1e3:.3f}" for c in self.measured[n]) + " |"
                for n in sorted(self.measured)]
        return "\n".join([head, "|---" * (width + 2) + "|", *rows])


def _interpolate(values: Sequence[float], k: float) -> float:
    if k <= 1:
        return values[0]
    if k >= len(values):
        return values[-1] * k / len(values)
    lo = int(k)
    w = k - lo
    return values[lo - 1] * (1 - w) + values[lo] * w
