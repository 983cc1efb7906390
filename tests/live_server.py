"""A real uvicorn server on a loopback socket, in a background thread, for tests."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn


def loopback_socket() -> socket.socket:
    # IPPROTO_TCP spelled out, or asyncio leaves Nagle on and kept-alive answers wait ~40 ms for an ACK
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    return sock


class LiveServer:
    """uvicorn on a socket bound here (so the port is known and never raced), in a background thread."""

    def __init__(self, app, config: uvicorn.Config | None = None):
        """`config`: uvicorn's settings as `moeplex serve` makes them (default: uvicorn's own)."""
        self.app = app
        self.sock = loopback_socket()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(config or uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(15)
