"""A prefill server's death is contained to the requests that still needed it (docs/pd.md, "Every wait ends").

Processes on loopback (zmq): three prefill servers P1..P3, one decode server D, a `moeplex router --pd` per test.
A P is SIGKILLed while 40 requests are spread over decoding (their KV landed on D), transferring and waiting:
- the decoding ones finish, token for token, long after D's heartbeat has noticed P's death;
- the others fail fast, each with a reason;
- D is never blamed: no forward failure is counted against it and it stays in routing;
- D's pool (and a surviving P's) returns to empty; with two P servers the survivor takes the new requests.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from moeplex.sampling import SamplingParams

from pd_cluster import PDRouter, RoleServer, running, wait_idle
from test_server_parallel import folder, reference  # noqa: F401 (fixtures: the tiny DeepSeek-V3 and its engine)

ZMQ_QUICK = ("--disaggregation-transfer-config", '{"timeout_s": 2.0, "heartbeat_s": 0.2}')
DEADLINES = ("--disaggregation-transfer-timeout", "8", "--disaggregation-lease", "8",
             "--disaggregation-bootstrap-timeout", "8")
LONG, SHORT = 6, 32  # requests decoding when P dies, and requests sent just before
# the decoding requests ask for more tokens than any machine makes in the seconds this test watches them: each must
# still be decoding after D noticed P's death (then the client closes it); the others finish or fail meanwhile
LONG_TOKENS, SHORT_TOKENS, CHECKED_TOKENS = 3000, 4, 16
HEARTBEAT_NOTICE_S = 3.0  # DecodeSide: three missed one-second heartbeats fail what waits on a P
WATCH_S = HEARTBEAT_NOTICE_S + 4.0  # the decoding requests are watched this long after the kill
FAIL_FAST_S = 15.0  # every request that needed the dead P ends within this of the kill


def prompt(i: int) -> list[int]:
    return [256] + [(41 * i + k) % 250 + 1 for k in range(5 + i % 29)]


@pytest.fixture(scope="module")
def fleet(folder):
    p1, p2, p3 = (RoleServer(folder, "prefill", *DEADLINES, *ZMQ_QUICK) for _ in range(3))
    d = RoleServer(folder, "decode", *DEADLINES, *ZMQ_QUICK, "--max-total-tokens", "32768")
    with running(p1, p2, p3, d):
        yield {"p1": p1, "p2": p2, "p3": p3, "d": d}


def expected(reference, indices: list[int], tokens: int) -> dict[int, list[int]]:
    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    outputs = reference.generate([prompt(i) for i in indices], params)
    return {i: out.output_ids for i, out in zip(indices, outputs)}


class Call:
    """One streamed completion: its status, token ids, error, and when it got its first token and ended."""

    def __init__(self, i: int, tokens: int):
        self.i, self.tokens = i, tokens
        self.status: int | None = None
        self.ids: list[int] = []
        self.error: str | None = None
        self.first_at: float | None = None
        self.last_at: float | None = None  # its latest token
        self.ended_at: float | None = None

    async def run(self, client: httpx.AsyncClient, stream: bool) -> None:
        body = {"prompt": prompt(self.i), "max_tokens": self.tokens, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "stream": stream}
        try:
            if stream:
                await self._stream(client, body)
            else:
                answer = await client.post("/v1/completions", json=body)
                self.status, data = answer.status_code, answer.json()
                if self.status == 200:
                    self.ids = data["choices"][0]["token_ids"]
                else:
                    self.error = data["error"]["message"]
        finally:
            self.ended_at = time.monotonic()

    async def _stream(self, client: httpx.AsyncClient, body: dict) -> None:
        async with client.stream("POST", "/v1/completions", json=body) as answer:
            self.status = answer.status_code
            if self.status != 200:
                self.error = json.loads(await answer.aread() or b"{}").get("error", {}).get("message", "")
                return
            async for line in answer.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    self.error = event["error"]["message"]
                    return
                ids = event["choices"][0].get("token_ids") or []
                if ids:
                    self.last_at = time.monotonic()
                    self.first_at = self.first_at or self.last_at
                self.ids += ids

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


async def kill_mid_load(url: str, victim: RoleServer) -> tuple[list[Call], list[Call], float]:
    """LONG streams decoding (each has its first token, so its KV is on D), then SHORT requests sent (streams and
    plain, alternating); the victim is killed while those are waiting, prefilling and transferring. The long
    streams are watched until WATCH_S after the kill and every short one has ended; then their clients close them."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        longs = [Call(i, LONG_TOKENS) for i in range(LONG)]
        long_tasks = [asyncio.ensure_future(c.run(client, stream=True)) for c in longs]
        deadline = time.monotonic() + 120
        while not all(c.first_at or c.ended_at for c in longs):
            assert time.monotonic() < deadline, "the long requests did not start decoding"
            await asyncio.sleep(0.01)
        shorts = [Call(LONG + i, SHORT_TOKENS) for i in range(SHORT)]
        short_tasks = [asyncio.ensure_future(c.run(client, stream=i % 2 == 0)) for i, c in enumerate(shorts)]
        await asyncio.sleep(0.05)  # some of them reach P, some are being prefilled or moved when it dies
        victim.kill()
        killed_at = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*short_tasks), 120)
        await asyncio.sleep(max(0.0, killed_at + WATCH_S - time.monotonic()))
        for task in long_tasks:
            task.cancel()  # the client goes away: D aborts the request and frees its pages
        await asyncio.gather(*long_tasks, return_exceptions=True)
    return longs, shorts, killed_at


