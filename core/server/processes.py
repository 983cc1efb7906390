"""The processes of `moeplex serve`: the HTTP front end here, every rank of the engine spawned.

    moeplex serve   the front end: uvicorn, tokenizer, request mirrors, streaming (app.py, engine_loop.py);
                    SIGINT / SIGTERM here drain the requests in flight, then halt the leader
      rank 0        the leader (ranks/leader.py): the front end's commands in through a pipe, one EngineGroup round
                    per step, one report per round back
      ranks 1..N-1  Follower: receive a round, apply it, step, report
    Every rank ignores SIGINT / SIGTERM: stopping is the front end's to decide, and the leader halts the others.

Two processes even for one rank: the forward steps and the HTTP work then never wait for each other's GIL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import signal
import sys
import threading
from multiprocessing.connection import Connection
from typing import Callable

import attrs
import torch
import torch.multiprocessing as mp
import uvicorn

from ..config import EngineConfig
from ..engine import Engine
from ..memory import describe, memory_report
from ..parallel import init_parallel, rank_device
from ..ranks.group import EngineGroup
from ..ranks.launcher import RankFailed, last_line, launch
from ..ranks.leader import EngineFacts, Leader
from ..ranks.warmup import warm_up
from ..ranks.worker import Follower
from .app import LeaderLink, build_app
from .body import protocol_with_header_deadline
from .engine_loop import EngineStopped
from .settings import ServerSettings
from .watchdog import RankBeats

log = logging.getLogger("moeplex.server")


def serve(config: EngineConfig, settings: ServerSettings, log_level: str) -> None:
    """Start the ranks, serve HTTP until a signal or a failed rank; RankFailed / EngineStopped say what went wrong."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    here, there = multiprocessing.get_context("spawn").Pipe()
    parallel = config.parallel
    beats = RankBeats(parallel.ranks_per_node, parallel.node_rank * parallel.ranks_per_node)
    ranks = RankProcesses(config, there, log_level, settings.warmup, beats)
    if parallel.node_rank != 0:  # HTTP is node 0's: this node's ranks follow its leader until it halts them
        log.info("node %d: ranks follow node 0's leader; node 0 serves HTTP", parallel.node_rank)
        try:
            ranks.join()
        finally:
            here.close()
            there.close()
        return
    try:
        facts = _first_message(here, ranks)
    finally:
        there.close()  # the ranks hold their own copy: the leader's exit must reach `here` as the end of the pipe
    server = HttpServer(LeaderLink(here, facts, beats, ranks.verdict), settings, log_level)
    try:
        server.run()
    finally:
        here.close()  # a leader still waiting (say uvicorn could not bind its port) sees the pipe end and halts
    blamed = server.app.state.engine_loop.watchdog.blamed
    try:
        ranks.join()
    except RankFailed as exc:  # a collective that timed out fails on a healthy rank: say who stopped first
        raise RankFailed(f"{blamed}; then: {exc}" if blamed else str(exc)) from None
    failure = server.app.state.engine_loop.failure
    if failure is not None:
        raise failure


def _first_message(here: Connection, ranks: "RankProcesses") -> EngineFacts:
    """Rank 0's start-up facts; RankFailed as soon as the ranks have stopped instead (this process still holds
    the pipe's other end until the ranks are up, so their exit alone never ends the wait)."""
    while not here.poll(0.2):
        if not ranks.thread.is_alive():
            ranks.join()
            raise RankFailed("rank 0 stopped during start-up")
    try:
        return here.recv()
    except EOFError:  # rank 0 is gone before it could lead
        ranks.join()
        raise RankFailed("rank 0 stopped during start-up") from None


