"""The starlette application of `moeplex router`: forwarded routes, worker management, health, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Callable

import aiohttp
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from .access import RouterAccess, WorkerUrlRule, error_response
from .bodies import MANAGEMENT_BODY_BYTES, BodyRefused, ClientLeft, read_asgi_body, read_body
from .deadlines import Deadlines
from .health import HealthChecker, probe
from .metrics import RouterMetrics
from .policies import make_policy
from .proxy import Forwarder
from .request_text import TEXT_OF, routing_text
from .settings import RouterSettings
from .http1 import Pool
from .upstream import forwarded_headers, worker_session
from .workers import HEALTHY, OUT, STARTING, WorkerRegistry, normalize_url

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nobody reads it; it shows in the access log


class Router:
    """The router's state: workers, policy, metrics; the HTTP client and background tasks live with the app."""

    def __init__(self, settings: RouterSettings):
        self.settings = settings
        self.registry = WorkerRegistry(settings.worker_urls, settings.health_failure_threshold,
                                       settings.health_success_threshold, settings.worker_startup_timeout_secs, STARTING)
        self.url_rule = WorkerUrlRule(settings.worker_url_allow)
        self.policy = make_policy(settings)
        self.metrics = RouterMetrics()
        self.metrics.watch(self.registry.all, self.policy.tree_size)
        self.forwarder: Forwarder | None = None
        self.deadlines = Deadlines()  # body and worker read timeouts, checked by one task
        self.health: HealthChecker | None = None

    def open(self, session: Pool, probes: aiohttp.ClientSession) -> None:
        """Start forwarding through `session` and health checks through `probes` (a pool of their own)."""
        self.forwarder = Forwarder(session, self.registry, self.policy, self.metrics, self.settings)
        self.health = HealthChecker(probes, self.registry, self.metrics, self.settings.health_check_timeout_secs,
                                    self.settings.health_check_interval_secs)

    def routes(self) -> list[Route]:
        # POSTs to these paths go straight to `forwarded` (RouterApp); the routes answer anything else on them (405)
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

    async def forwarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A POST to a generation route, in raw ASGI: the router's hot path, with no Request, routing or
        middleware objects per request (they cost about as much CPU as the forward itself)."""
        try:
            body = await read_asgi_body(scope, receive, self.settings.max_request_bytes, self.settings.body_timeout_secs,
                                        self.deadlines)
        except BodyRefused as exc:
            response = error_response(exc.status, exc.args[0])
            response.headers["Connection"] = "close"  # the rest of the body is never read
            return await response(scope, receive, send)
        except ClientLeft:
            return await Response(status_code=CLIENT_CLOSED)(scope, receive, send)
        path = scope["path"]
        query = scope.get("query_string")
        target = f"{path}?{query.decode('latin-1')}" if query else path
        headers = forwarded_headers(scope["headers"], self.settings.worker_api_key)
        response = await forward_until_disconnected(
            receive, self.forwarder.forward("POST", target, headers, body, routing_text(path, body)))
        await (Response(status_code=CLIENT_CLOSED) if response is None else response)(scope, receive, send)

    async def generate(self, http: Request) -> Response:
        body = await body_or_refusal(http, self.settings.max_request_bytes, self.settings.body_timeout_secs)
        if isinstance(body, Response):
            return body
        text = routing_text(http.url.path, body)
        return await self._forward(http, body, text)

    async def models(self, http: Request) -> Response:
        return await self._forward(http, b"", None)

    async def _forward(self, http: Request, body: bytes, text: str | None) -> Response:
        path = http.url.path + (f"?{http.url.query}" if http.url.query else "")
        headers = forwarded_headers(http.headers.raw, self.settings.worker_api_key)
        forward = self.forwarder.forward(http.method, path, headers, body, text)
        response = await until_disconnected(http, forward)
        return Response(status_code=CLIENT_CLOSED) if response is None else response

    # --- operations ------------------------------------------------------------------------------

    async def aggregated_health(self, http: Request) -> JSONResponse:
        """200 while at least one worker is in routing, as the router's own health checks last found;
        a client's GET probes nothing (so it can neither take a worker out nor slow the router down)."""
        states = [w.state for w in self.registry.all()]
        up = states.count(HEALTHY)
        # counts only: /health is open, and worker addresses are for /list_workers (management) to show
        body = {"status": "ok" if up else "unavailable", "healthy_workers": up,
                "workers": {state: states.count(state) for state in (HEALTHY, STARTING, OUT)}}
        return JSONResponse(body, status_code=200 if up else 503)

    async def add_worker(self, http: Request) -> Response:
        url = await self._worker_url(http)
        if not isinstance(url, str):
            return url
        try:
            url = normalize_url(url)
        except ValueError as exc:
            return error_response(400, exc.args[0])
        refusal = self.url_rule.refusal(url)
        if refusal:
            return error_response(400, refusal)
        status = await probe(self.health.client, url, self.settings.health_check_timeout_secs)
        try:
            worker = self.registry.add(url, HEALTHY if status == 200 else STARTING)
        except KeyError as exc:  # already a worker
            return error_response(400, exc.args[0])
        worker.last_check = status
        self.health.check_soon(worker)
        log.info("added worker %s (%s)", worker.url, "in routing" if worker.healthy else "starting: in once a health check passes")
        return JSONResponse(worker.describe())

    async def remove_worker(self, http: Request) -> Response:
        url = await self._worker_url(http)
        if not isinstance(url, str):
            return url
        try:
            worker = self.registry.remove(url)
        except (KeyError, ValueError) as exc:
            return error_response(404, exc.args[0])
        self.policy.forget(worker.url)
        self.health.forget(worker.url)
        log.info("removed worker %s", worker.url)
        return JSONResponse(worker.describe())

    async def list_workers(self, http: Request) -> JSONResponse:
        workers = self.registry.all()
        return JSONResponse({"policy": self.policy.name, "urls": [w.url for w in workers],
                             "workers": [w.describe() for w in workers]})

    async def prometheus(self, http: Request) -> Response:
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    # --- bodies ----------------------------------------------------------------------------------

    async def _worker_url(self, http: Request) -> str | Response:
        """The worker a management call names (?url= or a JSON body {"url": ...}), or the response refusing it."""
        if "url" in http.query_params:
            return http.query_params["url"]
        body = await body_or_refusal(http, MANAGEMENT_BODY_BYTES, self.settings.body_timeout_secs)
        if isinstance(body, Response):
            return body
        try:
            values = json.loads(body or b"null")
        except (ValueError, RecursionError):
            values = None
        url = values.get("url") if isinstance(values, dict) else None
        if isinstance(url, str):
            return url
        return error_response(400, f"name the worker: POST {http.url.path}?url=http://HOST:PORT or a JSON body {{\"url\": ...}}")


