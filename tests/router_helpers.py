"""In-process stand-ins for the router tests: fake workers that can be started late, hung or made sick."""

from __future__ import annotations

import time

from starlette.applications import Starlette

from moeplex.router import RouterSettings
from moeplex.router.app import build_router_app
from moeplex.router.fake_worker import FakeWorker

from live_server import LiveServer


def live_router(workers: list[str], **settings) -> LiveServer:
    return LiveServer(build_router_app(RouterSettings(worker_urls=workers, seed=0, **settings)))


def fake_worker(delay: float = 0.005) -> tuple[FakeWorker, LiveServer]:
    """A fake worker in this process and its server, bound (its URL known) but not listening until entered."""
    worker = FakeWorker("", delay)
    server = LiveServer(Starlette(routes=worker.routes()))
    worker.name = server.url.removeprefix("http://")
    return worker, server


def wait_for(condition, timeout: float = 10.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
