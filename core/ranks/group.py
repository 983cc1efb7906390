"""One engine over every rank, driven from rank 0 one round at a time (what `moeplex serve` runs).

Rank 0 queues commands between rounds: a new request goes to the DP group whose prefix cache likely
holds most of it, or to the least-loaded group (see dp_dispatch.py); aborts and engine calls follow in
arrival order.
step() runs a round on every rank (see worker.py) and returns each DP group's report, whose
Updates the leader passes on: the request itself lives on its ranks only, and the front end keeps
the one copy its clients are served from. With one rank the same code runs without a collective, so a
single-process server is the same path.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ..disagg.book import TransferBook
from ..engine import Engine
from ..kv_cache import KVPool
from ..messages import Abort, Admit, Call, GroupReport, GroupStats, Round, SendKV
from ..request import check_prompt
from ..sampling import SamplingParams
from .dp_dispatch import DPDispatch
from .worker import Channel, RankWorker, rank_info

CACHE_FLUSHES = ("flush_cache", "reset_prefix_cache")  # engine calls that empty every group's cache when they return True


class EngineGroup:
    def __init__(self, engine: Engine):
        """Every rank of the engine must be at start-up too (a Follower on ranks 1..N-1)."""
        self.engine = engine
        self.parallel = engine.parallel
        self.worker = RankWorker(engine)
        self.channel = Channel(engine.parallel)
        self.ranks: list[dict] = self.channel.gather(rank_info(engine))  # every rank's place and memory
        self.dp_size = self.parallel.config.dp_size
        self.stats = [self._initial_stats(dp) for dp in range(self.dp_size)]
        self.admitted = [0] * self.dp_size  # requests each DP group was given, since start-up
        self.has_work = False  # whether any rank still had requests after the last round
        self._unfinished: dict[str, tuple[int, list[int]]] = {}  # rid -> (DP group, token ids so far if several)
        self.dispatch = DPDispatch(self.dp_size, self.capacity_tokens, not engine.config.disable_prefix_cache)
        self._queued: list = []
        self._call_done: list[Callable[[Any], None]] = []  # one per queued Call
        # prefill/decode disaggregation: the state and deadline of every request that moves KV
        self.book = self._transfer_book(engine) if engine.pd is not None else None
        self.reserved: list[tuple[str, int, tuple[int, ...]]] = []  # decode pages reserved in the last round
        self.quiet = False  # the last round changed no request (only transfers were waited on)

    # --- the shape of the group ------------------------------------------------------------------
    @property
    def size(self) -> int:
        return self.parallel.world.size

    @property
    def capacity_tokens(self) -> int:
        """The longest sequence every DP group's KV cache can hold."""
        return min(info["kv_cache_tokens"] for info in self.ranks)

    @property
    def keepalive_s(self) -> float | None:
        """How long rank 0 may wait for a command before it sends an empty round (None: forever)."""
        return None if self.size == 1 else self.parallel.config.timeout_s / 3

    def group_ranks(self, dp_rank: int) -> list[int]:
        size = self.parallel.config.attn_tp_size
        return list(range(dp_rank * size, (dp_rank + 1) * size))

    # --- between rounds ---------------------------------------------------------------------------
    @property
    def needs_round(self) -> bool:
        return self.has_work or bool(self._queued) or (self.book is not None and self.book.pending)

    @property
    def transfer_wait_s(self) -> float:
        """How long the leader may wait for a command before a round that would only poll transfers."""
        return 0.002 if self.quiet and self.book is not None and self.book.pending else 0.0

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, rid: str, room: int | None = None) -> None:
        """Queue the request for its DP group's next round; ValueError if some group could not hold it."""
        prompt_ids = tuple(prompt_ids)
        check_prompt(prompt_ids, self.engine.vocab_size, self.capacity_tokens)
        if room is not None and self.book is None:
            raise ValueError("a bootstrap room needs --disaggregation-mode prefill or decode")
        if self.dp_size == 1:  # one group: nothing to choose, no token to count
            dp_rank, ids = 0, []
        else:
            dp_rank, ids = self.dispatch.choose(prompt_ids, *self._loads()), list(prompt_ids)
            self.dispatch.will_cache(dp_rank, prompt_ids)
        self._unfinished[rid] = (dp_rank, ids)
        self._queued.append(Admit(rid, prompt_ids, params, dp_rank, room))
        self.admitted[dp_rank] += 1
        if room is not None:
            self.book.admitted(rid, dp_rank, room, len(prompt_ids))

    def abort(self, rid: str) -> None:
        """Drop the request (its pages are freed in the next round); nothing more is reported of it.
        A prefilled request whose pages are held for a transfer is dropped too (its transfer ends)."""
        entry = self._unfinished.pop(rid, None)
        moving = self.book.drop(rid) if self.book is not None else None
        if entry is not None:
            self._queued.append(Abort(rid, entry[0]))
        elif moving is not None:
            self._queued.append(Abort(rid, moving.dp_rank))

    def send_kv(self, command: SendKV) -> bool:
        """Prefill: the decode side's destination for a request; False if the request is not (or no longer) here."""
        entry = self.book.entries.get(command.rid) if self.book is not None else None
        if entry is None or not self.book.destination(command.rid, len(command.peers)):
            return False
        self._queued.append(SendKV(command.rid, command.dst_pages, command.peers, entry.dp_rank))
        return True

    def call(self, method: str, args: tuple, done: Callable[[Any], None]) -> None:
        """engine.<method>(*args) on every rank in the next round; done(rank 0's result or exception)."""
        if method in CACHE_FLUSHES:
            done = self._forgetting_on_flush(done)
        self._queued.append(Call(method, tuple(args)))
        self._call_done.append(done)

    def _forgetting_on_flush(self, done: Callable[[Any], None]) -> Callable[[Any], None]:
        def settle(outcome: Any) -> None:
            if outcome is True:  # the caches are empty: so is what rank 0 guesses of them
                self.dispatch.forget()
            done(outcome)
        return settle

    def drop_queued_calls(self, error: Exception) -> None:
        """No round will run them (the loop is stopping): each queued Call is answered with `error`."""
        done, self._call_done = self._call_done, []
        self._queued = [c for c in self._queued if not isinstance(c, Call)]
        for settle in done:
            settle(error)

    # --- rounds ----------------------------------------------------------------------------------
    def step(self) -> list[GroupReport]:
        """One round on every rank: the queued commands, one engine step; the DP groups' progress (also absorbed)."""
        self.reserved = []
        if self.book is not None:
            self._queued.extend(self.book.decide())
        round_ = Round(tuple(self._queued))
        done, self._queued, self._call_done = self._call_done, [], []
        self.channel.share(round_)
        for settle, outcome in zip(done, self.worker.apply(round_.commands)):
            settle(outcome)
        self.worker.step()
        reports = self.channel.collect(self.worker.report())
        self._absorb(reports)
        if self.book is not None:
            self.reserved = self.book.absorb(reports)
            polls = self.worker.polls()
            self.book.absorb_polls(self.channel.collect_polls(polls) if self.size > 1 else [polls])
            self.quiet = not (round_.commands or self.reserved or any(len(r.updates) for r in reports))
        return reports

    def halt(self) -> None:
        """Release the followers (rank 0 is stopping)."""
        if self.size > 1:
            self.channel.share(Round(halt=True))

    def running_rids(self) -> list[str]:
        """The requests this rank's engine was stepping (or, if none, waiting to step)."""
        scheduler = self.engine.scheduler
        return [r.rid for r in list(scheduler.running) or list(scheduler.waiting)]

    def _absorb(self, reports: list[GroupReport]) -> None:
        for report in reports:
            self.stats[report.dp_rank] = report.stats
            updates = report.updates
            if self.dp_size > 1:  # the loads and the caches' mirror that choose a group count every token
                for rid, ids in updates.new_ids():
                    entry = self._unfinished.get(rid)
                    if entry is not None:  # else aborted meanwhile
                        entry[1].extend(ids)
            for rid, *_ in updates.finished():
                entry = self._unfinished.pop(rid, None)
                if entry is not None:
                    self.dispatch.will_cache(entry[0], entry[1])  # a finished request's KV joins its group's cache
        self.has_work = any(report.has_work for report in reports)

    def _loads(self) -> tuple[list[int], list[int]]:
        """Each DP group's unfinished requests and their tokens so far."""
        requests, tokens = [0] * self.dp_size, [0] * self.dp_size
        for dp_rank, ids in self._unfinished.values():
            requests[dp_rank] += 1
            tokens[dp_rank] += len(ids)
        return requests, tokens

    def _transfer_book(self, engine: Engine) -> TransferBook:
        page_bytes = KVPool.bytes_per_token(engine.model.kv_shapes(), engine.config.torch_dtype) * engine.kv.page_size
        return TransferBook(engine.config, page_bytes, self.parallel.config.attn_tp_size)

    def _initial_stats(self, dp_rank: int) -> GroupStats:
        info = self.ranks[self.group_ranks(dp_rank)[0]]
        page_size = self.engine.kv.page_size
        pages = info["kv_cache_tokens"] // page_size
        return GroupStats(kv_pages_total=pages, kv_pages_free=pages, page_size=page_size)
