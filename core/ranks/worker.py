"""What every rank of a served engine does each round: apply rank 0's commands, step, report progress.

    rank 0 (EngineGroup)                      every rank (a RankWorker; a Follower drives it on ranks 1..N-1)
    the commands since the last round  --broadcast-->  apply those for this rank's DP group (and every Call)
                                                       engine.step(), all ranks in lockstep
    what each request gained, to the front  <--gather--  each DP group's output rank: its RequestUpdates

Without DP attention there is one DP group: every rank applies every command and rank 0 reports for the
group itself, so nothing is gathered.
"""

from __future__ import annotations

import base64
import logging
import os
from typing import Callable

import attrs
import torch.distributed as dist

from ..disagg.layout import KVLayout
from ..engine import Engine
from ..memory import memory_report
from ..messages import Abort, Admit, Call, EndTransfer, GroupReport, GroupStats, RequestUpdate, Round, SendKV
from ..parallel import ParallelState
from ..request import FinishReason, Request

log = logging.getLogger(__name__)


def group_stats(engine: Engine) -> GroupStats:
    scheduler, kv = engine.scheduler, engine.kv
    stats = GroupStats(len(scheduler.running), len(scheduler.waiting), kv.num_pages, kv.num_free_pages, kv.page_size)
    cache = engine.prefix_cache
    if cache is None:
        return stats
    return attrs.evolve(
        stats, kv_pages_cached=cache.num_pages, cache_queried_tokens=cache.queried_tokens,
        cache_hit_tokens=cache.hit_tokens, cache_evicted_pages=cache.evicted_pages,
    )


class _Reported:
    """How much of one request rank 0 has been told about."""

    def __init__(self, request: Request):
        self.request = request
        self.ids = self.logprobs = self.text = 0

    def update(self) -> RequestUpdate | None:
        r = self.request
        text_from = min(self.text, len(r.text))
        grew = len(r.output_ids) > self.ids or len(r.logprobs) > self.logprobs or len(r.text) != self.text
        if not (grew or r.finished):
            return None
        update = RequestUpdate(
            r.rid, tuple(r.output_ids[self.ids :]), tuple(r.logprobs[self.logprobs :]), text_from, r.text[text_from:],
            r.finish_reason, r.stop_reason, r.error, r.cached_tokens, r.spec_counts,
        )
        self.ids, self.logprobs, self.text = len(r.output_ids), len(r.logprobs), len(r.text)
        return update


# --- every rank -----------------------------------------------------------------------------------


class RankWorker:
    """This rank's engine under rank 0's commands; on an output rank, also what its DP group reports."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.parallel: ParallelState = engine.parallel
        self._reported: dict[str, _Reported] = {}
        self._refused: list[RequestUpdate] = []

    def apply(self, commands) -> list:
        """Apply one round's commands in order; the outcome of each Call (a value or the exception raised)."""
        outcomes = []
        for command in commands:
            if isinstance(command, Call):
                outcomes.append(self._call(command))
            elif command.dp_rank != self.parallel.dp_rank:
                continue  # another DP group's request
            elif isinstance(command, Admit):
                self._admit(command)
            elif isinstance(command, Abort):
                self.engine.abort(command.rid)
                self._reported.pop(command.rid, None)
            elif isinstance(command, SendKV):
                self.engine.pd.send_to(command)
            elif isinstance(command, EndTransfer):
                self.engine.pd.end(command)
        return outcomes

    @property
    def moves_kv(self) -> bool:
        """Whether this engine is one role of a disaggregated pair (its ranks' transfer polls reach the leader)."""
        return self.engine.pd is not None

    def polls(self) -> dict[str, str]:
        return self.engine.pd.polls() if self.engine.pd is not None else {}

    def step(self) -> None:
        self.engine.step()

    def report(self) -> GroupReport | None:
        if not self.parallel.is_output_rank:
            return None
        updates, self._refused = self._refused, []
        for rid, reported in list(self._reported.items()):
            update = reported.update()
            if update is not None:
                updates.append(update)
            if reported.request.finished:
                del self._reported[rid]
        reserved = self.engine.pd.take_reserved() if self.engine.pd is not None else ()
        return GroupReport(self.parallel.dp_rank, tuple(updates), self.engine.has_work, group_stats(self.engine), reserved)

    def _admit(self, command: Admit) -> None:
        try:
            request = self.engine.add_request(command.prompt_ids, command.params, rid=command.rid, room=command.room)
        except ValueError as exc:  # rank 0 checks first, so a refusal here is a fault: fail the request
            self._refused.append(RequestUpdate(command.rid, finish_reason=FinishReason.ABORT, error=str(exc)))
            return
        if self.parallel.is_output_rank:
            self._reported[request.rid] = _Reported(request)

    def _call(self, call: Call):
        try:
            return getattr(self.engine, call.method)(*call.args)
        except Exception as exc:  # rank 0 answers the caller; every rank refuses alike
            return exc


