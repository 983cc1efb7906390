"""The starlette application of `moeplex serve`: routes, middleware, and the engine thread's lifetime."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
from typing import Callable

import attrs
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route

from ..disagg.bootstrap import BootstrapServer
from ..disagg.frontend import PrefillSide, pd_side
from ..engine import Engine
from ..ranks.group import EngineGroup
from ..ranks.leader import EngineFacts, Leader
from ..tokenizer import load_tokenizer
from .body import BodyReader
from .engine_loop import EngineLoop
from .errors import EXCEPTION_HANDLERS
from .expert_load import ExpertLoadRoutes
from .handlers import generation_route
from .info import InfoRoutes
from .metrics import ServerMetrics
from .middleware import ApiKeyAuth, HttpMetrics
from .native import GenerateEndpoint
from .openai_chat import ChatEndpoint
from .reasoning import reasoning_parser
from .tools.parsers import PARSERS
from .openai_completions import CompletionsEndpoint
from .served_model import ServedModel
from .settings import ServerSettings
from .tokenize import TokenizerRoutes
from .watchdog import RankBeats, Watchdog


@attrs.frozen
class LeaderLink:
    """The front end's end of a leader running elsewhere (another process): its connection and start-up facts."""

    connection: multiprocessing.connection.Connection
    facts: EngineFacts
    beats: RankBeats | None = None  # this machine's ranks' heartbeats and rounds
    # the launcher's account of why the ranks stopped, waited for up to N s (EngineLoop: what clients are told)
    verdict: Callable[[float], str | None] | None = None


def build_app(
    engine: Engine | LeaderLink, settings: ServerSettings, on_engine_stopped: Callable[[], None] | None = None
) -> Starlette:
    """The app serving `engine` (one rank, led from a thread of this process) or the leader behind `link`.
    The leader starts and stops with the app.

    `on_engine_stopped` is called if the leader stops by itself (with several ranks, a rank failed).
    """
    metrics = ServerMetrics()
    tokenizer = load_tokenizer((engine.facts.config if isinstance(engine, LeaderLink) else engine.config).model)
    if isinstance(engine, LeaderLink):
        watchdog = Watchdog(engine.beats, settings.stall_timeout)
        loop = EngineLoop(engine.connection, engine.facts, metrics, on_engine_stopped, watchdog=watchdog,
                          verdict=engine.verdict, tokenizer=tokenizer, stream_interval=settings.stream_interval)
    else:
        group = EngineGroup(engine)
        here, there = multiprocessing.Pipe()
        watchdog = Watchdog(None, settings.stall_timeout)
        loop = EngineLoop(here, EngineFacts.of(group), metrics, on_engine_stopped, Leader(group, there), watchdog,
                          tokenizer=tokenizer, stream_interval=settings.stream_interval)
    metrics.watch(lambda: loop.stats)
    facts = loop.facts
    loop.pd = pd_side(loop, facts)
    metrics.watch_transfers(lambda: loop.transfers)
    model = ServedModel(facts, settings.served_model_name or facts.config.model, tokenizer)
    chat = ChatEndpoint(model, PARSERS.get(settings.tool_call_parser), reasoning_parser(settings.reasoning_parser))
    endpoints = [CompletionsEndpoint(model), chat, GenerateEndpoint(model)]
    info = InfoRoutes(model, loop, metrics, settings, endpoints)
    bodies = BodyReader(settings.max_request_bytes, settings.read_timeout)
    routes = [Route(e.path, generation_route(e, loop, bodies, settings.strict_request_fields), methods=["POST"]) for e in endpoints]
    routes += info.routes()
    routes += TokenizerRoutes(model, bodies, model.chat_template).routes()
    routes += ExpertLoadRoutes(loop, settings.expert_load_dir, bodies).routes()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        loop.start(asyncio.get_running_loop())
        bootstrap = None
        if isinstance(loop.pd, PrefillSide):
            port = facts.config.disaggregation_bootstrap_port
            bootstrap = BootstrapServer(loop.pd, asyncio.get_running_loop(), settings.host, port)
            bootstrap.start()
        try:
            yield
        finally:
            await loop.stop()
            if bootstrap is not None:
                await bootstrap.stop()
            if loop.pd is not None:
                await loop.pd.close()

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
