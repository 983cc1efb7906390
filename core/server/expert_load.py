"""Engine-call endpoints (SGLang's paths): start, stop and dump an expert-load recording, rebalance the
experts, flush the prefix cache.

Each runs on every rank between two steps (EngineLoop.call); a refusal of the engine (nothing
recorded, a wrong mode) is a 400.
"""

from __future__ import annotations

import os
import time

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse
from starlette.routing import Route

from ..moe.rebalance import placement_record
from .body import BodyReader
from .engine_loop import EngineLoop
from .errors import ApiError, bad_request

MODES = ("stat", "per-step")


class ExpertLoadRoutes:
    def __init__(self, loop: EngineLoop, dump_dir: str, bodies: BodyReader):
        self.loop = loop
        self.dump_dir = dump_dir
        self.bodies = bodies

    def routes(self) -> list[Route]:
        table = {
            "/start_expert_distribution_record": self.start,
            "/stop_expert_distribution_record": self.stop,
            "/dump_expert_distribution_record": self.dump,
            "/rebalance_experts": self.rebalance,
            "/flush_cache": self.flush_cache,
        }
        return [Route(path, handler, methods=["POST"]) for path, handler in table.items()]

    async def start(self, http: HttpRequest) -> JSONResponse:
        mode = (await self._body(http)).get("mode")
        if mode is not None and mode not in MODES:
            raise bad_request(f"mode must be one of {', '.join(MODES)}, got {mode!r}", "mode")
        await self._on_engine("start_recording", mode)
        return JSONResponse({"recording": True, "mode": mode or self.loop.config.expert_distribution_recorder_mode})

    async def stop(self, http: HttpRequest) -> JSONResponse:
        await self._body(http)  # read (within the limits) even though nothing in it is used
        await self._on_engine("stop_recording")
        return JSONResponse({"recording": False})

    async def dump(self, http: HttpRequest) -> JSONResponse:
        """Writes the dump into the server's --expert-load-dir and returns it with the file's path."""
        await self._body(http)
        path = os.path.join(self.dump_dir, f"expert_distribution_{time.time_ns()}.json")
        data = await self._on_engine("dump_recording", path)
        return JSONResponse({"path": path, **data})

    async def rebalance(self, http: HttpRequest) -> JSONResponse:
        """Balances the recorded load and moves the experts; returns the new placement (a placement file's content)."""
        await self._body(http)
        report = await self._on_engine("rebalance")
        return JSONResponse({**report.summary(), **placement_record(report.placement, None, 1)})

    async def flush_cache(self, http: HttpRequest) -> JSONResponse:
        """Empties the prefix cache on every rank, unless a running request reads from it (409, saying so)."""
        await self._body(http)
        if not await self._on_engine("flush_cache"):
            raise ApiError(409, "the prefix cache was not flushed: running requests read from it; try again when idle")
        return JSONResponse({"flushed": True})

    async def _body(self, http: HttpRequest) -> dict:
        data = await self.bodies.json(http, empty={})
        if not isinstance(data, dict):
            raise bad_request("the request body must be a JSON object")
        return data

    async def _on_engine(self, method: str, *args):
        if not self.loop.alive:
            raise ApiError(503, "the engine is not running")
        try:
            return await self.loop.call(method, *args)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