def rank_info(engine: Engine) -> dict:
    """This rank's place and memory, as /get_server_info shows it (and its transfer endpoint, disaggregated)."""
    info = {**memory_report(engine), "dp_rank": engine.parallel.dp_rank, "pid": os.getpid()}
    if engine.pd is not None:
        info["kv_transfer_endpoint"] = base64.b64encode(engine.pd.endpoint()).decode()
        info["kv_layout"] = KVLayout.of(engine).to_json()
    return info


class Channel:
    """Rank 0's rounds out to every rank and the DP groups' reports back: object collectives over the world."""

    def __init__(self, parallel: ParallelState):
        self.parallel = parallel
        self.world = parallel.world

    def share(self, round_: Round | None) -> Round:
        """Rank 0 passes its round; every other rank waits for it here."""
        if self.world.size == 1:
            return round_
        box = [round_]
        dist.broadcast_object_list(box, src=0, group=self.world.host_group)
        return box[0]

    def collect(self, report: GroupReport | None) -> list[GroupReport]:
        """Every DP group's report, on rank 0 (with one DP group, rank 0's own is all there is)."""
        if self.parallel.config.dp_size == 1:
            return [report] if report is not None else []
        return [r for r in self.gather(report) if r is not None]

    def collect_polls(self, polls: dict[str, str]) -> list[dict[str, str]]:
        """Every rank's transfer polls, on rank 0 (a disaggregated engine gathers them after each round)."""
        return self.gather(polls)

    def gather(self, item) -> list:
        """Every rank's item, on rank 0 (an empty list elsewhere)."""
        if self.world.size == 1:
            return [item]
        everything = [None] * self.world.size if self.world.rank == 0 else None
        dist.gather_object(item, everything, dst=0, group=self.world.host_group)
        return everything or []


class Follower:
    """Ranks 1..N-1 of a served engine: rounds from rank 0 until it halts them.

    While idle, a follower waits inside the broadcast; rank 0 sends an empty round well within the
    collective timeout, so only a rank that is really gone makes that wait fail.
    """

    def __init__(self, engine: Engine, on_round: Callable[[], None] = lambda: None):
        """`on_round` is called after each round (the heartbeat table's round count)."""
        self.worker = RankWorker(engine)
        self.channel = Channel(engine.parallel)
        self.on_round = on_round
        self.channel.gather(rank_info(engine))  # rank 0 learns every rank's memory at start-up

    def run(self) -> None:
        while not (round_ := self.channel.share(None)).halt:
            for outcome in self.worker.apply(round_.commands):
                if isinstance(outcome, Exception):
                    log.debug("engine call refused on this rank: %s", outcome)
            self.worker.step()
            self.channel.collect(self.worker.report())
            if self.worker.moves_kv:
                self.channel.collect_polls(self.worker.polls())
            self.on_round()
