"""The HTTP flow every generation endpoint shares: body -> fields -> Plan -> engine -> JSON or SSE."""

from __future__ import annotations

import json
from typing import Awaitable, Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from .endpoint import Endpoint
from .engine_loop import EngineLoop
from .errors import ApiError, bad_request
from .group import RequestGroup
from .schema import parse
from .sse import EventStream

CLIENT_CLOSED = 499  # nobody reads it; it shows in the access log and in the metrics


def _no_constants(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def read_body(http: HttpRequest, limit: int) -> bytes:
    """The body's bytes; 413 past `limit` bytes (checked before and while reading)."""
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body has {declared} bytes; the limit is {limit}")
    body = bytearray()
    try:
        async for piece in http.stream():
            body += piece
            if len(body) > limit:
                raise ApiError(413, f"the request body is over the limit of {limit} bytes")
    except ClientDisconnect:
        raise ApiError(CLIENT_CLOSED, "the client disconnected while sending the request") from None
    return bytes(body)


def parse_json(body: bytes):
    """The body as JSON, or a 400 saying why it is not."""
    try:
        return json.loads(body, parse_constant=_no_constants)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None


async def read_json(http: HttpRequest, limit: int):
    return parse_json(await read_body(http, limit))


def generation_route(endpoint: Endpoint, loop: EngineLoop, max_request_bytes: int) -> Callable[[HttpRequest], Awaitable[Response]]:
    async def handle(http: HttpRequest) -> Response:
        body = await read_body(http, max_request_bytes)
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
