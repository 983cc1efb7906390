"""Rank 0 of a served engine as a leader: the front end's commands in, one EngineGroup round each step, reports out.

    front end (HTTP process)  --Round of commands, one a batch-->  Leader (rank 0): queue them on the EngineGroup
                                                                    a round on every rank (see group.py)
    front end  <--RoundReport, one message per round------------  what each request gained, call outcomes, stats

The leader sends EngineFacts once at start-up: all the front end knows of the engine besides the reports.
While no rank has work it blocks on its connection; with several ranks it runs an empty round now and then,
so the followers' wait stays within the collective timeout. With one rank a failed step fails the requests
it was running and the leader carries on; with several the ranks can no longer agree, so it stops and says why.
"""

from __future__ import annotations

import logging
import pickle
import select
from multiprocessing.connection import Connection
from typing import Any, Callable

import attrs

from ..config import EngineConfig
from ..messages import Abort, Admit, Call, Failure, GroupReport, Halted, LoopStats, Round, RoundReport, SendKV
from .group import EngineGroup

log = logging.getLogger("moeplex.server")


@attrs.frozen
class EngineFacts:
    """What the front end needs of the engine, fixed at start-up."""

    config: EngineConfig
    hf_config: dict
    vocab_size: int
    capacity_tokens: int  # the longest sequence every DP group's KV cache can hold
    world_size: int
    attn_tp_size: int
    ranks: tuple[dict, ...]  # every rank's place and memory
    stats: LoopStats  # before the first round

    @classmethod
    def of(cls, group: EngineGroup) -> "EngineFacts":
        engine = group.engine
        return cls(
            engine.config, engine.model.hf_config, engine.vocab_size, group.capacity_tokens, group.size,
            group.parallel.config.attn_tp_size, tuple(group.ranks), LoopStats(tuple(group.stats), tuple(group.admitted), 0, 0),
        )

    def group_ranks(self, dp_rank: int) -> list[int]:
        size = self.attn_tp_size
        return list(range(dp_rank * size, (dp_rank + 1) * size))


class Leader:
    def __init__(self, group: EngineGroup, connection: Connection, on_round: Callable[[], None] = lambda: None):
        """`on_round` is called after each round (the heartbeat table's round count)."""
        self.group = group
        self.connection = connection
        # connection.poll builds a selector on every call (~5 us); the leader asks before every round
        self._commands = select.poll()
        self._commands.register(connection.fileno(), select.POLLIN)
        self.on_round = on_round
        self._halted = False
        self._steps = self._failed_steps = 0
        self._failures: list[Failure] = []
        self._outcomes: list[tuple[int, Any]] = []

    def run(self) -> None:
        """Rounds until the front end halts them; raises (after telling the front end) if they cannot go on."""
        try:
            while not self._halted:
                self._take_commands(block=not self.group.needs_round, wait=self.group.transfer_wait_s)
                # with several ranks an idle round is the keep-alive that the followers wait for
                if not self._halted and (self.group.needs_round or self.group.size > 1):
                    self._round()
            self.group.halt()
        except BaseException as exc:
            self._tell(Halted(f"{type(exc).__name__}: {exc}"))
            raise
        self._tell(Halted())

    def _take_commands(self, block: bool, wait: float = 0.0) -> None:
        """`wait`: with only transfers to poll, a moment for a command before the next round (no busy loop)."""
        if block and not self._arrived(self.group.keepalive_s):
            return
        if not block and wait and not self._arrived(wait):
            return
        while not self._halted and self._arrived(0):
            try:
                commands: Round = self.connection.recv()
            except EOFError:  # the front end has gone without a word: nobody is left to serve
                self._halted = True
                return
            for command in commands.commands:
                self._handle(command)
            self._halted = commands.halt

    def _arrived(self, timeout_s: float | None) -> bool:
        """Whether a message (or the end of the pipe) is there, waiting up to `timeout_s` (None: for ever)."""
        return bool(self._commands.poll(None if timeout_s is None else 1000 * timeout_s))

    def _handle(self, command) -> None:
        if isinstance(command, Admit):
            try:
                self.group.add_request(command.prompt_ids, command.params, rid=command.rid, room=command.room)
            except ValueError as exc:  # the front end checks first; the engine's own checks have the last word
                self._failures.append(Failure(command.rid, 400, str(exc)))
        elif isinstance(command, Abort):
            self.group.abort(command.rid)
        elif isinstance(command, SendKV):
            self.group.send_kv(command)
        elif isinstance(command, Call):
            self.group.call(command.method, command.args, lambda outcome, id=command.id: self._outcomes.append((id, outcome)))

    def _round(self) -> None:
        self._steps += 1
        try:
            reports = self.group.step()
        except Exception as exc:
            if self.group.size > 1:
                raise  # the other ranks are somewhere inside this step: nothing to carry on with
            self._failed_steps += 1
            log.exception("engine step failed; failing the requests it was running")
            message = f"engine step failed: {type(exc).__name__}: {exc}"
            # the step's batch came from the running requests; if none, the waiting ones broke it
            for rid in self.group.running_rids():
                self.group.abort(rid)
                self._failures.append(Failure(rid, 500, message))
            reports = []
        self.on_round()
        # plain pickle: Connection.send's pickler copies its table of reducers for every message (~5 us a round),
        # and a report needs none of them
        self.connection.send_bytes(pickle.dumps(self.report(reports), pickle.HIGHEST_PROTOCOL))

    def report(self, reports: list[GroupReport]) -> RoundReport:
        """The round's message to the front end (and the failures and call outcomes gathered since the last)."""
        updates = tuple(report.updates for report in reports if len(report.updates))
        stats = LoopStats(tuple(self.group.stats), tuple(self.group.admitted), self._steps, self._failed_steps)
        book = self.group.book
        transfers = book.stats() if book is not None else None
        landed = book.take_landed() if book is not None else ()
        report = RoundReport(updates, tuple(self._failures), tuple(self._outcomes), stats, tuple(self.group.reserved),
                             transfers, landed)
        self._failures, self._outcomes = [], []
        return report

    def _tell(self, message: Halted) -> None:
        try:
            self.connection.send(message)
        except OSError:  # the front end has gone
            pass
