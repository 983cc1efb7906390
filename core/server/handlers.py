"""The HTTP flow every generation endpoint shares: body -> fields -> Plan -> engine -> JSON or SSE."""

from __future__ import annotations

from typing import Awaitable, Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from .body import CLIENT_CLOSED, BodyReader, parse_json
from .endpoint import Endpoint
from .engine_loop import EngineLoop
from .group import RequestGroup
from .schema import parse
from .sse import EventStream


def generation_route(endpoint: Endpoint, loop: EngineLoop, bodies: BodyReader) -> Callable[[HttpRequest], Awaitable[Response]]:
    async def handle(http: HttpRequest) -> Response:
        body = await bodies.read(http)
        # JSON, validation, chat templates and tokenization are CPU work: in a thread, so /health and streams keep going
        plan = await run_in_threadpool(lambda: endpoint.plan(parse(parse_json(body), endpoint.fields)))
        group = RequestGroup(loop)
        for prompt_ids, params in plan.requests:
            group.add(prompt_ids, params)
        if plan.stream:
            return EventStream(endpoint.stream(plan, group), on_close=group.abort)
        completions = await group.collect_while_connected(http)
        if completions is None:
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(endpoint.response(plan, group, completions))

    handle.__name__ = endpoint.path.strip("/").replace("/", "_")
    return handle
