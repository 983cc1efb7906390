"""The leader's book of every request that moves KV: its state, its deadline, and the decisions the ranks apply.

States (docs/pd.md):
    prefill  bootstrapping (no destination yet) -> waiting (destination known, prefill running)
             -> transferring (pages sent) -> done | failed
    decode   bootstrapping (no pages reserved yet) -> waiting (pages reserved and registered, KV not landed) -> done | failed

Only the leader reads clocks and combines the ranks' polls; its decisions (EndTransfer) go out in the next round,
so every rank of a group frees or admits in the same step.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Callable

import attrs

from ..messages import EndTransfer, GroupReport

BOOTSTRAPPING, WAITING, TRANSFERRING, DONE, FAILED = "bootstrapping", "waiting", "transferring", "done", "failed"
STATES = (BOOTSTRAPPING, WAITING, TRANSFERRING)


@attrs.frozen
class TransferStats:
    """What /metrics and /get_server_info show of the transfers."""

    role: str
    states: dict  # live requests per state
    outcomes: dict  # transfers ended, per outcome (done, failed, timeout)
    bytes: int  # moved by transfers that finished
    seconds: float  # their summed duration, start to done


@attrs.define
class Entry:
    dp_rank: int
    state: str
    deadline: float
    room: int
    senders: int = 1  # ranks whose polls must all say done
    prefilled: bool = False
    has_destination: bool = False
    pages: int = 0  # prompt pages that move (per sending rank)
    started: float = 0.0


class TransferBook:
    def __init__(self, config, page_bytes: int, attn_tp_size: int, clock: Callable[[], float] = time.monotonic):
        self.prefill = config.disaggregation_mode == "prefill"
        self.role = config.disaggregation_mode
        self.bootstrap_s = config.disaggregation_bootstrap_timeout
        self.transfer_s = config.disaggregation_transfer_timeout
        self.lease_s = config.disaggregation_lease
        self.page_bytes = page_bytes  # one page of every layer, on one rank
        self.attn_tp_size = attn_tp_size
        self.page_size = config.page_size
        self.clock = clock
        self.entries: dict[str, Entry] = {}
        self.outcomes: Counter = Counter()
        self.bytes = 0
        self.seconds = 0.0
        self._decisions: list[EndTransfer] = []
        self.landed: list[str] = []  # decode: requests whose KV arrived whole since the last report (P no longer needed)

    def __contains__(self, rid: str) -> bool:
        return rid in self.entries

    def admitted(self, rid: str, dp_rank: int, room: int, prompt_len: int) -> None:
        pages = -(-prompt_len // self.page_size)
        self.entries[rid] = Entry(dp_rank, BOOTSTRAPPING, self.clock() + self.bootstrap_s, room, pages=pages)

    def destination(self, rid: str, senders: int) -> bool:
        """Prefill: the decode side's pages are known; False if the request is not (or no longer) here."""
        entry = self.entries.get(rid)
        if entry is None:
            return False
        entry.has_destination, entry.senders = True, senders
        if entry.state == BOOTSTRAPPING:
            entry.state = WAITING
            self._maybe_transferring(entry)
        return True

    def drop(self, rid: str) -> Entry | None:
        return self.entries.pop(rid, None)

    # --- after each round ---------------------------------------------------------------------------------
    def absorb(self, reports: list[GroupReport]) -> list[tuple[str, int, tuple[int, ...]]]:
        """Reports in; the decode pages reserved this round (for the front end to register) out."""
        reserved = []
        for report in reports:
            for rid, pages in report.reserved:
                entry = self.entries.get(rid)
                if entry is not None:
                    entry.state, entry.deadline, entry.started = WAITING, self.clock() + self.transfer_s, self.clock()
                    entry.senders = self.attn_tp_size
                    reserved.append((rid, report.dp_rank, pages))
            for rid, reason, _, error in report.updates.finished():
                entry = self.entries.get(rid)
                if entry is None:
                    continue
                if self.prefill and error is None and reason != "abort":
                    entry.prefilled = True
                    self._maybe_transferring(entry)
                else:  # it ended on its ranks before its transfer did (it failed there, or was aborted)
                    self.outcomes[FAILED] += 1
                    del self.entries[rid]
        return reserved

    def absorb_polls(self, polls: list[dict[str, str]]) -> None:
        """Every rank's polls: failed if any rank failed, done once every sending rank is done."""
        done: Counter = Counter()
        for rank_polls in polls:
            for rid, status in rank_polls.items():
                entry = self.entries.get(rid)
                if entry is None:
                    continue
                if status.startswith(FAILED):
                    why = status.partition(": ")[2] or "the transfer backend reported it"
                    self._end(rid, entry, False, FAILED, f"the KV transfer failed ({why})")
                elif status == DONE:
                    done[rid] += 1
        for rid, count in done.items():
            entry = self.entries.get(rid)
            if entry is not None and count >= entry.senders:
                self.bytes += entry.pages * self.page_bytes * entry.senders
                self.seconds += self.clock() - entry.started
                self._end(rid, entry, True, DONE, None)

    def decide(self) -> list[EndTransfer]:
        """The decisions for the next round: what the polls settled, and every deadline that passed."""
        now = self.clock()
        for rid, entry in list(self.entries.items()):
            if now < entry.deadline:
                continue
            self._end(rid, entry, False, "timeout", self._late(entry))
        decisions, self._decisions = self._decisions, []
        return decisions

    def stats(self) -> TransferStats:
        states = Counter(e.state for e in self.entries.values())
        return TransferStats(self.role, {s: states.get(s, 0) for s in STATES}, dict(self.outcomes), self.bytes, self.seconds)

    def take_landed(self) -> tuple[str, ...]:
        landed, self.landed = tuple(self.landed), []
        return landed

    @property
    def pending(self) -> bool:
        return bool(self.entries)

    # --- inside ---------------------------------------------------------------------------------------------
    def _maybe_transferring(self, entry: Entry) -> None:
        if self.prefill and entry.prefilled and entry.has_destination and entry.state != TRANSFERRING:
            entry.state, entry.deadline, entry.started = TRANSFERRING, self.clock() + self.lease_s, self.clock()
        elif self.prefill and entry.prefilled and not entry.has_destination:
            entry.deadline = min(entry.deadline, self.clock() + self.lease_s)

    def _late(self, entry: Entry) -> str:
        if entry.state == BOOTSTRAPPING and self.prefill:
            return f"no decode server registered this request's bootstrap room within {self.bootstrap_s:g} s"
        if entry.state == BOOTSTRAPPING:
            return f"no KV pages for this request came free within {self.bootstrap_s:g} s"
        if self.prefill:
            return f"the decode server did not confirm the KV transfer within the {self.lease_s:g} s lease"
        return f"the KV transfer did not finish within {self.transfer_s:g} s"

    def _end(self, rid: str, entry: Entry, ok: bool, outcome: str, reason: str | None) -> None:
        entry.state = DONE if ok else FAILED
        self.outcomes[outcome] += 1
        self._decisions.append(EndTransfer(rid, ok, reason, entry.dp_rank))
        if ok and not self.prefill:
            self.landed.append(rid)
        del self.entries[rid]  # prefill: the source pages go with this decision; decode: it decodes (or fails)
