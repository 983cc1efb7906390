"""`moeplex router --pd`: each request goes to a prefill (P) and a decode (D) server at once, under one room.

    client --> router: P by the cache-aware policy over the prefill pool, D by least load over the decode pool,
               a fresh 63-bit room; the body plus {bootstrap_host, bootstrap_port, bootstrap_room} posted to both
               concurrently; D's response (or stream) is the client's; P's is read to its end and dropped
    failure before the client's first byte (either post fails in transport or answers 502/503/504, or P refuses
               while D has not answered): both are closed (each server aborts its side) and a new pair is tried
    client gone: both connections close, and each server aborts its side (D also tells P through its bootstrap)

The engine computes no prompt logprobs (logprob_start_len is -1 only), so there is nothing of P's answer to merge.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import secrets
from urllib.parse import urlsplit

import aiohttp
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .access import error_response
from .deadlines import Deadlines
from .http1 import Pool
from .app import CLIENT_CLOSED, body_or_refusal, until_disconnected, worker_lifespan
from .health import HealthChecker
from .metrics import RouterMetrics
from .policies import Choice, least_loaded, make_policy
from .request_text import TEXT_OF, routing_text
from .settings import RouterSettings
from .upstream import TRANSPORT_ERRORS, Upstream, WorkerUnavailable, forwarded_headers, open_upstream
from .workers import HEALTHY, OUT, STARTING, WorkerRegistry

log = logging.getLogger(__name__)

DEFAULT_BOOTSTRAP_PORT = 8998
ROOM_BITS = 63
FAILURES = (*TRANSPORT_ERRORS, WorkerUnavailable)


def parse_prefill(spec: str) -> tuple[str, int]:
    """'URL[,BOOTSTRAP_PORT]' as (url, port)."""
    url, _, port = spec.partition(",")
    if not port:
        return url.rstrip("/"), DEFAULT_BOOTSTRAP_PORT
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"a prefill server is URL[,BOOTSTRAP_PORT] with a port in 1..65535, got {spec!r}")
    return url.rstrip("/"), int(port)


class Rooms:
    """63-bit room ids, never reused: a counter from a random start (a restarted router starts elsewhere)."""

    def __init__(self):
        self._next = itertools.count(secrets.randbits(ROOM_BITS - 1))

    def take(self) -> int:
        return next(self._next) % (1 << ROOM_BITS)


class PDRouter:
    def __init__(self, settings: RouterSettings):
        self.settings = settings
        prefill = [parse_prefill(spec) for spec in settings.prefill]
        self.bootstrap_port = dict(prefill)
        self.prefill = WorkerRegistry(tuple(url for url, _ in prefill), settings.health_failure_threshold,
                                      settings.health_success_threshold, settings.worker_startup_timeout_secs, STARTING)
        self.decode = WorkerRegistry(tuple(u.rstrip("/") for u in settings.decode), settings.health_failure_threshold,
                                     settings.health_success_threshold, settings.worker_startup_timeout_secs, STARTING)
        self.policy = make_policy(settings)
        self.metrics = RouterMetrics()
        self.metrics.watch(lambda: self.prefill.all() + self.decode.all(), self.policy.tree_size)
        self.rooms = Rooms()
        self.session: Pool | None = None  # the HTTP/1.1 client to the servers
        self.deadlines = Deadlines()  # its read timeouts, checked by one task
        self.health: list[HealthChecker] = []

    def open(self, session: Pool, probes: aiohttp.ClientSession) -> None:
        self.session = session
        s = self.settings
        self.health = [HealthChecker(probes, registry, self.metrics, s.health_check_timeout_secs, s.health_check_interval_secs)
                       for registry in (self.prefill, self.decode)]

    def routes(self) -> list[Route]:
        return [Route(path, self.generate, methods=["POST"]) for path in TEXT_OF] + [
            Route("/health", self.aggregated_health, methods=["GET"]),
            Route("/list_workers", self.list_workers, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ]

    async def generate(self, http: Request) -> Response:
        body = await body_or_refusal(http, self.settings.max_request_bytes, self.settings.body_timeout_secs)
        if isinstance(body, Response):
            return body
        try:
            values = json.loads(body)
        except (ValueError, RecursionError):
            values = None
        if not isinstance(values, dict):
            return error_response(400, "the request body must be a JSON object")
        text = routing_text(http.url.path, body) or ""
        headers = forwarded_headers(http.headers.raw, self.settings.worker_api_key)
        response = await until_disconnected(http, self._forward(http.url.path, headers, values, text))
        return Response(status_code=CLIENT_CLOSED) if response is None else response

    async def _forward(self, path: str, headers: list, values: dict, text: str) -> Response:
        last_error = "no pair was tried"
        tried: set[str] = set()  # prefill servers that failed this request: a retry goes elsewhere while it can
        for attempt in range(self.settings.max_retries + 1):
            if attempt:
                self.metrics.retries.inc()
                await asyncio.sleep(min(self.settings.retry_backoff_ms * 2 ** (attempt - 1), self.settings.retry_max_backoff_ms) / 1000)
            prefills, decodes = self.prefill.healthy(), self.decode.healthy()
            if not prefills or not decodes:
                return error_response(503, f"no healthy pair: {len(prefills)} prefill and {len(decodes)} decode server(s) in routing")
            choice = self.policy.select(text, [p for p in prefills if p.url not in tried] or prefills)
            self.metrics.decisions.labels(choice.reason).inc()
            decode = least_loaded(decodes, attempt)
            outcome = await self._pair(path, headers, values, choice, decode)
            if isinstance(outcome, Response):
                return outcome
            last_error = outcome
            if outcome.startswith("prefill"):
                tried.add(choice.worker.url)
        self.metrics.failed_requests.inc()
        return error_response(502, f"no prefill/decode pair answered after {attempt + 1} tries; last: {last_error}")

    async def _pair(self, path: str, headers: list, values: dict, choice: Choice, decode) -> Response | str:
        """One try: the client's response, or why the pair failed before the first byte (then try another)."""
        prefill = choice.worker
        room = self.rooms.take()
        host = urlsplit(prefill.url).hostname
        body = json.dumps({**values, "bootstrap_host": host, "bootstrap_port": self.bootstrap_port[prefill.url],
                           "bootstrap_room": room}).encode()
        self.prefill.sent(prefill)
        self.decode.sent(decode)
        p_task = asyncio.ensure_future(self._drain(open_upstream(self.session, prefill.url, path, "POST", headers, body)))
        d_task = asyncio.ensure_future(open_upstream(self.session, decode.url, path, "POST", headers, body))
        p_task.add_done_callback(lambda task: self.prefill.finished(prefill))
        blame = None  # D's 502 naming P: the pair failed at P, whatever P's own post answered
        try:
            pending = {p_task, d_task}
            while d_task in pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if p_task in done and not d_task.done():
                    failure = _failure(p_task)
                    if failure is not None:  # P failed before D answered: D can only time out; retry the pair
                        self.policy.refused(choice)
                        d_task.cancel()
                        self.decode.finished(decode)
                        if isinstance(failure, Upstream):  # P's own refusal (4xx, 500): the client's answer
                            return failure.to_response(lambda failed: None)
                        return f"prefill {prefill.url}: {failure}"
            try:
                upstream = d_task.result()
            except FAILURES as exc:
                self.decode.finished(decode)
                if isinstance(exc, WorkerUnavailable) and exc.failed_server == "prefill":
                    self.decode.succeeded(decode)  # D did its part: it stays in routing
                    blame = exc
                    return f"prefill {prefill.url} (as decode {decode.url} found): {exc}"
                self._fail(self.decode, decode, exc)
                p_task.cancel()
                return f"decode {decode.url}: {type(exc).__name__}: {exc}"
            self.decode.succeeded(decode)
            self.metrics.requests.labels(decode.url).inc()
            return upstream.to_response(lambda failed: self._closed(decode, failed))
        except BaseException:  # the client left: both connections close, both servers abort
            p_task.cancel()
            d_task.cancel()
            self.decode.finished(decode)
            raise
        finally:
            self._settle_prefill(prefill, p_task, blame)

    @staticmethod
    async def _drain(opening) -> Upstream:
        """P's answer, read to its end (a stream too) and released; raises as open_upstream does."""
        upstream = await opening
        try:
            if upstream.chunks is not None:
                async for _ in upstream.chunks:
                    pass
        finally:
            upstream.response.close()
        return upstream

    def _judge(self, registry: WorkerRegistry, worker, task: asyncio.Task) -> None:
        """A finished post as evidence of the worker's health (its load was released as it finished)."""
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._fail(registry, worker, exc)
        else:
            registry.succeeded(worker)
            self.metrics.requests.labels(worker.url).inc()

    def _settle_prefill(self, prefill, p_task: asyncio.Task, blame: WorkerUnavailable | None) -> None:
        """P's answer counts for its health once D's verdict is known, so the order the two answers came in
        changes nothing. D blamed P: one failure against P, and P's own answer (a success, or the same failure
        seen in transport) counts for nothing, so a P that D keeps blaming goes out of routing. Otherwise P's
        answer counts as it ends (P's stream may outlive the pair's decision)."""
        if blame is not None:
            if p_task.done() and not p_task.cancelled():
                p_task.exception()  # read, so asyncio does not log it: its failure is the one D reported
            p_task.cancel()
            self._fail(self.prefill, prefill, blame)
        elif p_task.done():
            self._judge(self.prefill, prefill, p_task)
        else:
            p_task.add_done_callback(lambda task: self._judge(self.prefill, prefill, task))

    def _closed(self, decode, failed: bool) -> None:
        self.decode.finished(decode)
        if failed:
            self._fail(self.decode, decode, None)

    def _fail(self, registry: WorkerRegistry, worker, exc) -> None:
        if isinstance(exc, BaseException) and not isinstance(exc, FAILURES):
            return
        self.metrics.forward_failures.labels(worker.url).inc()
        if registry.failed(worker):
            self.metrics.workers_out.inc()
            log.warning("took %s out of routing after %d failures in a row (last: %r)", worker.url, worker.failures_in_a_row, exc)

    async def aggregated_health(self, http: Request) -> JSONResponse:
        up = {role: sum(w.state == HEALTHY for w in r.all()) for role, r in (("prefill", self.prefill), ("decode", self.decode))}
        ok = all(up.values())
        body = {"status": "ok" if ok else "unavailable", "healthy_prefill": up["prefill"], "healthy_decode": up["decode"],
                "workers": {state: sum(w.state == state for r in (self.prefill, self.decode) for w in r.all())
                            for state in (HEALTHY, STARTING, OUT)}}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def list_workers(self, http: Request) -> JSONResponse:
        return JSONResponse({"policy": self.policy.name,
                             "prefill": [{**w.describe(), "bootstrap_port": self.bootstrap_port[w.url]} for w in self.prefill.all()],
                             "decode": [w.describe() for w in self.decode.all()]})

    async def prometheus(self, http: Request) -> Response:
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)


def _failure(task: asyncio.Task):
    """None if P's answer is a success; its refusal (an Upstream) or the transport failure (text) otherwise."""
    exc = task.exception()
    if exc is not None:
        return f"{type(exc).__name__}: {exc}"
    upstream = task.result()
    return upstream if upstream.response.status >= 400 else None


def build_pd_router_app(settings: RouterSettings):
    from starlette.applications import Starlette
    from starlette.middleware import Middleware

    from .access import RouterAccess

    router = PDRouter(settings)

    lifespan = worker_lifespan(router, settings, lambda: router.health)

    access = Middleware(RouterAccess, api_key=settings.api_key, admin_api_key=settings.admin_api_key, host=settings.host)
    app = Starlette(routes=router.routes(), lifespan=lifespan, middleware=[access])
    app.state.router = router
    return app