class RankProcesses:
    """Every local rank in a process of its own, waited for on a thread; join() raises RankFailed if one failed."""

    def __init__(self, config: EngineConfig, connection: Connection, log_level: str, warmup: bool, beats: RankBeats):
        self.failure: RankFailed | None = None
        args = (config, connection, log_level, warmup, beats)
        self.thread = threading.Thread(target=self._run, args=args, name="moeplex-ranks", daemon=True)
        self.thread.start()

    def _run(self, config: EngineConfig, connection: Connection, log_level: str, warmup: bool, beats: RankBeats) -> None:
        args = (config, connection, log_level, warmup, beats)
        try:
            if config.parallel.distributed:
                launch(serve_on_rank, config.parallel, *args, device=config.device)
            else:  # launch() would run one rank in this process: spawn it, as the front end must stay apart
                try:
                    mp.start_processes(serve_on_rank, args=args, start_method="spawn")
                except mp.ProcessRaisedException as exc:
                    raise RankFailed(f"rank 0 failed: {last_line(str(exc))}") from None
                except mp.ProcessExitedException as exc:
                    raise RankFailed(f"rank 0 died (exit code {exc.exit_code})") from None
        except RankFailed as exc:
            self.failure = exc

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)
        if self.failure is not None:
            raise self.failure

    def verdict(self, timeout: float) -> str | None:
        """Why the ranks stopped, in the launcher's words ("rank 1 died (exit code -9); ..."), waiting up to `timeout`
        for it; None if they have not stopped by then, or stopped cleanly."""
        self.thread.join(timeout)
        return str(self.failure) if self.failure is not None else None


def serve_on_rank(
    rank: int, config: EngineConfig, connection: Connection, log_level: str, warmup: bool, beats: RankBeats
) -> None:
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    for sig in (signal.SIGINT, signal.SIGTERM):  # stopping is the front end's to decide
        signal.signal(sig, signal.SIG_IGN)
    beats.start_beating(rank)
    config = attrs.evolve(config, device=rank_device(config.device, rank, config.parallel))
    engine = Engine(config, parallel=init_parallel(config.parallel, rank, torch.device(config.device)))
    log.info(describe(memory_report(engine)))
    if rank == 0:
        group = EngineGroup(engine)
        if warmup and engine.device.type == "cuda":  # the followers step along in their loop
            warm_up(group)
        connection.send(EngineFacts.of(group))
        Leader(group, connection, lambda: beats.round_done(rank)).run()
    else:
        connection.close()  # only the leader talks to the front end
        Follower(engine, lambda: beats.round_done(rank)).run()


class HttpServer:
    """uvicorn around the app; it stops on SIGINT / SIGTERM (draining requests) or when the leader stops."""

    def __init__(self, link: LeaderLink, settings: ServerSettings, log_level: str):
        self.settings = settings
        self.app = build_app(link, settings, on_engine_stopped=self._engine_stopped)
        self.server = DrainingServer(uvicorn_config(self.app, settings, log_level), settings.shutdown_timeout,
                                     self.app.state.engine_loop.expire)

    def run(self) -> None:
        sys.setswitchinterval(self.settings.gil_switch_interval)  # this process is the server's: see ServerSettings
        with _signals_answered_by_uvicorn():
            self.server.run()

    def _engine_stopped(self) -> None:
        self.server.should_exit = True


FINAL_WORDS_S = 2.0  # after the drain time, for the 503s and error events to reach their clients


def uvicorn_config(app, settings: ServerSettings, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=log_level,
        timeout_graceful_shutdown=settings.shutdown_timeout + FINAL_WORDS_S,
        http=protocol_with_header_deadline(settings.read_timeout),
        limit_concurrency=settings.max_connections,
    )


class DrainingServer(uvicorn.Server):
    """uvicorn, whose shutdown first fails what is still running when the drain time is over (`expire`): past its own
    graceful timeout uvicorn cancels the requests, and a cancelled request gets a plain-text 500 or a cut stream."""

    def __init__(self, config: uvicorn.Config, drain_s: float, expire: Callable[[str], None]):
        super().__init__(config)
        self.drain_s = drain_s
        self.expire = expire

    async def shutdown(self, sockets=None) -> None:
        message = f"the server is shutting down and its --shutdown-timeout of {self.drain_s:g} s has run out"
        deadline = asyncio.get_running_loop().call_later(self.drain_s, self.expire, message)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()


@contextlib.contextmanager
def _signals_answered_by_uvicorn():
    """uvicorn answers SIGINT and SIGTERM with a graceful shutdown and afterwards raises the signal again for the
    handlers it found; the server has stopped by then, so those handlers leave the process to exit normally."""
    found = {sig: signal.signal(sig, _already_answered) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in found.items():
            signal.signal(sig, handler)


def _already_answered(signum, frame) -> None:
    pass


__all__ = ["EngineStopped", "serve"]
