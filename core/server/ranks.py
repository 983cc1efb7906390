"""What each rank of `moeplex serve` runs: rank 0 the HTTP server around an EngineGroup, the others a Follower.

    moeplex serve (waits for its ranks; SIGTERM here becomes SIGTERM to each rank, see cli/serve.py)
      rank 0        uvicorn + the engine loop thread: one round of the EngineGroup per step
      ranks 1..N-1  Follower: receive a round, apply it, step, report; ignore SIGINT / SIGTERM
                    (rank 0 drains its requests on a signal, then halts them)
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys

import torch
import uvicorn

from ..config import EngineConfig
from ..engine import Engine
from ..engine_group import EngineGroup
from ..memory import describe, memory_report
from ..parallel import init_parallel
from ..rank_worker import Follower
from .app import build_app
from .settings import ServerSettings

log = logging.getLogger("moeplex.server")


class EngineStopped(RuntimeError):
    """The engine loop stopped without being asked to (with several ranks: a rank failed or stopped answering)."""


def serve_on_rank(rank: int, config: EngineConfig, settings: ServerSettings, log_level: str) -> None:
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    if rank != 0:
        for sig in (signal.SIGINT, signal.SIGTERM):  # stopping is rank 0's to decide
            signal.signal(sig, signal.SIG_IGN)
    engine = Engine(config, parallel=init_parallel(config.parallel, rank, torch.device(config.device)))
    log.info(describe(memory_report(engine)))
    if rank == 0:
        HttpServer(EngineGroup(engine), settings, log_level).run()
    else:
        Follower(engine).run()


class HttpServer:
    """uvicorn around the app; it stops on SIGINT / SIGTERM (draining requests) or when the engine loop stops."""

    def __init__(self, group: EngineGroup, settings: ServerSettings, log_level: str):
        self.settings = settings
        self.app = build_app(group, settings, on_engine_stopped=self._engine_stopped)
        config = uvicorn.Config(
            self.app,
            host=settings.host,
            port=settings.port,
            log_level=log_level,
            timeout_graceful_shutdown=settings.shutdown_timeout,
        )
        self.server = uvicorn.Server(config)

    def run(self) -> None:
        sys.setswitchinterval(self.settings.gil_switch_interval)  # this process is the server's: see ServerSettings
        with _signals_answered_by_uvicorn():
            self.server.run()
        failure = self.app.state.engine_loop.failure
        if failure is not None:
            raise EngineStopped(f"the engine loop stopped: {type(failure).__name__}: {failure}")

    def _engine_stopped(self) -> None:
        self.server.should_exit = True  # uvicorn checks it between ticks, so any thread may set it


@contextlib.contextmanager
def _signals_answered_by_uvicorn():
    """uvicorn answers SIGINT and SIGTERM with a graceful shutdown and afterwards raises the signal again for the
    handlers it found; the server has stopped by then, so those handlers leave the rank to exit normally."""
    found = {sig: signal.signal(sig, _already_answered) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in found.items():
            signal.signal(sig, handler)


def _already_answered(signum, frame) -> None:
    pass
