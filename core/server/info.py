"""The GET endpoints: health, models, model and server information, metrics, the OpenAPI document."""

from __future__ import annotations

import asyncio
import time
from importlib.metadata import PackageNotFoundError, version

import attrs
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..disagg.book import STATES
from ..sampling import SamplingParams
from .engine_loop import EngineLoop
from .errors import ApiError
from .group import RequestGroup
from .metrics import ServerMetrics
from .middleware import OPEN_PATHS
from .openapi import openapi_document
from .served_model import ServedModel
from .settings import ServerSettings


def package_version() -> str:
    try:
        return version("moeplex")
    except PackageNotFoundError:
        return "unknown"


class InfoRoutes:
    def __init__(self, model: ServedModel, loop: EngineLoop, metrics: ServerMetrics, settings: ServerSettings, endpoints):
        self.model = model
        self.loop = loop
        self.metrics = metrics
        self.settings = settings
        self.endpoints = endpoints
        self.started = int(time.time())

    def routes(self) -> list[Route]:
        return [Route(path, handler, methods=["GET"]) for path, (handler, _) in self._table().items()]

    def _table(self) -> dict:
        return {
            "/health": (self.health, "200 while the engine loop runs and steps, 503 (with the reason) when it stopped or stalled"),
            "/health_generate": (self.health_generate, "200 once a one-token generation succeeds"),
            "/v1/models": (self.models, "the served model, OpenAI style"),
            "/get_model_info": (self.model_info, "the model's path, architecture, vocabulary and context (SGLang style)"),
            "/get_server_info": (
                self.server_info,
                "engine and server settings, KV cache pages, queue lengths, the parallel layout: DP groups and per-rank memory",
            ),
            "/metrics": (self.prometheus, "Prometheus metrics"),
            "/openapi.json": (self.openapi, "this document"),
        }

    async def health(self, http: HttpRequest) -> Response:
        if not self.loop.alive:
            raise ApiError(503, "the engine loop is not running")
        if self.loop.watchdog.stalled is not None:
            raise ApiError(503, self.loop.watchdog.stalled)
        return Response(status_code=200)

    async def health_generate(self, http: HttpRequest) -> Response:
        group = RequestGroup(self.loop)
        prompt = [self.model.bos_token_id if self.model.bos_token_id is not None else 0]
        group.add(prompt, SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
        try:
            await asyncio.wait_for(group.collect(), self.settings.health_timeout)
        except asyncio.TimeoutError:
            raise ApiError(503, f"no token within {self.settings.health_timeout} s") from None
        except ApiError as exc:
            raise ApiError(503, f"generation failed: {exc.message}") from None
        finally:
            group.abort()
        return Response(status_code=200)

    async def models(self, http: HttpRequest) -> JSONResponse:
        card = {
            "id": self.model.name,
            "object": "model",
            "created": self.started,
            "owned_by": "moeplex",
            "root": self.model.path,
            "max_model_len": self.model.context_length,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def model_info(self, http: HttpRequest) -> JSONResponse:
        m = self.model
        return JSONResponse(
            {
                "model_path": m.path,
                "tokenizer_path": m.path if m.tokenizer is not None else None,
                "served_model_name": m.name,
                "is_generation": True,
                "architectures": m.architectures,
                "vocab_size": m.vocab_size,
                "context_length": m.context_length,
                "chat_template": "default" if m.chat_template.is_default else "model",
            }
        )

    async def server_info(self, http: HttpRequest) -> JSONResponse:
        stats = self.loop.stats
        settings = attrs.asdict(self.settings)
        settings["api_key"] = "<set>" if self.settings.api_key else None
        return JSONResponse(
            {
                "version": package_version(),
                "engine": attrs.asdict(self.loop.config),
                "server": settings,
                "kv_cache": {
                    "num_pages": stats.kv_pages_total,
                    "free_pages": stats.kv_pages_free,
                    "cached_pages": stats.kv_pages_cached,
                    "used_pages": stats.kv_pages_used,  # held by requests (cached pages they read included)
                    "evictable_pages": stats.kv_pages_evictable,  # cached, read by no request
                    "page_size": stats.page_size,
                    "capacity_tokens": stats.kv_pages_total * stats.page_size,
                },
                "prefix_cache": self._prefix_cache(stats),
                "num_running_requests": stats.num_running,
                "num_queued_requests": stats.num_queued,
                "steps": stats.steps,
                "failed_steps": stats.failed_steps,
                # since start-up: engine steps by what they launched, and the overlap schedule's breaks (step_log.py)
                "engine_steps": {kind: {"steps": n, "seconds": t} for kind, (n, t) in stats.step_totals().items()},
                "overlap_breaks": stats.break_totals(),
                # per batch size: the adaptive policy's verify costs as serving measured them / as the start-up
                # measurement had them (speculation/calibration.py; sizes where they moved)
                "spec_verify_cost_scales": stats.verify_cost_scales(),
                "spec_break_cost_scales": stats.break_cost_scales(),  # the same for a break of the overlap schedule
                "spec_mixed_verify_cost_scales": stats.mixed_verify_cost_scales(),  # ... a verify step with a prompt
                "parallel": self._parallel(),
                "disaggregation": self._disaggregation(),
            }
        )

    def _disaggregation(self) -> dict:
        """The role, its transfer backend and peers, and the leader's transfer counts."""
        side, transfers = self.loop.pd, self.loop.transfers
        if side is None:
            return {"role": "none"}
        info = side.info()
        info.pop("layout", None)
        info["ranks"] = len(self.loop.facts.ranks)
        # present from start-up: before the first round's report every count is zero
        info.update(states=dict.fromkeys(STATES, 0), transfers={}, bytes=0, gb_per_second=0.0)
        if transfers is not None:
            info.update(states=transfers.states, transfers=transfers.outcomes, bytes=transfers.bytes,
                        gb_per_second=transfers.bytes / transfers.seconds / 1e9 if transfers.seconds else 0.0)
        return info

    def _prefix_cache(self, stats) -> dict:
        queried, hit = stats.cache_total("queried_tokens"), stats.cache_total("hit_tokens")
        return {
            "enabled": not self.loop.config.disable_prefix_cache,
            "cached_pages": stats.kv_pages_cached,
            "queried_tokens": queried,
            "hit_tokens": hit,
            "hit_rate": hit / queried if queried else 0.0,
            "evicted_pages": stats.cache_total("evicted_pages"),
        }

    def _parallel(self) -> dict:
        """The ranks and DP groups: each group's queues and KV pages as of the last round, each rank's memory."""
        facts, stats = self.loop.facts, self.loop.stats
        dp_groups = [
            {"dp_rank": dp, "ranks": facts.group_ranks(dp), "requests_admitted": admitted, **attrs.asdict(g)}
            for dp, (g, admitted) in enumerate(zip(stats.groups, stats.admitted))
        ]
        return {"world_size": facts.world_size, "dp_groups": dp_groups, "ranks": list(facts.ranks)}

    async def prometheus(self, http: HttpRequest) -> Response:
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    async def openapi(self, http: HttpRequest) -> JSONResponse:
        gets = {path: summary for path, (_, summary) in self._table().items()}
        document = openapi_document(self.endpoints, gets, OPEN_PATHS, package_version(), self.settings.api_key is not None)
        return JSONResponse(document)