def decode_blamed(router: PDRouter, decode: RoleServer) -> tuple[dict, float]:
    """D as the router sees it, and the forward failures the router counted against it."""
    workers = router.client.get("/list_workers").json()["decode"]
    text = router.client.get("/metrics").text
    failures = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("moeplex_router_forward_failures_total") and decode.url in line)
    return workers[0], failures


def check(longs: list[Call], shorts: list[Call], killed_at: float, reference) -> list[Call]:
    """The rules every scenario keeps; the short requests that failed."""
    print(f"decoding requests: {[len(c.ids) for c in longs]} tokens, the last {max(c.last_at for c in longs) - killed_at:.1f} s "
          f"after the kill; {sum(not c.ok for c in shorts)} of {len(shorts)} others failed")
    want = expected(reference, [c.i for c in longs], CHECKED_TOKENS)
    for c in longs:  # decoding when P died: P's death is not theirs; they decode on, their own tokens
        assert c.status == 200 and c.error is None, (c.i, c.status, c.error)
        # still decoding after D noticed P's death (a machine that finished them sooner would show nothing here)
        assert c.last_at > killed_at + HEARTBEAT_NOTICE_S + 0.5, (c.i, c.last_at - killed_at, len(c.ids))
        checked = c.ids[:CHECKED_TOKENS]  # a loaded machine may have decoded fewer by the time the client left
        assert checked and checked == want[c.i][: len(checked)], (c.i, checked, want[c.i])
    want = expected(reference, [c.i for c in shorts if c.ok], SHORT_TOKENS)
    for c in shorts:
        if c.ok:
            assert c.ids == want[c.i], f"request {c.i} answered from KV that is not its own"
        else:
            assert c.error, (c.i, c.status)  # a reason
            assert c.ended_at - killed_at < FAIL_FAST_S, (c.i, c.ended_at - killed_at, c.error)
    return [c for c in shorts if not c.ok]


def test_the_server_info_shows_transfer_states_before_the_first_transfer(fleet):
    for server in fleet.values():
        states = server.info()["disaggregation"]["states"]
        assert states == {"bootstrapping": 0, "waiting": 0, "transferring": 0}, (server.mode, states)


def test_a_decode_server_names_the_prefill_server_as_the_one_that_failed(fleet):
    """D's 502 for an unreachable P carries the code and header that let a router blame P, not D."""
    d = fleet["d"]
    body = {"prompt": prompt(0), "max_tokens": 2, "bootstrap_host": "127.0.0.1", "bootstrap_port": 9,
            "bootstrap_room": 7}  # the discard port: nobody answers there
    answer = d.client.post("/v1/completions", json=body)
    assert answer.status_code == 502 and answer.headers["x-moeplex-failed-server"] == "prefill", answer.text
    assert answer.json()["error"]["code"] == "upstream_prefill"


def test_a_prefill_death_fails_only_the_requests_that_still_needed_it(fleet, reference):
    p1, d = fleet["p1"], fleet["d"]
    with PDRouter([p1], [d], "--max-retries", "0") as router:
        longs, shorts, killed_at = asyncio.run(kill_mid_load(router.url, p1))
        failed = check(longs, shorts, killed_at, reference)
        assert failed, "the kill caught no request in flight"
        worker, failures = decode_blamed(router, d)
        assert worker["state"] == "healthy" and failures == 0, (worker, failures)
    wait_idle(d, timeout=30)
    assert d.client.get("/health").status_code == 200


def test_with_two_prefill_servers_the_survivor_takes_the_new_requests(fleet, reference):
    p2, p3, d = fleet["p2"], fleet["p3"], fleet["d"]
    with PDRouter([p2, p3], [d]) as router:
        longs, shorts, killed_at = asyncio.run(kill_mid_load(router.url, p2))
        check(longs, shorts, killed_at, reference)
        worker, failures = decode_blamed(router, d)
        assert worker["state"] == "healthy" and failures == 0, (worker, failures)
        after = [Call(100 + i, SHORT_TOKENS) for i in range(8)]

        async def again():
            async with httpx.AsyncClient(base_url=router.url, timeout=60) as client:
                await asyncio.gather(*(c.run(client, stream=i % 2 == 0) for i, c in enumerate(after)))

        asyncio.run(again())
        want = expected(reference, [c.i for c in after], SHORT_TOKENS)
        assert all(c.ok and c.ids == want[c.i] for c in after), [(c.i, c.status, c.error) for c in after]
        assert router.client.get("/list_workers").json()["decode"][0]["state"] == "healthy"
    wait_idle(p3, d, timeout=30)
