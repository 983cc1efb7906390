"""What every rank of a served engine does each round: apply rank 0's commands, step, report progress.

    rank 0 (EngineGroup)                      every rank (a RankWorker; a Follower drives it on ranks 1..N-1)
    the commands since the last round  --broadcast-->  apply those for this rank's DP group (and every Call)
                                                       engine.step(), all ranks in lockstep
    what each request gained, to the front  <--gather--  each DP group's output rank: its Updates

Without DP attention there is one DP group: every rank applies every command and rank 0 reports for the
group itself, so nothing is gathered.
"""

from __future__ import annotations

import base64
import logging
import os
from typing import Callable

import torch.distributed as dist

from ..disagg.layout import KVLayout
from ..engine import Engine
from ..memory import memory_report
from ..messages import Abort, Admit, Call, EndTransfer, GroupReport, GroupStats, Round, SendKV, Updates
from ..parallel import ParallelState
from ..request import FinishReason, Request
from ..tokenizer import text_while_running

log = logging.getLogger(__name__)


def group_stats(engine: Engine) -> GroupStats:
    scheduler, kv, cache = engine.scheduler, engine.kv, engine.prefix_cache
    counts = (len(scheduler.running), len(scheduler.waiting), kv.num_pages, kv.num_free_pages, kv.page_size)
    spec = engine.speculation
    extra = {} if spec is None else dict(
        spec_verify_steps=spec.counts.verify_steps, spec_plain_steps=spec.counts.plain_steps,
        spec_drafts=spec.counts.drafts, spec_drafting=spec.counts.drafting,
    )
    extra.update(grammar_mask_waits=engine.grammar.mask_waits, grammar_mask_wait_seconds=engine.grammar.mask_wait_seconds,
                 engine_steps=engine.step_log.totals(), overlap_breaks=engine.step_log.break_totals())
    if engine.calibration is not None:
        extra.update(verify_cost_scales=tuple(sorted(engine.step_costs.scales.items())),
                     break_cost_scales=tuple(sorted(engine.step_costs.break_scales.items())),
                     mixed_verify_cost_scales=tuple(sorted(engine.step_costs.sync_scales.items())))
    if cache is None:
        return GroupStats(*counts, **extra)
    return GroupStats(*counts, cache.num_pages, cache.queried_tokens, cache.hit_tokens, cache.evicted_pages,
                      cache.evictable_pages, **extra)


class _Seen:
    """How much of one request rank 0 has been told about."""

    __slots__ = ("request", "ids", "logprobs", "text", "cached", "spec", "prompt_sent", "sends_text")

    def __init__(self, request: Request):
        self.request = request
        self.ids = self.logprobs = self.text = self.cached = 0
        # the engine grows the text only where stop strings or a constraint need it; the front end makes the rest
        self.sends_text = text_while_running(request.params)
        self.spec = (0, 0, 0)
        self.prompt_sent = request.params.prompt_logprobs is None  # nothing to send


class UpdateLog:
    """What an output rank's requests gained since the last round, as one Updates message (one row per request with
    something new): a few list appends per request that grew, the rest only where something rarer happened."""

    def __init__(self, speculates: bool):
        self.speculates = speculates  # spec counts change only with a drafter: otherwise they are never compared
        self._seen: dict[str, _Seen] = {}
        self._refused: list[tuple[str, str]] = []  # (rid, why) of requests this rank could not admit

    def track(self, request: Request) -> None:
        self._seen[request.rid] = _Seen(request)

    def forget(self, rid: str) -> None:
        self._seen.pop(rid, None)

    def refused(self, rid: str, why: str) -> None:
        self._refused.append((rid, why))

    def take(self) -> Updates:
        rids, ids, counts, texts = [], [], [], []
        cuts, logprobs, ends, cached, spec, prompt = {}, {}, {}, {}, {}, {}
        one_each = True
        done = []
        for seen in self._seen.values():
            r = seen.request
            out, text = r.output_ids, r.text if seen.sends_text else ""
            n, t = len(out), len(text)
            if n == seen.ids and t == seen.text and r.finish_reason is None and len(r.logprobs) == seen.logprobs:
                continue
            row = len(rids)
            rids.append(r.rid)
            grew = n - seen.ids
            if grew == 1:
                ids.append(out[-1])
            else:
                ids.extend(out[seen.ids :])
                one_each = False
            counts.append(grew)
            text_from = seen.text
            if t < text_from:  # a stop string cut what was reported
                text_from = cuts[row] = t
            texts.append(text[text_from:])
            seen.ids, seen.text = n, t
            if len(r.logprobs) != seen.logprobs:
                logprobs[row] = tuple(r.logprobs[seen.logprobs :])
                seen.logprobs = len(r.logprobs)
            if r.cached_tokens != seen.cached:
                cached[row] = seen.cached = r.cached_tokens
            if not seen.prompt_sent and r.prompt_logprobs_done:
                prompt[row], seen.prompt_sent = tuple(r.prompt_logprobs), True
            if self.speculates and r.spec_counts != seen.spec:
                spec[row] = seen.spec = r.spec_counts
            if r.finish_reason is not None:
                ends[row] = (r.finish_reason, r.stop_reason, r.error)
                done.append(r.rid)
        for rid in done:
            del self._seen[rid]
        refused, self._refused = self._refused, []
        for rid, why in refused:
            ends[len(rids)] = (FinishReason.ABORT, None, why)
            rids.append(rid)
            counts.append(0)
            texts.append("")
            one_each = False
        return Updates(tuple(rids), tuple(ids), () if one_each else tuple(counts), tuple(texts), cuts, logprobs, ends,
                       cached, spec, prompt)


# --- every rank -----------------------------------------------------------------------------------


class RankWorker:
    """This rank's engine under rank 0's commands; on an output rank, also what its DP group reports."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.parallel: ParallelState = engine.parallel
        self.log = UpdateLog(engine.speculation is not None)

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
                self.log.forget(command.rid)
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
        reserved = self.engine.pd.take_reserved() if self.engine.pd is not None else ()
        return GroupReport(self.parallel.dp_rank, self.log.take(), self.engine.has_work, group_stats(self.engine), reserved)

    def _admit(self, command: Admit) -> None:
        try:
            request = self.engine.add_request(command.prompt_ids, command.params, rid=command.rid, room=command.room,
                                              stream_text=False)  # the front end detokenizes what it streams
        except ValueError as exc:  # rank 0 checks first, so a refusal here is a fault: fail the request
            self.log.refused(command.rid, str(exc))
            return
        if self.parallel.is_output_rank:
            self.log.track(request)

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
