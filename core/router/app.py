"""The starlette application of `moeplex router`: forwarded routes, worker management, health, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import aiohttp
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .health import HealthChecker, probe
from .metrics import RouterMetrics
from .policies import make_policy
from .proxy import Forwarder, error_response
from .request_text import TEXT_OF, routing_text
from .settings import RouterSettings
from .upstream import forwarded_headers, worker_session
from .workers import WorkerRegistry, normalize_url

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nobody reads it; it shows in the access log


class Router:
    """The router's state: workers, policy, metrics; the HTTP client and background tasks live with the app."""

    def __init__(self, settings: RouterSettings):
        self.settings = settings
        self.registry = WorkerRegistry(settings.worker_urls, settings.health_failure_threshold,
                                       settings.health_success_threshold)
        self.policy = make_policy(settings)
        self.metrics = RouterMetrics()
        self.metrics.watch(self.registry.all, self.policy.tree_size)
        self.forwarder: Forwarder | None = None
        self.health: HealthChecker | None = None

    def open(self, session: aiohttp.ClientSession, probes: aiohttp.ClientSession) -> None:
        """Start forwarding through `session` and health checks through `probes` (a pool of their own)."""
        self.forwarder = Forwarder(session, self.registry, self.policy, self.metrics, self.settings)
        self.health = HealthChecker(probes, self.registry, self.metrics, self.settings.health_check_timeout_secs)

    def routes(self) -> list[Route]:
        forwarded = [Route(path, self.generate, methods=["POST"]) for path in TEXT_OF]
        return forwarded + [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.aggregated_health, methods=["GET"]),
            Route("/add_worker", self.add_worker, methods=["POST"]),
            Route("/remove_worker", self.remove_worker, methods=["POST"]),
            Route("/list_workers", self.list_workers, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ]

    # --- forwarded -------------------------------------------------------------------------------

    async def generate(self, http: Request) -> Response:
        try:
            body = await read_body(http, self.settings.max_request_bytes)
        except ClientDisconnect:
            return Response(status_code=CLIENT_CLOSED)
        if body is None:
            return error_response(413, f"the request body is over the router's limit of {self.settings.max_request_bytes} bytes")
        text = routing_text(http.url.path, body)
        return await self._forward(http, body, text)

    async def models(self, http: Request) -> Response:
        return await self._forward(http, b"", None)

    async def _forward(self, http: Request, body: bytes, text: str | None) -> Response:
        path = http.url.path + (f"?{http.url.query}" if http.url.query else "")
        forward = self.forwarder.forward(http.method, path, forwarded_headers(http.headers.raw), body, text)
        response = await until_disconnected(http, forward)
        return Response(status_code=CLIENT_CLOSED) if response is None else response

    # --- operations ------------------------------------------------------------------------------

    async def aggregated_health(self, http: Request) -> JSONResponse:
        """200 while at least one worker answers its /health with 200; each worker's answer in the body."""
        results = await self.health.check_all()
        up = sum(1 for status in results.values() if status == 200)
        body = {"status": "ok" if up else "unavailable", "healthy_workers": up, "workers": results}
        return JSONResponse(body, status_code=200 if up else 503)

    async def add_worker(self, http: Request) -> JSONResponse:
        url = await worker_url_of(http)
        if url is None:
            return error_response(400, "name the worker: POST /add_worker?url=http://HOST:PORT or a JSON body {\"url\": ...}")
        try:
            url = normalize_url(url)
        except ValueError as exc:
            return error_response(400, exc.args[0])
        status = await probe(self.health.client, url, self.settings.health_check_timeout_secs)
        try:
            worker = self.registry.add(url, healthy=status == 200)
        except KeyError as exc:  # already a worker
            return error_response(400, exc.args[0])
        log.info("added worker %s (%s)", worker.url, "in routing" if worker.healthy else "out until its health checks pass")
        return JSONResponse(worker.describe())

    async def remove_worker(self, http: Request) -> JSONResponse:
        url = await worker_url_of(http)
        if url is None:
            return error_response(400, "name the worker: POST /remove_worker?url=http://HOST:PORT or a JSON body {\"url\": ...}")
        try:
            worker = self.registry.remove(url)
        except (KeyError, ValueError) as exc:
            return error_response(404, exc.args[0])
        self.policy.forget(worker.url)
        log.info("removed worker %s", worker.url)
        return JSONResponse(worker.describe())

    async def list_workers(self, http: Request) -> JSONResponse:
        workers = self.registry.all()
        return JSONResponse({"policy": self.policy.name, "urls": [w.url for w in workers],
                             "workers": [w.describe() for w in workers]})

    async def prometheus(self, http: Request) -> Response:
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    # --- background ------------------------------------------------------------------------------

    async def evict_every(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            dropped = self.policy.evict(self.settings.max_tree_size)
            if dropped:
                log.info("evicted from the cache-aware tree (characters per worker): %s", dropped)


async def read_body(http: Request, limit: int) -> bytes | None:
    """The whole body, or None once it is past `limit` bytes."""
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    body = bytearray()
    async for piece in http.stream():
        body += piece
        if len(body) > limit:
            return None
    return bytes(body)


async def worker_url_of(http: Request) -> str | None:
    if "url" in http.query_params:
        return http.query_params["url"]
    try:
        values = json.loads(await http.body() or b"null")
    except ValueError:
        return None
    url = values.get("url") if isinstance(values, dict) else None
    return url if isinstance(url, str) else None


async def until_disconnected(http: Request, work) -> Response | None:
    """Await `work`, unless the client disconnects first: then cancel it (closing the worker's connection)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(http))
    await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def wait_for_disconnect(http: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


def build_router_app(settings: RouterSettings) -> Starlette:
    """The router's app; its HTTP client, health checks and tree eviction start and stop with the app's lifespan."""
    router = Router(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        session = worker_session(settings.max_connections, settings.request_timeout_secs, settings.connect_timeout_secs)
        async with session, aiohttp.ClientSession() as probes:
            router.open(session, probes)
            tasks = [asyncio.create_task(router.health.run(settings.health_check_interval_secs)),
                     asyncio.create_task(router.evict_every(settings.eviction_interval_secs))]
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    app = Starlette(routes=router.routes(), lifespan=lifespan)
    app.state.router = router
    return app
