"""Noticing a rank that stopped answering (SIGSTOP, a hung kernel, a stuck collective) long before the
collective timeout, and naming it.

    every local rank    a heartbeat thread writes its clock into RankBeats every BEAT_S; its loop counts rounds
    the front end       Watchdog: work pending and no round report for --stall-timeout -> the engine is stalled:
                        /health says 503 with the reason, the requests in flight fail naming the rank

A stopped process stops its heartbeat with it; a live rank stuck inside a round still beats, so then the rank
with fewest rounds is the one the others wait for.
"""

from __future__ import annotations

import multiprocessing
import threading
import time

BEAT_S = 0.5
SILENT_AFTER_S = 3.0  # a heartbeat this old means the rank's process is not running


class RankBeats:
    """Per local rank: the last heartbeat (time.monotonic(), one clock for every process of a machine) and rounds run.
    Shared memory, made before the ranks are spawned and handed to each."""

    def __init__(self, num_ranks: int, first_rank: int = 0):
        self.first_rank = first_rank
        self.num_ranks = num_ranks
        self.table = multiprocessing.get_context("spawn").Array("d", 2 * num_ranks, lock=False)

    # --- in a rank process ------------------------------------------------------------------------
    def start_beating(self, rank: int) -> None:
        slot = rank - self.first_rank
        self.table[2 * slot] = time.monotonic()
        threading.Thread(target=self._beat, args=(slot,), name="moeplex-heartbeat", daemon=True).start()

    def _beat(self, slot: int) -> None:
        while True:
            self.table[2 * slot] = time.monotonic()
            time.sleep(BEAT_S)

    def round_done(self, rank: int) -> None:
        self.table[2 * (rank - self.first_rank) + 1] += 1

    # --- in the front end -------------------------------------------------------------------------
    def who_stopped(self) -> str:
        """The ranks that stopped answering, as a sentence."""
        now = time.monotonic()
        beats = [self.table[2 * i] for i in range(self.num_ranks)]
        rounds = [int(self.table[2 * i + 1]) for i in range(self.num_ranks)]
        silent = [i for i, beat in enumerate(beats) if beat and now - beat > SILENT_AFTER_S]
        if silent:
            return ", ".join(f"rank {self.first_rank + i} stopped answering (no heartbeat for {now - beats[i]:.0f} s)"
                             for i in silent)
        behind = [i for i, r in enumerate(rounds) if r < max(rounds)]
        if behind:
            return ", ".join(f"rank {self.first_rank + i} stopped answering (stuck after round {rounds[i]}, the others "
                             f"ran {max(rounds)})" for i in behind)
        return "every rank is alive but the round has not finished"


class Watchdog:
    """The front end's view of engine progress: stalled (with a reason) when work waits and no round comes back."""

    def __init__(self, beats: RankBeats | None, stall_timeout: float):
        self.beats = beats
        self.stall_timeout = stall_timeout
        self.last_report = time.monotonic()
        self.stalled: str | None = None  # why the engine is stalled now
        self.blamed: str | None = None  # the last stall's reason, kept for the final error if the engine stops

    def reported(self) -> None:
        """A round came back (or work arrived after an idle spell, when no round was due)."""
        self.last_report = time.monotonic()
        self.stalled = None

    def check(self, work_pending: bool) -> str | None:
        """A newly found stall's reason (once per stall); the current one stays in `stalled`."""
        waited = time.monotonic() - self.last_report
        if self.stalled is not None or not work_pending or waited < self.stall_timeout:
            return None
        who = self.beats.who_stopped() if self.beats is not None else "the engine stopped answering"
        self.stalled = self.blamed = f"no engine step for {waited:.0f} s with requests waiting: {who}"
        return self.stalled
