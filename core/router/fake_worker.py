"""A stand-in for `moeplex serve` with a fixed service time and no model, for router tests and benchmarks.

It answers the generation routes after `--delay-ms`, serving at most `--slots` requests at once
(0: no limit), as JSON or as server-sent events ending in `data: [DONE]`; a body that is not a JSON
object is its 400, and a body with "fake_status" is answered with that status. Every answer names the
worker and the Authorization header it was sent, so a client can see where its request went and how.
POST /fake/sick makes /health answer 503; POST /fake/hang makes every route accept and never answer.
Several workers can share one process:

    python -m moeplex.router.fake_worker --count 4 --delay-ms 20     # prints {"ports": [...]} once listening
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")


class FakeWorker:
    def __init__(self, name: str, delay: float, slots: int = 0, stream_chunks: int = 4):
        self.name = name
        self.delay = delay
        self.slots = asyncio.Semaphore(slots) if slots else None
        self.stream_chunks = stream_chunks
        self.sick = False  # /health answers 503 while set
        self.hung = False  # nothing is answered while set (a stopped process: connections accepted, no reply)
        self.requests = 0
        self.in_flight = 0
        self.peak_in_flight = 0

    def routes(self) -> list[Route]:
        return [Route(path, self.generate, methods=["POST"]) for path in GENERATION_PATHS] + [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/fake/stats", self.stats, methods=["GET"]),
            Route("/fake/sick", self.set_sick, methods=["POST"]),
            Route("/fake/hang", self.set_hung, methods=["POST"]),
        ]

    async def _hang_while_hung(self) -> None:
        while self.hung:
            await asyncio.sleep(0.02)

    async def generate(self, http: Request) -> Response:
        await self._hang_while_hung()
        try:
            values = json.loads(await http.body())
        except ValueError as exc:
            values = str(exc)
        if not isinstance(values, dict):
            error = {"message": f"the request body is not a JSON object: {values}", "type": "invalid_request_error",
                     "param": None, "code": None}
            return JSONResponse({"error": error}, status_code=400)
        self.requests += 1
        if isinstance(values.get("fake_status"), int):
            return JSONResponse({"error": {"message": "refused as asked"}}, status_code=values["fake_status"])
        if values.get("stream"):
            return StreamingResponse(self._events(), media_type="text/event-stream")
        await self._serve()
        return JSONResponse({"worker": self.name, "text": "ok", "authorization": http.headers.get("authorization"),
                             "header_names": sorted(http.headers.keys())})

    async def _serve(self) -> None:
        """Hold the request for the service time, in one of the slots."""
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            if self.slots is None:
                await asyncio.sleep(self.delay)
            else:
                async with self.slots:
                    await asyncio.sleep(self.delay)
        finally:
            self.in_flight -= 1

    async def _events(self):
        await self._serve()
        for i in range(self.stream_chunks):
            yield f"data: {json.dumps({'worker': self.name, 'index': i})}\n\n".encode()
            await asyncio.sleep(self.delay / self.stream_chunks)
            await self._hang_while_hung()
        yield b"data: [DONE]\n\n"

    async def health(self, http: Request) -> Response:
        await self._hang_while_hung()
        return Response(status_code=503 if self.sick else 200)

    async def models(self, http: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": self.name}]})

    async def stats(self, http: Request) -> JSONResponse:
        return JSONResponse({"requests": self.requests, "in_flight": self.in_flight, "peak_in_flight": self.peak_in_flight})

    async def set_sick(self, http: Request) -> JSONResponse:
        self.sick = http.query_params.get("on", "1") == "1"
        return JSONResponse({"sick": self.sick})

    async def set_hung(self, http: Request) -> JSONResponse:
        self.hung = http.query_params.get("on", "1") == "1"
        return JSONResponse({"hung": self.hung})


def listening_socket(port: int = 0) -> socket.socket:
    # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY only on sockets that say so, and without it
    # Nagle's algorithm and delayed ACKs add ~40 ms to every answer on a kept-alive connection
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


async def serve(count: int, delay: float, slots: int) -> None:
    sockets = [listening_socket() for _ in range(count)]
    ports = [s.getsockname()[1] for s in sockets]
    servers = []
    for sock, port in zip(sockets, ports):
        worker = FakeWorker(f"127.0.0.1:{port}", delay, slots)
        config = uvicorn.Config(Starlette(routes=worker.routes()), log_level="warning", access_log=False)
        servers.append(uvicorn.Server(config))
    tasks = [asyncio.create_task(server.serve(sockets=[sock])) for server, sock in zip(servers, sockets)]
    while not all(server.started for server in servers):
        await asyncio.sleep(0.01)
    print(json.dumps({"ports": ports}), flush=True)
    await asyncio.gather(*tasks)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m moeplex.router.fake_worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=1, help="workers to start, each on a free 127.0.0.1 port (default: 1)")
    p.add_argument("--delay-ms", type=float, default=20.0, help="service time of each request (default: 20)")
    p.add_argument("--slots", type=int, default=0, help="requests served at once per worker; 0: no limit (default: 0)")
    args = p.parse_args(argv)
    asyncio.run(serve(args.count, args.delay_ms / 1000, args.slots))


if __name__ == "__main__":
    main()
