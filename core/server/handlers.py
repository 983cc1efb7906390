"""The HTTP flow every generation endpoint shares: body -> fields -> Plan -> engine -> JSON or SSE."""

from __future__ import annotations

import json
import logging
from typing import Awaitable, Callable

import attrs
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from ..disagg.frontend import refuse_bootstrap, take_bootstrap
from .body import CLIENT_CLOSED, BodyReader, parse_json
from .endpoint import Endpoint
from .engine_loop import EngineLoop
from .errors import bad_request
from .group import RequestGroup
from .schema import parse, prune
from .structured import PlanInThread
from .sse import EventStream

log = logging.getLogger("moeplex.server")
IGNORED_FIELDS_HEADER = "X-Moeplex-Ignored-Fields"  # the request fields this server dropped, comma-separated


# bodies up to this size are parsed and planned on the event loop (~0.1-0.3 ms at most; a grammar that is not compiled
# yet sends the planning to a thread: structured.PlanInThread)
INLINE_BODY_BYTES = 2048
MAX_NAMED = 32  # a body of a thousand unknown keys names the first ones, not a header of any size


def header_list(names: list[str]) -> str:
    """Names as one header value: ASCII with JSON's escapes (a key may hold any character; a header may not)."""
    shown = [json.dumps(name)[1:-1] for name in names[:MAX_NAMED]]
    more = len(names) - len(shown)
    return ", ".join(shown) + (f", and {more} more" if more else "")


def generation_route(endpoint: Endpoint, loop: EngineLoop, bodies: BodyReader,
                     strict: bool = False) -> Callable[[HttpRequest], Awaitable[Response]]:
    """`strict`: a field no declaration names is a 400 (--strict-request-fields); otherwise it is dropped, logged
    once per request and named in the answer's X-Moeplex-Ignored-Fields header."""

    async def handle(http: HttpRequest) -> Response:
        body = await bodies.read(http)
        # JSON, validation, chat templates and tokenization are CPU work: a large body's go to a thread, so /health and
        # streams keep going; a small one's take less than the two trips to a thread would cost (each trip waits for
        # an event loop pass, which under a load of streams lasts milliseconds, and its first token waits with it)
        inline = len(body) <= INLINE_BODY_BYTES
        values = parse_json(body) if inline else await run_in_threadpool(parse_json, body)
        side = loop.pd  # a prefill or decode server takes the router's bootstrap fields
        boot = take_bootstrap(values, side.role) if side is not None and isinstance(values, dict) else None
        if side is None and isinstance(values, dict):
            refuse_bootstrap(values)
        ignored: list[str] = []
        if not strict:
            values, ignored = prune(values, endpoint.fields)
        if ignored:
            log.warning("%s: ignored request fields this server does not know: %s", endpoint.path, ", ".join(ignored))
        headers = {IGNORED_FIELDS_HEADER: header_list(ignored)} if ignored else None
        plan = None
        if inline:
            try:
                plan = endpoint.plan(parse(values, endpoint.fields))
            except PlanInThread:  # a grammar not compiled yet: its compile would stall every stream
                pass
        if plan is None:
            plan = await run_in_threadpool(lambda: endpoint.plan(parse(values, endpoint.fields)))
        requests = plan.requests
        if boot is not None:
            if len(requests) != 1:
                raise bad_request(f"a disaggregated request carries one prompt and n=1; this one makes {len(requests)} sequences", "n")
            if side.role == "prefill":  # the first token only: the decode server generates the rest
                requests = [(requests[0][0], attrs.evolve(requests[0][1], max_new_tokens=1))]
            else:
                await side.connect(boot)  # refuses a prefill server whose KV layout differs, and tells it
        group = RequestGroup(loop)
        for prompt_ids, params in requests:
            group.add(prompt_ids, params, boot, plan.stream_interval)
        loop.send_queued()
        if plan.stream:
            return EventStream(endpoint.stream(plan, group), on_close=group.abort, headers=headers)
        completions = await group.collect_while_connected(http)
        if completions is None:
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(endpoint.response(plan, group, completions), headers=headers)

    handle.__name__ = endpoint.path.strip("/").replace("/", "_")
    return handle
