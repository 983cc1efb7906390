"""Health checks: GET /health on every worker, each on its own schedule, by the router alone.

Only these checks (and failed forwards) decide whether a worker is in routing; a client's GET /health
reads the result and probes nothing. Each probe runs as a task of its own with a timeout, so a worker
that accepts connections but never answers fails its check without delaying anyone else's. A starting
worker is probed soon and then less often (backoff doubling up to the interval), so it is in routing
within a fraction of a second of coming up.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from .metrics import RouterMetrics
from .upstream import TRANSPORT_ERRORS
from .workers import STARTING, Worker, WorkerRegistry

log = logging.getLogger(__name__)

# a starting worker's checks: 0.25 s, 0.5 s, 1 s, then every 2 s (or the interval, if shorter): a refused
# connection costs nothing, and a worker that finishes loading is in routing within 2 s
FIRST_STARTUP_RETRY_SECS = 0.25
MAX_STARTUP_RETRY_SECS = 2.0


async def probe(session: aiohttp.ClientSession, url: str, timeout: float) -> int | str:
    """The status of GET url/health, or the name of the failure when there is none (a timeout included)."""
    try:
        async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            return response.status
    except TRANSPORT_ERRORS as exc:
        return type(exc).__name__


class HealthChecker:
    def __init__(self, client: aiohttp.ClientSession, registry: WorkerRegistry, metrics: RouterMetrics,
                 timeout: float, interval: float):
        self.client = client
        self.registry = registry
        self.metrics = metrics
        self.timeout = timeout
        self.interval = interval
        self._due: dict[str, float] = {}  # worker URL -> when its next check is due
        self._checks_while_starting: dict[str, int] = {}
        self._in_flight: dict[str, asyncio.Task] = {}
        self._wake = asyncio.Event()

    def check_soon(self, worker: Worker) -> None:
        """Check `worker` now (it was just added)."""
        self._due[worker.url] = 0.0
        self._wake.set()

    async def check_all_once(self) -> None:
        """Check every worker now, together (at start-up: workers already up are in routing before the first request)."""
        workers = self.registry.all()
        results = await asyncio.gather(*(probe(self.client, w.url, self.timeout) for w in workers))
        for worker, result in zip(workers, results):
            self.record(worker, result)
            self._due[worker.url] = time.monotonic() + self._next_wait(worker)

    def forget(self, url: str) -> None:
        """`url` left the router."""
        self._due.pop(url, None)
        self._checks_while_starting.pop(url, None)

    def record(self, worker: Worker, result: int | str) -> None:
        worker.last_check = result
        was = worker.state
        if result == 200 and self.registry.passed_check(worker):
            log.info("put %s into routing (%s, then %d passed health checks)", worker.url, was, worker.passes_in_a_row)
        elif result != 200 and self.registry.failed(worker):
            self.metrics.workers_out.inc()
            reason = "did not start within the grace period" if was == STARTING else \
                f"{worker.failures_in_a_row} failed checks or forwards in a row"
            log.warning("took %s out of routing: %s (last check: %s)", worker.url, reason, result)

    def _next_wait(self, worker: Worker) -> float:
        if worker.state != STARTING:
            return self.interval
        n = self._checks_while_starting.get(worker.url, 0)
        self._checks_while_starting[worker.url] = n + 1
        return min(FIRST_STARTUP_RETRY_SECS * 2 ** min(n, 8), MAX_STARTUP_RETRY_SECS, self.interval)

    async def _check(self, worker: Worker) -> None:
        try:
            result = await probe(self.client, worker.url, self.timeout)
            if self.registry.get(worker.url) is worker:  # not removed meanwhile
                self.record(worker, result)
        finally:
            if self.registry.get(worker.url) is worker:
                self._due[worker.url] = time.monotonic() + self._next_wait(worker)
            self._in_flight.pop(worker.url, None)
            self._wake.set()

    async def run(self) -> None:
        """Check each worker when it is due, until cancelled."""
        try:
            while True:
                now = time.monotonic()
                workers = self.registry.all()
                for worker in workers:
                    if worker.url not in self._in_flight and self._due.setdefault(worker.url, 0.0) <= now:
                        self._in_flight[worker.url] = asyncio.create_task(self._check(worker))
                waiting = [self._due[w.url] for w in workers if w.url not in self._in_flight]
                pause = min(waiting, default=now + self.interval) - now
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), max(pause, 0.01))
                except asyncio.TimeoutError:
                    pass
        finally:
            for task in list(self._in_flight.values()):
                task.cancel()
