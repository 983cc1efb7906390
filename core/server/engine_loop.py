"""The engine on a thread of its own, so the event loop never waits for a forward step.

    event loop  --Ticket / Abort / EngineCall-->  inbox (queue.SimpleQueue)  -->  engine thread: a round of
                                                                                  the EngineGroup (every rank)
    event loop  <--Outputs, one call per round (call_soon_threadsafe)--  engine thread: what each request gained

After every round the engine thread compares each request (the mirror the EngineGroup keeps up to date)
with what its client has been sent (Progress) and pushes the difference to the asyncio queue of the HTTP
call that asked for it. With one rank, a failed step fails the requests it was running with a 500 and the
loop carries on; with several, the ranks can no longer agree, so the loop stops and says why (`failure`).
While no rank has work the thread waits on its inbox; with several ranks it sends an empty round now and
then so the followers' wait stays within the collective timeout.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Callable

import attrs

from ..engine import Engine
from ..engine_group import EngineGroup
from ..rank_worker import GroupStats
from .metrics import ServerMetrics
from .outputs import Output, Ticket
from .progress import Progress

log = logging.getLogger("moeplex.server")


@attrs.frozen
class Abort:
    rid: str


@attrs.frozen
class LoopStats:
    """The engine's state as of its last step, published for the HTTP side to read without locks."""

    groups: tuple[GroupStats, ...]  # one per DP group
    admitted: tuple[int, ...]  # requests each DP group was given since start-up
    steps: int
    failed_steps: int

    @property
    def num_running(self) -> int:
        return sum(g.num_running for g in self.groups)

    @property
    def num_queued(self) -> int:
        return sum(g.num_queued for g in self.groups)

    @property
    def kv_pages_total(self) -> int:
        return sum(g.kv_pages_total for g in self.groups)

    @property
    def kv_pages_free(self) -> int:
        return sum(g.kv_pages_free for g in self.groups)

    @property
    def page_size(self) -> int:
        return self.groups[0].page_size

    @property
    def kv_pages_used(self) -> int:
        return self.kv_pages_total - self.kv_pages_free


@attrs.frozen
class EngineCall:
    """engine.<method>(*args) on every rank between two steps; rank 0's result or error settles `future`."""

    method: str
    args: tuple
    future: asyncio.Future


_HALT = object()


