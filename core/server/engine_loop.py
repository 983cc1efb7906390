"""The engine on a thread of its own, so the event loop never waits for a forward step.

    event loop  --Ticket / Abort-->  inbox (queue.SimpleQueue)  -->  engine thread: admit, abort, step()
    event loop  <--Outputs, one call per step (call_soon_threadsafe)--  engine thread: what each request gained

After every step the engine thread compares each request's output with what its client has been
sent (Progress) and pushes the difference to the asyncio queue of the HTTP call that asked for it.
A failed step fails the requests it was running with a 500 and the loop carries on.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any, Callable

import attrs

from ..engine import Engine
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

    num_running: int
    num_queued: int
    kv_pages_total: int
    kv_pages_free: int
    page_size: int
    steps: int
    failed_steps: int

    @property
    def kv_pages_used(self) -> int:
        return self.kv_pages_total - self.kv_pages_free


@attrs.frozen
class EngineCall:
    """fn(engine), run on the engine thread between two steps; its result or error settles `future`."""

    fn: Callable[[Engine], Any]
    future: asyncio.Future


_HALT = object()


class EngineLoop:
    def __init__(self, engine: Engine, metrics: ServerMetrics):
        self.engine = engine
        self.metrics = metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._progress: dict[str, Progress] = {}
        self._events: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._halted = False
        self._steps = self._failed_steps = 0
        self.stats = self._snapshot()

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

    def call(self, fn: Callable[[Engine], Any]) -> asyncio.Future:
        """A future of fn(engine), which the engine thread runs between two steps (expert-load endpoints)."""
        future = asyncio.get_running_loop().create_future()
        self._inbox.put(EngineCall(fn, future))
        return future

    # --- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._halted:
                self._take_commands(block=not self.engine.has_work)
                if self.engine.has_work and not self._halted:
                    self._step()
                self.stats = self._snapshot()
        except BaseException:
            log.exception("the engine loop stopped")
            raise
        finally:
            self._halted = True
            self._fail_everything(503, "the server is shutting down")
            self.stats = self._snapshot()

    def _take_commands(self, block: bool) -> None:
        item = self._inbox.get() if block else self._next_command()
        while item is not None:
            self._handle(item)
            item = self._next_command()

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
            request = self.engine.add_request(ticket.prompt_ids, ticket.params, rid=ticket.rid)
        except ValueError as exc:  # the engine's own checks: vocabulary, KV capacity
            self.metrics.finished.labels("rejected").inc()
            self._send([(ticket.queue, Output.failure(ticket, 400, str(exc)))])
            return
        self._progress[ticket.rid] = Progress(request, ticket)
        self.metrics.prompt_tokens.inc(len(ticket.prompt_ids))

    def _run_call(self, call: EngineCall) -> None:
        try:
            outcome = call.fn(self.engine)
        except Exception as exc:  # the caller reports it (a ValueError is the client's 400)
            outcome = exc
        if self._events is not None:
            self._events.call_soon_threadsafe(_settle, call.future, outcome)

    def _abort(self, rid: str) -> None:
        """The client has gone: drop the request and its KV pages; nobody is left to tell."""
        if self._progress.pop(rid, None) is not None:
            self.engine.abort(rid)
            self.metrics.finished.labels("abort").inc()

    def _step(self) -> None:
        self._steps += 1
        try:
            self.engine.step()
        except Exception as exc:
            self._failed_steps += 1
            log.exception("engine step failed; failing the requests it was running")
            self._fail_step(f"engine step failed: {type(exc).__name__}: {exc}")
        self._send_progress()

    def _fail_step(self, message: str) -> None:
        scheduler = self.engine.scheduler
        # the step's batch came from the running requests; if none, the waiting ones broke it
        failed = list(scheduler.running) or list(scheduler.waiting)
        self._fail([r.rid for r in failed], 500, message)

    def _fail_everything(self, status: int, message: str) -> None:
        self._fail(list(self._progress), status, message)
        for item in iter(self._next_command, None):
            if isinstance(item, Ticket):
                self._send([(item.queue, Output.failure(item, status, message))])
            elif isinstance(item, EngineCall) and self._events is not None:
                self._events.call_soon_threadsafe(_settle, item.future, RuntimeError(message))

    def _fail(self, rids: list[str], status: int, message: str) -> None:
        batch = []
        for rid in rids:
            progress = self._progress.pop(rid, None)
            self.engine.abort(rid)
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
        scheduler, kv = self.engine.scheduler, self.engine.kv
        return LoopStats(
            num_running=len(scheduler.running),
            num_queued=len(scheduler.waiting),
            kv_pages_total=kv.num_pages,
            kv_pages_free=kv.num_free_pages,
            page_size=kv.page_size,
            steps=self._steps,
            failed_steps=self._failed_steps,
        )


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