async def body_or_refusal(http: Request, limit: int, timeout: float) -> bytes | Response:
    """The body under `limit` bytes, or the response that refuses it (413, 408, or nobody left to answer)."""
    try:
        return await read_body(http, limit, timeout)
    except BodyRefused as exc:
        # the rest of the body is never read: close the connection, so a client still sending it stops
        response = error_response(exc.status, exc.args[0])
        response.headers["Connection"] = "close"
        return response
    except ClientDisconnect:
        return Response(status_code=CLIENT_CLOSED)


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


async def forward_until_disconnected(receive: Receive, work) -> Response | None:
    """Await `work` in this task, unless the client disconnects first: then cancel it (closing the
    worker's connection) and answer None. One watcher task per request, no asyncio.wait."""
    task = asyncio.current_task()
    state = {"working": True, "left": False}

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if state["working"]:
            state["left"] = True
            task.cancel()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        response = await work
        state["working"] = False
        return response
    except asyncio.CancelledError:
        if state["left"] and task.uncancel() == 0:
            return None
        raise
    finally:
        state["working"] = False
        watcher.cancel()


async def wait_for_disconnect(http: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


class RouterApp(Starlette):
    """Starlette, but a POST to a generation route skips routing and middleware objects: the access
    check runs as a plain call, then Router.forwarded."""

    def __init__(self, router: Router, access: RouterAccess, **kwargs):
        super().__init__(**kwargs)
        self.router_state = router
        self.access = access
        self.fast_paths = frozenset(TEXT_OF)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.fast_paths:
            return await super().__call__(scope, receive, send)
        refusal = self.access.refusal(scope)
        if refusal is not None:
            refusal.headers["Connection"] = "close"
            return await refusal(scope, receive, send)
        # an exception here reaches the server, which answers 500 if nothing was sent yet
        await self.router_state.forwarded(scope, receive, send)


def worker_lifespan(router, settings: RouterSettings, checkers: Callable[[], list]):
    """A router app's lifespan: the pooled client to the workers (router.open), the health checks `checkers()`
    returns once it is open, and the deadline task, all stopped with the app."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        session = worker_session(settings.max_connections, settings.request_timeout_secs, settings.connect_timeout_secs,
                                 router.deadlines)
        async with session, aiohttp.ClientSession() as probes:
            router.open(session, probes)
            await asyncio.gather(*(checker.check_all_once() for checker in checkers()))
            tasks = [asyncio.create_task(checker.run()) for checker in checkers()]
            try:
                yield
            finally:
                router.deadlines.close()
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    return lifespan


def build_router_app(settings: RouterSettings) -> Starlette:
    """The router's app; its HTTP client and health checks start and stop with the app's lifespan."""
    router = Router(settings)

    lifespan = worker_lifespan(router, settings, lambda: [router.health])
    keys = dict(api_key=settings.api_key, admin_api_key=settings.admin_api_key, host=settings.host)
    access = Middleware(RouterAccess, **keys)
    app = RouterApp(router, RouterAccess(None, **keys), routes=router.routes(), lifespan=lifespan, middleware=[access])
    app.state.router = router
    return app
