"""The prefill server's bootstrap endpoint: its own uvicorn on --disaggregation-bootstrap-port, on a thread.

    GET  /bootstrap/info                    every rank's transfer endpoint (base64) and the KV layout
    POST /bootstrap/rooms/{room}            a decode server's destination: {"dst_pages": [...], "peers": [b64, ...]}
    POST /bootstrap/rooms/{room}/abort      {"reason": "..."}: the decode side gave up on the room

Its own server and port, not routes of the client-facing app: decode servers reach it without the API key, and
its traffic never counts against --max-connections nor waits out the client drain. Its handlers run on its own
thread and hand each registration to the front end's event loop (PrefillSide), whose answer they return.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import threading

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

log = logging.getLogger("moeplex.server")


def bootstrap_app(side, events: asyncio.AbstractEventLoop) -> Starlette:
    """`side`: the PrefillSide on the front end's loop `events`."""

    async def on_front_end(call, *args):
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call(*args), events))

    async def info(http: Request) -> JSONResponse:
        return JSONResponse(side.info())

    async def register(http: Request) -> JSONResponse:
        try:
            room = int(http.path_params["room"])
            body = json.loads(await http.body())
            pages = tuple(int(p) for p in body["dst_pages"])
            peers = tuple(base64.b64decode(p) for p in body["peers"])
        except (ValueError, KeyError, TypeError) as exc:
            return JSONResponse({"error": f"a registration is {{'dst_pages': [int], 'peers': [base64]}}: {exc}"}, 400)
        status, message = await on_front_end(side.register, room, pages, peers)
        return JSONResponse({"error": message} if message else {"ok": True}, status)

    async def abort(http: Request) -> JSONResponse:
        try:
            room = int(http.path_params["room"])
            reason = json.loads(await http.body() or b"{}").get("reason") or "the decode server aborted the request"
        except (ValueError, AttributeError) as exc:
            return JSONResponse({"error": f"an abort is {{'reason': str}}: {exc}"}, 400)
        await on_front_end(side.abort_room, room, str(reason))
        return JSONResponse({"ok": True})

    return Starlette(routes=[
        Route("/bootstrap/info", info, methods=["GET"]),
        Route("/bootstrap/rooms/{room}", register, methods=["POST"]),
        Route("/bootstrap/rooms/{room}/abort", abort, methods=["POST"]),
    ])


class BootstrapServer:
    """uvicorn on a thread of its own (it installs no signal handlers there); stop() ends it."""

    def __init__(self, side, events: asyncio.AbstractEventLoop, host: str, port: int):
        config = uvicorn.Config(bootstrap_app(side, events), host=host, port=port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="moeplex-bootstrap", daemon=True)
        self.address = f"{host}:{port}"

    def start(self) -> None:
        self.thread.start()
        log.info("bootstrap endpoint on http://%s/bootstrap/info", self.address)

    async def stop(self) -> None:
        self.server.should_exit = True
        await asyncio.to_thread(self.thread.join, 5.0)
