"""Forwarding: choose a worker, send, and on a failure before the first byte try another one.

Retries wait with exponential backoff and jitter, so a worker that has just died is not hammered and
retries of many requests do not arrive in lockstep. A worker's own answers (2xx, 4xx, 500) pass back
as they are; only a transport failure or a 502/503/504 is retried.
"""

from __future__ import annotations

import asyncio
import logging
import random

from starlette.responses import Response

from .access import error_response
from .http1 import Pool
from .metrics import RouterMetrics
from .policies import Choice, Policy, least_loaded
from .settings import RouterSettings
from .upstream import TRANSPORT_ERRORS, Upstream, WorkerUnavailable, open_upstream
from .workers import Worker, WorkerRegistry

log = logging.getLogger(__name__)

FORWARD_FAILURES = (*TRANSPORT_ERRORS, WorkerUnavailable)


class Forwarder:
    def __init__(self, session: Pool, registry: WorkerRegistry, policy: Policy,
                 metrics: RouterMetrics, settings: RouterSettings):
        self.session = session
        self.registry = registry
        self.policy = policy
        self.metrics = metrics
        self.settings = settings
        self._random = random.Random(settings.seed)
        self._counted: dict[tuple[str, str], object] = {}  # (metric, label) -> its counter: labels() costs a lock

    def _count(self, metric, label: str) -> None:
        key = (metric._name, label)
        counter = self._counted.get(key)
        if counter is None:
            counter = self._counted[key] = metric.labels(label)
        counter.inc()

    async def forward(self, method: str, path: str, headers: list, body: bytes, text: str | None) -> Response:
        """Forward to the worker the policy picks for `text` (None: any worker, the least loaded)."""
        tried: set[str] = set()
        last_error = "no worker was tried"
        for attempt in range(self.settings.max_retries + 1):
            if attempt:
                self.metrics.retries.inc()
                await asyncio.sleep(self.backoff(attempt))
            choice = self._pick(text, tried, attempt)
            if choice is None:
                self.metrics.failed_requests.inc()
                return error_response(503, self._none_routable())
            worker = choice.worker
            tried.add(worker.url)
            try:
                upstream = await self._attempt(worker, method, path, headers, body)
            except FORWARD_FAILURES as exc:
                self.policy.refused(choice)
                last_error = f"{worker.url}: {type(exc).__name__}: {exc}"
                continue
            except BaseException:  # the client left
                self.policy.refused(choice)
                raise
            if upstream.response.status >= 400:  # the worker refused the request: the tree must not keep its text
                self.policy.refused(choice)
            return upstream.to_response(lambda failed: self._finished(worker, failed))
        self.metrics.failed_requests.inc()
        return error_response(502, f"no worker answered after {len(tried)} worker(s) and {attempt + 1} tries; last: {last_error}")

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before retry `attempt` (1, 2, ...): exponential, capped, with +-jitter."""
        s = self.settings
        base = min(s.retry_backoff_ms * 2 ** (attempt - 1), s.retry_max_backoff_ms) / 1000
        return base * (1 + s.retry_jitter * self._random.uniform(-1.0, 1.0))

    def _none_routable(self) -> str:
        states = [w.state for w in self.registry.all()]
        if not states:
            return "no healthy worker: the router has no workers"
        return f"no healthy worker: {states.count('starting')} starting, {states.count('out')} out of routing"

    def _pick(self, text: str | None, tried: set[str], attempt: int) -> Choice | None:
        healthy = self.registry.healthy()
        if not healthy:
            return None
        untried = [w for w in healthy if w.url not in tried] or healthy  # all tried: a worker may try again
        if text is None:
            return Choice(least_loaded(untried, attempt), "least_loaded")
        choice = self.policy.select(text, untried)
        self._count(self.metrics.decisions, choice.reason)
        return choice

    async def _attempt(self, worker: Worker, method: str, path: str, headers: list, body: bytes) -> Upstream:
        self.registry.sent(worker)  # load counts from the moment of the decision
        try:
            upstream = await open_upstream(self.session, worker.url, path, method, headers, body)
        except BaseException as exc:
            self.registry.finished(worker)
            if isinstance(exc, FORWARD_FAILURES):
                self._failed(worker, exc)
            raise
        self.registry.succeeded(worker)
        self._count(self.metrics.requests, worker.url)
        return upstream

    def _finished(self, worker: Worker, failed: bool) -> None:
        self.registry.finished(worker)
        if failed:
            self._failed(worker, None)

    def _failed(self, worker: Worker, exc: Exception | None) -> None:
        self.metrics.forward_failures.labels(worker.url).inc()
        if self.registry.failed(worker):
            self.metrics.workers_out.inc()
            log.warning("took %s out of routing after %d failures in a row (last: %r)", worker.url,
                        worker.failures_in_a_row, exc)
