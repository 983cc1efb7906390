"""`moeplex router --pd` blames the server that failed: a decode server's 502 that names its prefill server
(`X-Moeplex-Failed-Server: prefill`) counts against that prefill server, never against the decode server, and
the retry goes to another prefill server. In-process stand-ins for P and D."""

from __future__ import annotations

import json

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from moeplex.router import RouterSettings
from moeplex.router.pd import build_pd_router_app

from live_server import LiveServer

DEAD_BOOTSTRAP = 9  # the stand-in D cannot reach the prefill server whose bootstrap port is this


def stand_in(decode: bool, blame_header: bool = True) -> LiveServer:
    """A prefill server (answers every request) or a decode server (a 502 for requests whose prefill server's
    bootstrap port is DEAD_BOOTSTRAP, naming it when `blame_header`; an answer otherwise)."""

    async def generate(http: Request) -> JSONResponse:
        body = json.loads(await http.body())
        if decode and body["bootstrap_port"] == DEAD_BOOTSTRAP:
            headers = {"X-Moeplex-Failed-Server": "prefill"} if blame_header else None
            error = {"message": "cannot reach the prefill server's bootstrap endpoint", "code": "upstream_prefill"}
            return JSONResponse({"error": error}, status_code=502, headers=headers)
        return JSONResponse({"choices": [{"text": "ok", "role": "decode" if decode else "prefill"}]})

    async def health(http: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    return LiveServer(Starlette(routes=[Route("/v1/completions", generate, methods=["POST"]),
                                        Route("/health", health, methods=["GET"])]))


def pd_router(prefills: list[tuple[LiveServer, int]], decode: LiveServer, retries: int) -> LiveServer:
    settings = RouterSettings(pd=True, prefill=[f"{p.url},{port}" for p, port in prefills], decode=[decode.url],
                              max_retries=retries, retry_backoff_ms=1, health_check_interval_secs=60, seed=0)
    return LiveServer(build_pd_router_app(settings))


def workers(router: LiveServer) -> dict:
    return httpx.get(f"{router.url}/list_workers").json()


def forward_failures(router: LiveServer, server: LiveServer) -> float:
    text = httpx.get(f"{router.url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("moeplex_router_forward_failures_total") and f'"{server.url}"' in line)


@pytest.mark.parametrize("blame_header", [True, False], ids=["names-prefill", "names-nobody"])
def test_a_decode_servers_502_for_its_prefill_server_counts_against_the_prefill_server(blame_header):
    p, d = stand_in(decode=False), stand_in(decode=True, blame_header=blame_header)
    with p, d, pd_router([(p, DEAD_BOOTSTRAP)], d, retries=0) as router:
        statuses = [httpx.post(f"{router.url}/v1/completions", json={"prompt": "x"}).status_code
                    for _ in range(5)]  # past --health-failure-threshold (3)
        listed, p_failures, d_failures = workers(router), forward_failures(router, p), forward_failures(router, d)
    prefill, decode = listed["prefill"][0], listed["decode"][0]
    if blame_header:
        assert decode["state"] == "healthy" and decode["failures_in_a_row"] == 0 and d_failures == 0, decode
        # P's own answers (200, often before D's 502) count for nothing: three blamed requests take P out
        assert prefill["state"] == "out" and p_failures == 3, prefill
        assert statuses == [502] * 3 + [503] * 2, statuses
    else:  # a 502 that names nobody is the decode server's own (the control: the test can tell them apart)
        assert decode["state"] == "out" and d_failures >= 3, decode


def test_with_two_prefill_servers_the_retry_goes_to_the_other_and_every_request_is_answered():
    dead, alive, d = stand_in(decode=False), stand_in(decode=False), stand_in(decode=True)
    with dead, alive, d, pd_router([(dead, DEAD_BOOTSTRAP), (alive, 10)], d, retries=2) as router:
        answers = [httpx.post(f"{router.url}/v1/completions", json={"prompt": f"request {i}"}) for i in range(12)]
        listed = workers(router)
    assert [a.status_code for a in answers] == [200] * 12, [a.text for a in answers if a.status_code != 200]
    assert listed["decode"][0]["state"] == "healthy", listed
