"""No client can hold the server's memory or connections: bodies are capped as they stream in, and a client
that stops sending (headers or body) is dropped within --read-timeout."""

from __future__ import annotations

import socket
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from moeplex.server import ServerSettings
from moeplex.server.body import BodyReader
from moeplex.server.errors import EXCEPTION_HANDLERS
from moeplex.server.processes import uvicorn_config

from live_server import LiveServer

READ_TIMEOUT = 1.0


def echo_app(settings: ServerSettings) -> Starlette:
    bodies = BodyReader(settings.max_request_bytes, settings.read_timeout)

    async def echo(http: Request) -> JSONResponse:
        return JSONResponse({"got": await bodies.json(http)})

    return Starlette(routes=[Route("/echo", echo, methods=["POST"])], exception_handlers=EXCEPTION_HANDLERS)


def served(settings: ServerSettings) -> LiveServer:
    app = echo_app(settings)
    return LiveServer(app, uvicorn_config(app, settings, "warning"))


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def closed_within(sock: socket.socket, deadline: float) -> bytes | None:
    """What the server sent before closing the connection, or None if it was still open at `deadline`."""
    received = b""
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            piece = sock.recv(65536)
        except (TimeoutError, socket.timeout):
            return None
        except ConnectionResetError:
            return received
        if not piece:
            return received
        received += piece
    return None


def test_fifty_half_open_connections_are_dropped_within_the_read_timeout():
    settings = ServerSettings(read_timeout=READ_TIMEOUT, max_request_bytes=1024)
    with served(settings) as server:
        silent = [connect(server.url) for _ in range(20)]
        headers_only = [connect(server.url) for _ in range(15)]
        half_body = [connect(server.url) for _ in range(15)]
        for sock in headers_only:
            sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")  # never ends
        for sock in half_body:
            sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"a\": ")
        started = time.monotonic()
        deadline = started + READ_TIMEOUT + 4
        answers = [closed_within(sock, deadline) for sock in silent + headers_only + half_body]
        took = time.monotonic() - started
        assert all(a is not None for a in answers), f"{sum(a is None for a in answers)} of 50 still open after {took:.1f} s"
        assert all(a.startswith(b"HTTP/1.1 408") and b"--read-timeout" in a for a in answers[35:]), answers[35]
        print(f"50 half-open connections closed within {took:.2f} s")
        for sock in silent + headers_only + half_body:
            sock.close()
        # and the server still answers
        sock = connect(server.url)
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 8\r\nConnection: close\r\n\r\n{\"a\": 1}")
        assert b'{"got":{"a":1}}' in closed_within(sock, time.monotonic() + 10)


def test_a_declared_oversized_body_is_refused_before_it_is_read():
    with served(ServerSettings(max_request_bytes=1024)) as server:
        sock = connect(server.url)
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n")
        sock.settimeout(5)
        answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 413"), answer
