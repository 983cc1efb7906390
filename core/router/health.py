"""Health checks: GET /health on every worker, in or out of routing, on an interval."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from .metrics import RouterMetrics
from .upstream import TRANSPORT_ERRORS
from .workers import Worker, WorkerRegistry

log = logging.getLogger(__name__)


async def probe(session: aiohttp.ClientSession, url: str, timeout: float) -> int | str:
    """The status of GET url/health, or the name of the failure when there is none."""
    try:
        async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            return response.status
    except TRANSPORT_ERRORS as exc:
        return type(exc).__name__


class HealthChecker:
    def __init__(self, client: aiohttp.ClientSession, registry: WorkerRegistry, metrics: RouterMetrics, timeout: float):
        self.client = client
        self.registry = registry
        self.metrics = metrics
        self.timeout = timeout

    async def check_all(self) -> dict[str, int | str]:
        """Probe every worker at once and count each answer; worker URL -> status or failure."""
        workers = self.registry.all()
        results = await asyncio.gather(*(probe(self.client, w.url, self.timeout) for w in workers))
        for worker, result in zip(workers, results):
            self.record(worker, result == 200)
        return {w.url: r for w, r in zip(workers, results)}

    def record(self, worker: Worker, passed: bool) -> None:
        if passed and self.registry.passed_check(worker):
            log.info("put %s back into routing after %d passed health checks", worker.url, worker.passes_in_a_row)
        elif not passed and self.registry.failed(worker):
            self.metrics.workers_out.inc()
            log.warning("took %s out of routing after %d failed health checks", worker.url, worker.failures_in_a_row)

    async def run(self, interval: float) -> None:
        """Check now, then every `interval` seconds, until cancelled."""
        while True:
            await self.check_all()
            await asyncio.sleep(interval)