class EngineLoop:
    def __init__(self, group: EngineGroup, metrics: ServerMetrics, on_stopped: Callable[[], None] | None = None):
        """`on_stopped` is called from the engine thread if the loop stops by itself (see `failure`)."""
        self.group = group
        self.metrics = metrics
        self.on_stopped = on_stopped
        self.failure: BaseException | None = None  # why the loop stopped when nobody asked it to
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._progress: dict[str, Progress] = {}
        self._events: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._halted = False
        self._steps = self._failed_steps = 0
        self.stats = self._snapshot()

    @property
    def engine(self) -> Engine:
        """Rank 0's engine (with one rank, the engine)."""
        return self.group.engine

    # --- called from the event loop -------------------------------------------------------------
    def start(self, events: asyncio.AbstractEventLoop) -> None:
        self._events = events
        self._thread = threading.Thread(target=self._run, name="moeplex-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Fail whatever is still running (503) and end the thread."""
        self._inbox.put(_HALT)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._halted

    def submit(self, ticket: Ticket) -> None:
        self._inbox.put(ticket)

    def abort(self, rid: str) -> None:
        self._inbox.put(Abort(rid))

    def call(self, method: str, *args) -> asyncio.Future:
        """A future of engine.<method>(*args), run on every rank between two steps (expert-load endpoints)."""
        future = asyncio.get_running_loop().create_future()
        self._inbox.put(EngineCall(method, args, future))
        return future

    # --- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._halted:
                self._take_commands(block=not self.group.needs_round)
                # with several ranks an idle round is the keep-alive that the followers wait for
                if not self._halted and (self.group.needs_round or self.group.size > 1):
                    self._step()
                self.stats = self._snapshot()
            self.group.halt()
        except BaseException as exc:
            self.failure = exc
            log.exception("the engine loop stopped")
        finally:
            self._halted = True
            self._fail_everything(503, "the server is shutting down")
            self.stats = self._snapshot()
            if self.failure is not None and self.on_stopped is not None:
                self.on_stopped()

    def _take_commands(self, block: bool) -> None:
        item = self._wait_for_command() if block else self._next_command()
        while item is not None:
            self._handle(item)
            item = self._next_command()

    def _wait_for_command(self):
        try:
            return self._inbox.get(timeout=self.group.keepalive_s)
        except queue.Empty:
            return None

    def _next_command(self):
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return None

    def _handle(self, item) -> None:
        try:
            if item is _HALT:
                self._halted = True
            elif isinstance(item, Abort):
                self._abort(item.rid)
            elif isinstance(item, EngineCall):
                self._run_call(item)
            else:
                self._admit(item)
        except Exception as exc:  # a bug in admission or abort must not take the loop down with it
            log.exception("engine command failed")
            if isinstance(item, Ticket):
                self._progress.pop(item.rid, None)
                self._send([(item.queue, Output.failure(item, 500, f"{type(exc).__name__}: {exc}"))])

    def _admit(self, ticket: Ticket) -> None:
        if self._halted:
            self._send([(ticket.queue, Output.failure(ticket, 503, "the server is shutting down"))])
            return
        try:
            request = self.group.add_request(ticket.prompt_ids, ticket.params, rid=ticket.rid)
        except ValueError as exc:  # the engine's own checks: vocabulary, KV capacity
            self.metrics.finished.labels("rejected").inc()
            self._send([(ticket.queue, Output.failure(ticket, 400, str(exc)))])
            return
        self._progress[ticket.rid] = Progress(request, ticket)
        self.metrics.prompt_tokens.inc(len(ticket.prompt_ids))

    def _run_call(self, call: EngineCall) -> None:
        # the caller reports an error (a ValueError is the client's 400)
        self.group.call(call.method, call.args, lambda outcome: self._resolve(call.future, outcome))

    def _resolve(self, future: asyncio.Future, outcome) -> None:
        if self._events is not None:
            self._events.call_soon_threadsafe(_settle, future, outcome)

    def _abort(self, rid: str) -> None:
        """The client has gone: drop the request and its KV pages; nobody is left to tell."""
        if self._progress.pop(rid, None) is not None:
            self.group.abort(rid)
            self.metrics.finished.labels("abort").inc()

    def _step(self) -> None:
        self._steps += 1
        try:
            self.group.step()
        except Exception as exc:
            if self.group.size > 1:
                raise  # the other ranks are somewhere inside this step: nothing to carry on with
            self._failed_steps += 1
            log.exception("engine step failed; failing the requests it was running")
            # the step's batch came from the running requests; if none, the waiting ones broke it
            self._fail(self.group.running_rids(), 500, f"engine step failed: {type(exc).__name__}: {exc}")
        self._send_progress()

    def _fail_everything(self, status: int, message: str) -> None:
        self._fail(list(self._progress), status, message)
        self.group.drop_queued_calls(RuntimeError(message))
        for item in iter(self._next_command, None):
            if isinstance(item, Ticket):
                self._send([(item.queue, Output.failure(item, status, message))])
            elif isinstance(item, EngineCall):
                self._resolve(item.future, RuntimeError(message))

    def _fail(self, rids: list[str], status: int, message: str) -> None:
        batch = []
        for rid in rids:
            progress = self._progress.pop(rid, None)
            self.group.abort(rid)
            if progress is not None:
                self.metrics.finished.labels("error").inc()
                batch.append((progress.ticket.queue, Output.failure(progress.ticket, status, message)))
        self._send(batch)

    def _send_progress(self) -> None:
        now = time.monotonic()
        batch = []
        for rid, progress in list(self._progress.items()):
            output = progress.advance()
            if output is None:
                continue
            self._observe(progress, output, now)
            batch.append((progress.ticket.queue, output))
            if output.finished:
                del self._progress[rid]
        self._send(batch)

    def _observe(self, progress: Progress, output: Output, now: float) -> None:
        if output.token_ids:
            first = progress.last_token_at is None
            since = now - (progress.ticket.submitted_at if first else progress.last_token_at)
            self.metrics.tokens_generated(len(output.token_ids), since, first)
            progress.last_token_at = now
        if output.finished:
            self.metrics.finished.labels("error" if output.error else output.finish_reason).inc()
            self.metrics.e2e.observe(now - progress.ticket.submitted_at)

    def _send(self, batch: list[tuple[asyncio.Queue, Output]]) -> None:
        if not batch or self._events is None:
            return
        try:
            self._events.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:  # the event loop has closed: nobody is waiting any more
            pass

    def _snapshot(self) -> LoopStats:
        return LoopStats(tuple(self.group.stats), tuple(self.group.admitted), self._steps, self._failed_steps)


def _settle(future: asyncio.Future, outcome) -> None:
    if future.done():  # the HTTP call was cancelled
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _deliver(batch: list[tuple[asyncio.Queue, Output]]) -> None:
    for events, output in batch:
        events.put_nowait(output)
