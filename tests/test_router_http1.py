"""The router's worker client (moeplex.router.http1): pooled keep-alive exchanges, timeouts, deadlines."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from moeplex.router.deadlines import Deadlines
from moeplex.router.http1 import Pool, UpstreamError

from router_helpers import fake_worker

BODY = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
HEADERS = [("Content-Type", "application/json")]


def test_sequential_exchanges_reuse_one_connection_and_streams_arrive_in_pieces():
    worker, server = fake_worker(delay=0.001)

    async def go():
        pool = Pool(8, read_timeout=5, connect_timeout=5, deadlines=Deadlines())
        async with pool:
            for _ in range(5):
                response = await pool.request(server.url, "POST", "/v1/completions", HEADERS, BODY)
                assert response.status == 200 and json.loads(await response.read())["text"] == "ok"
            assert sum(len(idle) for idle in pool._idle.values()) == 1, "one kept-alive connection served all five"
            response = await pool.request(server.url, "POST", "/v1/completions", HEADERS,
                                          json.dumps({"prompt": "x", "stream": True}).encode())
            pieces = [piece async for piece in response.iter_any()]
            response.release()
            assert response.header(b"content-type").startswith(b"text/event-stream")
            assert len(pieces) >= 2 and b"".join(pieces).rstrip().endswith(b"data: [DONE]")
            bad = await pool.request(server.url, "POST", "/v1/completions", HEADERS, b"[1, 2]")
            assert bad.status == 400 and b"not a JSON object" in await bad.read()

    with server:
        asyncio.run(go())


def test_a_silent_worker_times_out_and_an_unreachable_one_is_an_upstream_error():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()  # accepts connections, never answers
    silent = f"http://127.0.0.1:{listener.getsockname()[1]}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: refused

    async def go():
        pool = Pool(8, read_timeout=0.3, connect_timeout=5, deadlines=Deadlines(tick=0.05))
        async with pool:
            loop = asyncio.get_running_loop()
            began = loop.time()
            with pytest.raises(TimeoutError):
                await pool.request(silent, "POST", "/generate", HEADERS, BODY)
            assert 0.2 < loop.time() - began < 2
            with pytest.raises(UpstreamError, match="cannot connect"):
                await pool.request(closed, "POST", "/generate", HEADERS, BODY)
            assert pool._slots._value == 8, "every slot came back"

    try:
        asyncio.run(go())
    finally:
        listener.close()
