"""The HTTP side of the engine: requests out to the leader (rank 0), its round reports back into the HTTP calls.

    event loop  --a Round (what arrived since the last send, one message)-->  connection  -->  Leader (ranks/leader.py),
                                                                                in its own process, or on a thread
    event loop  <--RoundReport, one per round-- reader thread <-- connection <--  of this one for an in-process engine

The front end keeps a mirror of each request it admitted and brings it up to date from every report; then it
compares the mirrors with what each client has been sent (Progress) and pushes the difference to the asyncio
queue of the HTTP call that asked for it. The reader thread only receives: reports wait in an inbox, and one
wake-up of the event loop absorbs every report that arrived since the last, then pushes once per request, so a
front end that falls behind the engine sends one event per request for several steps instead of one per step
(its cost per token falls as the load rises). Everything but the reader thread's receive and inbox runs on the
event loop. If the leader stops without being asked (with several ranks, a rank failed), every request fails with
a 503 and `failure` says why.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
from multiprocessing.connection import Connection
from typing import Callable

from tokenizers import Tokenizer

from ..engine import Engine
from ..messages import Abort, Admit, Call, Failure, Halted, Round, RoundReport
from ..ranks.leader import EngineFacts, Leader
from ..request import Request, check_prompt
from ..tokenizer import front_end_detokenizer
from .metrics import ServerMetrics
from .outputs import Output, Ticket
from .progress import Progress
from .watchdog import Watchdog

log = logging.getLogger("moeplex.server")

SHUTTING_DOWN = "the server is shutting down"
VERDICT_WAIT_S = 10.0  # the launcher's stop grace (3 s) twice, and some: how long a rank's failure may take to be named


class EngineStopped(RuntimeError):
    """The leader stopped without being asked to (with several ranks: a rank failed or stopped answering)."""


class EngineLoop:
    def __init__(
        self,
        connection: Connection,
        facts: EngineFacts,
        metrics: ServerMetrics,
        on_stopped: Callable[[], None] | None = None,
        leader: Leader | None = None,
        watchdog: Watchdog | None = None,
        verdict: Callable[[float], str | None] | None = None,
        tokenizer: Tokenizer | None = None,
        stream_interval: int = 1,
    ):
        """`leader`: run it on a thread of this process (an in-process engine); None: it runs in another process.
        `on_stopped` is called on the event loop if the leader stops by itself (see `failure`). `verdict(timeout)`:
        the launcher's account of a rank's failure, which clients are told instead of the collective's own error
        (gloo's "[/__w/pytorch/...pair.cc:537] Read error" is what rank 0 sees when rank 1 dies). `tokenizer`: the
        model's, which turns the ids of the requests whose text the engine does not make into the text streamed.
        `stream_interval`: a request's outputs after its first hold at least this many tokens (or its end), unless
        its ticket names its own."""
        self.connection = connection
        self.facts = facts
        self.config = facts.config
        self.metrics = metrics
        self.on_stopped = on_stopped
        self.leader = leader
        self.watchdog = watchdog or Watchdog(None, 30.0)
        self.verdict = verdict
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.failure: EngineStopped | None = None  # why the leader stopped when nobody asked it to
        self.stats = facts.stats
        self._progress: dict[str, Progress] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._outbox: list = []
        self._inbox: collections.deque[RoundReport] = collections.deque()  # filled by the reader thread
        self._drain_due = False  # a _drain is scheduled on the event loop and has not started yet
        self._events: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []
        self._running = False
        self._halting = False
        self._halted: asyncio.Future | None = None
        self.pd = None  # the front end's side of disaggregation (disagg/frontend.py), set by the app
        self.transfers = None  # the leader's TransferStats, as of its last round

    @property
    def engine(self) -> Engine | None:
        """The in-process engine (rank 0's), if there is one."""
        return self.leader.group.engine if self.leader is not None else None

    # --- the event loop's side --------------------------------------------------------------------
    def start(self, events: asyncio.AbstractEventLoop) -> None:
        self._events = events
        self._halted = events.create_future()
        if self.leader is not None:
            self._threads.append(threading.Thread(target=_lead, args=(self.leader,), name="moeplex-leader", daemon=True))
        self._threads.append(threading.Thread(target=self._read, name="moeplex-reports", daemon=True))
        self._running = True
        for thread in self._threads:
            thread.start()
        self._events.call_later(self._watch_every, self._watch)

    @property
    def _watch_every(self) -> float:
        return min(1.0, self.watchdog.stall_timeout / 4)

    def _watch(self) -> None:
        if not self._running:
            return
        reason = self.watchdog.check(self.busy)
        if reason is not None:
            log.error("the engine is stalled: %s", reason)
            self.expire(reason)
        self._events.call_later(self._watch_every, self._watch)

    @property
    def busy(self) -> bool:
        """Requests or engine calls are waiting on the engine."""
        return bool(self._progress or self._calls)

    async def stop(self, timeout: float = 30.0) -> None:
        """Halt the leader (and through it every rank), then fail whatever is still running (503)."""
        if self._running and not self._halting:
            self._flush(halt=True)
            try:
                await asyncio.wait_for(asyncio.shield(self._halted), timeout)
            except asyncio.TimeoutError:
                log.warning("the engine did not halt within %.0f s", timeout)
        self._shut_down(SHUTTING_DOWN)
        for thread in self._threads:
            await asyncio.to_thread(thread.join, timeout)

    def expire(self, message: str) -> None:
        """Fail every request and call still in flight with a 503 saying `message` and drop the requests from the
        engine (the shutdown's drain time has run out, or the engine stalled: each client gets a reason)."""
        for rid in list(self._progress):
            self._fail(Failure(rid, 503, message))
            self._command(Abort(rid))
        calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(RuntimeError(message))

    @property
    def alive(self) -> bool:
        return self._running and not self._halting

    def submit(self, ticket: Ticket) -> None:
        if not self.alive:
            ticket.queue.put_nowait(Output.failure(ticket, 503, SHUTTING_DOWN))
            return
        if self.watchdog.stalled is not None:
            ticket.queue.put_nowait(Output.failure(ticket, 503, self.watchdog.stalled))
            return
        try:
            check_prompt(ticket.prompt_ids, self.facts.vocab_size, self.facts.capacity_tokens)
        except ValueError as exc:  # the engine's own checks: vocabulary, KV capacity
            self.metrics.finished.labels("rejected").inc()
            ticket.queue.put_nowait(Output.failure(ticket, 400, str(exc)))
            return
        mirror = Request(ticket.rid, list(ticket.prompt_ids), ticket.params)
        if not self.busy:
            self.watchdog.reported()  # idle until now: no round was due
        self._progress[ticket.rid] = Progress(mirror, ticket, front_end_detokenizer(self.tokenizer, ticket.params),
                                              ticket.stream_interval or self.stream_interval)
        self.metrics.prompt_tokens.inc(len(ticket.prompt_ids))
        boot = ticket.bootstrap
        self._command(Admit(ticket.rid, tuple(ticket.prompt_ids), ticket.params, room=boot.room if boot else None))
        if boot is not None and self.pd is not None:
            self.pd.submitted(ticket.rid, boot)

    def abort(self, rid: str) -> None:
        """The client has gone: drop the request and its KV pages; nobody is left to tell."""
        if self._progress.pop(rid, None) is not None:
            self._command(Abort(rid))
            self.metrics.finished.labels("abort").inc()
            if self.pd is not None:
                self.pd.aborted(rid)

    def drop(self, rid: str, status: int, message: str, code: str | None = None) -> None:
        """Fail a request with `message` and drop it from the engine (its peer in disaggregation gave up)."""
        self._fail(Failure(rid, status, message, code))
        self._command(Abort(rid))

    def command(self, item) -> None:
        """Queue a command for the leader (the disaggregation side's SendKV)."""
        self._command(item)

    def call(self, method: str, *args) -> asyncio.Future:
        """A future of engine.<method>(*args), run on every rank between two steps (expert-load endpoints)."""
        future = asyncio.get_running_loop().create_future()
        if not self.alive:
            future.set_exception(RuntimeError("the engine is not running"))
            return future
        call_id = next(self._call_ids)
        if not self.busy:
            self.watchdog.reported()
        self._calls[call_id] = future
        self._command(Call(method, tuple(args), call_id))
        return future

    def _command(self, item) -> None:
        """Queue a command; everything queued in one pass of the event loop goes to the leader as one message."""
        if not self._outbox:
            self._events.call_soon(self._flush)
        self._outbox.append(item)

    def send_queued(self) -> None:
        """Send the queued commands now rather than at the end of this pass of the event loop (a request just
        submitted: under a load of streams a pass lasts milliseconds, and its first token would wait for it)."""
        if self._outbox:
            self._flush()

    def _flush(self, halt: bool = False) -> None:
        items, self._outbox = tuple(self._outbox), []
        if not (items or halt) or not self._running or self._halting:
            return
        self._halting = halt
        try:
            self.connection.send(Round(items, halt))
        except OSError:  # the leader has gone; the reader thread says so
            pass

    # --- the reader thread: blocks on the connection, hands each message to the event loop -----------
    def _read(self) -> None:
        reason: str | None = "the engine process has gone"
        try:
            while not isinstance(message := self.connection.recv(), Halted):
                self._inbox.append(message)
                if not self._drain_due:  # else the scheduled _drain has not started: it will take this one too
                    self._drain_due = True
                    self._events.call_soon_threadsafe(self._drain)
            reason = message.reason
        except (EOFError, OSError):
            pass
        if reason is not None and self.verdict is not None and not self._halting:
            # the leader stopped by itself: the launcher knows which rank failed first, and how, a moment later
            told = self.verdict(VERDICT_WAIT_S)
            if told is not None:
                log.error("the engine stopped: %s (rank 0 saw: %s)", told, reason)
                reason = told
        try:
            self._events.call_soon_threadsafe(self._on_halted, reason)
        except RuntimeError:  # the event loop has closed: nobody is waiting any more
            pass

    # --- back on the event loop ---------------------------------------------------------------------
    def _drain(self) -> None:
        """Every report in the inbox, then what each client has not been sent yet."""
        self._drain_due = False  # before taking: a report that arrives from here on schedules the next _drain
        while self._inbox:
            self._absorb(self._inbox.popleft())
        self._send_progress()

    def _absorb(self, report: RoundReport) -> None:
        self.stats = report.stats
        self.transfers = report.transfers
        self.watchdog.reported()
        if report.reserved and self.pd is not None:
            self.pd.reserved(report.reserved)
        if report.landed and self.pd is not None:
            self.pd.landed(report.landed)
        for failure in report.failures:  # what earlier reports gave it goes out first, as when each report was sent
            self._push(failure.rid, time.monotonic())
        for updates in report.updates:
            updates.apply(self._progress)  # a request no longer there was aborted meanwhile
        for failure in report.failures:
            self._fail(failure)
        for call_id, outcome in report.outcomes:
            future = self._calls.pop(call_id, None)
            if future is not None and not future.done():  # else the HTTP call was cancelled
                _settle(future, outcome)

    def _on_halted(self, reason: str | None) -> None:
        if reason is not None or not self._halting:
            reason = reason or "the engine stopped"
            blamed = self.watchdog.blamed
            self.failure = EngineStopped(f"{blamed}; then: {reason}" if blamed else reason)
            log.error("the engine stopped: %s", self.failure)
        self._running = False
        self._shut_down(f"the engine stopped: {self.failure}" if self.failure is not None else SHUTTING_DOWN)
        if not self._halted.done():
            self._halted.set_result(None)
        if self.failure is not None and self.on_stopped is not None:
            self.on_stopped()

    def _shut_down(self, message: str) -> None:
        for rid in list(self._progress):
            self._fail(Failure(rid, 503, message))
        calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(RuntimeError(message))

    def _fail(self, failure: Failure) -> None:
        progress = self._progress.pop(failure.rid, None)
        if progress is not None and self.pd is not None:
            self.pd.ended(failure.rid, failure.message)
        if progress is not None:
            self.metrics.finished.labels("rejected" if failure.status == 400 else "error").inc()
            progress.ticket.queue.put_nowait(Output.failure(progress.ticket, failure.status, failure.message, failure.code))

    def _send_progress(self) -> None:
        now = time.monotonic()
        for rid in list(self._progress):
            self._push(rid, now)

    def _push(self, rid: str, now: float) -> None:
        """What the request gained since its client was last sent something, to the client's queue."""
        progress = self._progress.get(rid)
        output = progress.advance() if progress is not None else None
        if output is None:
            return
        self._observe(progress, output, now)
        progress.ticket.queue.put_nowait(output)
        if output.finished:
            del self._progress[rid]
            if self.pd is not None:
                self.pd.ended(rid, output.error)

    def _observe(self, progress: Progress, output: Output, now: float) -> None:
        if output.token_ids:
            first = progress.last_token_at is None
            since = now - (progress.ticket.submitted_at if first else progress.last_token_at)
            self.metrics.tokens_generated(len(output.token_ids), since, first)
            progress.last_token_at = now
        if output.finished:
            self.metrics.finished.labels("error" if output.error else output.finish_reason).inc()
            self.metrics.e2e.observe(now - progress.ticket.submitted_at)
            self.metrics.speculation_finished(output.spec_counts)


def _lead(leader: Leader) -> None:
    try:
        leader.run()
    except BaseException:  # the leader has told the front end already
        log.exception("the engine loop stopped")


def _settle(future: asyncio.Future, outcome) -> None:
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
