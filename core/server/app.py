"""The starlette application of `moeplex serve`: routes, middleware, and the engine thread's lifetime."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Callable

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route

from ..engine import Engine
from ..engine_group import EngineGroup
from .engine_loop import EngineLoop
from .errors import EXCEPTION_HANDLERS
from .expert_load import ExpertLoadRoutes
from .handlers import generation_route
from .info import InfoRoutes
from .metrics import ServerMetrics
from .middleware import ApiKeyAuth, HttpMetrics
from .native import GenerateEndpoint
from .openai_chat import ChatEndpoint
from .openai_completions import CompletionsEndpoint
from .served_model import ServedModel
from .settings import ServerSettings


def build_app(
    engine: Engine | EngineGroup, settings: ServerSettings, on_engine_stopped: Callable[[], None] | None = None
) -> Starlette:
    """The app serving `engine` (one rank) or a group of ranks; the engine thread starts and stops with the app.

    `on_engine_stopped` is called if the engine loop stops by itself (with several ranks, a rank failed).
    """
    group = engine if isinstance(engine, EngineGroup) else EngineGroup(engine)
    metrics = ServerMetrics()
    loop = EngineLoop(group, metrics, on_engine_stopped)
    metrics.watch(lambda: loop.stats)
    model = ServedModel(group.engine, settings.served_model_name or group.engine.config.model, group.capacity_tokens)
    endpoints = [CompletionsEndpoint(model), ChatEndpoint(model), GenerateEndpoint(model)]
    info = InfoRoutes(model, loop, metrics, settings, endpoints)
    routes = [Route(e.path, generation_route(e, loop, settings.max_request_bytes), methods=["POST"]) for e in endpoints]
    routes += info.routes()
    routes += ExpertLoadRoutes(loop, settings.expert_load_dir, settings.max_request_bytes).routes()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(loop.stop)

    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers=EXCEPTION_HANDLERS,
        middleware=[
            Middleware(HttpMetrics, metrics=metrics, paths=tuple(r.path for r in routes)),
            Middleware(ApiKeyAuth, api_key=settings.api_key),
        ],
    )
    app.state.engine_loop = loop
    app.state.served_model = model
    return app
