"""The HTTP front end's part of disaggregation: bootstrap fields on requests, rooms on the prefill side, the
prefill peers of the decode side (layout check at connect time, registration of destination pages, aborts).

Both sides run on the front end's event loop, called by EngineLoop (engine_loop.py) at submit, on the leader's
reports, at a request's end and when a client goes away.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from typing import Any

import aiohttp
import attrs

from ..messages import SendKV
from ..server.errors import UPSTREAM_PREFILL, ApiError, bad_request
from .layout import KVLayout

log = logging.getLogger("moeplex.server")

MAX_ROOM = 2**63 - 1
FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


@attrs.frozen
class Bootstrap:
    """Where a request's KV comes from (decode) or which room it goes under (prefill)."""

    room: int
    host: str | None = None
    port: int | None = None

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if self.host and ":" in self.host else self.host
        return f"{host}:{self.port}"


def refuse_bootstrap(values: dict) -> None:
    """A co-located server given a disaggregated request (a router pointed at the wrong server): a 400 naming it,
    rather than serving it as if the fields were unknown extras."""
    given = next((name for name in FIELDS if values.get(name) is not None), None)
    if given is not None:
        raise bad_request(f"{given} is for a prefill or decode server; this one is co-located (--disaggregation-mode "
                          "none)", given)


def take_bootstrap(values: dict, role: str) -> Bootstrap:
    """Pop the bootstrap fields off a request body (a 400 naming what is missing or wrong)."""
    given = {name: values.pop(name, None) for name in FIELDS}
    room = given["bootstrap_room"]
    if type(room) is not int or not 0 <= room <= MAX_ROOM:
        raise bad_request(
            f"a {role} server takes requests with an integer bootstrap_room in 0..2^63-1 (got {room!r}); "
            "send them through `moeplex router --pd`", "bootstrap_room",
        )
    if role == "prefill":
        return Bootstrap(room)
    host, port = given["bootstrap_host"], given["bootstrap_port"]
    if not isinstance(host, str) or not host or type(port) is not int or not 0 < port < 65536:
        raise bad_request(
            f"a decode server needs bootstrap_host (a string) and bootstrap_port (1..65535) of the prefill server; "
            f"got {host!r} and {port!r}", "bootstrap_host",
        )
    return Bootstrap(room, host, port)


class PrefillSide:
    """Rooms of the prefill front end: which request each room is, and the decode side's registration."""

    role = "prefill"

    def __init__(self, loop, facts):
        self.loop = loop
        self.facts = facts
        config = facts.config
        self.keep_s = config.disaggregation_bootstrap_timeout + config.disaggregation_lease + config.disaggregation_transfer_timeout
        self.rid_of: dict[int, tuple[str, float]] = {}
        self.room_of: dict[str, int] = {}
        self.registered: dict[int, tuple[tuple[int, ...], tuple[bytes, ...], float]] = {}  # before the request came
        self.refused: dict[int, tuple[str, float]] = {}  # rooms whose request failed here

    def info(self) -> dict:
        ranks = self.facts.ranks
        return {
            "role": "prefill",
            "backend": self.facts.config.disaggregation_transfer_backend,
            "layout": ranks[0]["kv_layout"],
            "ranks": [r["kv_transfer_endpoint"] for r in ranks],
        }

    def submitted(self, rid: str, boot: Bootstrap) -> None:
        self._purge()
        self.rid_of[boot.room] = (rid, time.monotonic())
        self.room_of[rid] = boot.room
        registration = self.registered.pop(boot.room, None)
        if registration is not None:
            self.loop.command(SendKV(rid, registration[0], registration[1]))

    async def register(self, room: int, pages: tuple[int, ...], peers: tuple[bytes, ...]) -> tuple[int, str | None]:
        refused = self.refused.get(room)
        if refused is not None:
            return 409, refused[0]
        entry = self.rid_of.get(room)
        if entry is None:  # the decode side was faster than the router's post to us
            self._purge()
            self.registered[room] = (pages, peers, time.monotonic())
        else:
            self.loop.command(SendKV(entry[0], pages, peers))
        return 200, None

    async def abort_room(self, room: int, reason: str) -> None:
        self.registered.pop(room, None)
        entry = self.rid_of.pop(room, None)
        if entry is not None:
            self.room_of.pop(entry[0], None)
            # 500, not 503: this request failed, the prefill server did not (a router takes 502-504 as the
            # server being unavailable, retries elsewhere and, after a few, takes it out of routing)
            self.loop.drop(entry[0], 500, f"the decode server gave up on this request: {reason}")
        else:
            self.refused[room] = (f"the room was aborted: {reason}", time.monotonic())

    def aborted(self, rid: str) -> None:
        room = self.room_of.pop(rid, None)
        if room is not None:
            self.rid_of.pop(room, None)
            self.refused[room] = ("the client of the prefill request went away", time.monotonic())

    def ended(self, rid: str, error: str | None) -> None:
        if error is not None:
            room = self.room_of.pop(rid, None)
            if room is not None:
                self.refused[room] = (f"the prefill server failed the request: {error}", time.monotonic())

    def _purge(self) -> None:
        old = time.monotonic() - self.keep_s
        for table in (self.rid_of, self.refused):
            for room in [room for room, value in table.items() if value[1] < old]:
                del table[room]
        for room in [room for room, value in self.registered.items() if value[2] < old]:
            del self.registered[room]
        self.room_of = {rid: room for room, (rid, _) in self.rid_of.items()}

    async def close(self) -> None:
        pass


@attrs.define
class PrefillPeer:
    info: dict
    mismatch: str | None
    misses: int = 0  # heartbeats in a row it did not answer


class DecodeSide:
    """The decode front end's prefill peers: connect (layout check), register destinations, pass aborts on."""

    role = "decode"
    HEARTBEAT_S = 1.0
    MISSES = 3

    def __init__(self, loop, facts):
        self.loop = loop
        self.facts = facts
        self.layout = KVLayout.from_json(facts.ranks[0]["kv_layout"])
        self.timeout = facts.config.disaggregation_bootstrap_timeout
        self.peers: dict[str, PrefillPeer] = {}
        # rid -> its prefill side, while its KV has not landed: once D holds every page, nothing about P may end it
        self.rooms: dict[str, Bootstrap] = {}
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task] = set()
        self._heartbeat: asyncio.Task | None = None

    def info(self) -> dict:
        return {"role": "decode", "backend": self.facts.config.disaggregation_transfer_backend,
                "peers": {address: {"layout_ok": p.mismatch is None} for address, p in self.peers.items()}}

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        return self._session

    async def connect(self, boot: Bootstrap) -> None:
        """Before admission: the prefill server's layout must match ours, else the request is refused (and P told)."""
        peer = self.peers.get(boot.address)
        if peer is None:
            url = f"http://{boot.address}/bootstrap/info"
            try:
                async with self.session.get(url) as answer:
                    answer.raise_for_status()
                    info = await answer.json()
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                raise ApiError(502, f"cannot reach the prefill server's bootstrap endpoint {url}: {exc!r}",
                               code=UPSTREAM_PREFILL) from None
            mismatch = self.layout.mismatch(KVLayout.from_json(info["layout"]), boot.address)
            peer = self.peers[boot.address] = PrefillPeer(info, mismatch)
        if peer.mismatch is not None:
            self._spawn(self._abort_at_prefill(boot, f"the decode server refused the room: {peer.mismatch}"))
            raise ApiError(409, peer.mismatch)

    def submitted(self, rid: str, boot: Bootstrap) -> None:
        self.rooms[rid] = boot
        if self._heartbeat is None:
            self._heartbeat = asyncio.get_running_loop().create_task(self._beat())

    def landed(self, rids) -> None:
        """These requests' KV arrived whole: they decode from D's own pages, so P's death or silence is no longer
        theirs (P freed its source pages on the same DONE, so there is nothing to tell it when they end)."""
        for rid in rids:
            self.rooms.pop(rid, None)

    def reserved(self, items) -> None:
        for rid, dp_rank, pages in items:
            boot = self.rooms.get(rid)
            if boot is not None:
                self._spawn(self._register(rid, boot, dp_rank, pages))

    async def _register(self, rid: str, boot: Bootstrap, dp_rank: int, pages: tuple[int, ...]) -> None:
        peers = [self.facts.ranks[r]["kv_transfer_endpoint"] for r in self.facts.group_ranks(dp_rank)]
        url = f"http://{boot.address}/bootstrap/rooms/{boot.room}"
        try:
            async with self.session.post(url, json={"dst_pages": list(pages), "peers": peers}) as answer:
                if answer.status != 200:
                    body = await answer.json(content_type=None)
                    why = body.get("error") if isinstance(body, dict) else None
                    raise RuntimeError(why or f"HTTP {answer.status}")
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError) as exc:
            message = exc.args[0] if isinstance(exc, RuntimeError) else repr(exc)
            self.loop.drop(rid, 502, f"the prefill server {boot.address} did not take room {boot.room}: {message}",
                           UPSTREAM_PREFILL)

    def aborted(self, rid: str) -> None:
        boot = self.rooms.pop(rid, None)
        if boot is not None:
            self._spawn(self._abort_at_prefill(boot, "the client went away"))

    def ended(self, rid: str, error: str | None) -> None:
        boot = self.rooms.pop(rid, None)
        if boot is not None and error is not None:
            self._spawn(self._abort_at_prefill(boot, error))

    async def _abort_at_prefill(self, boot: Bootstrap, reason: str) -> None:
        try:
            async with self.session.post(f"http://{boot.address}/bootstrap/rooms/{boot.room}/abort", json={"reason": reason}):
                pass
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            log.info("could not tell the prefill server %s that room %d ended: %r", boot.address, boot.room, exc)

    async def _beat(self) -> None:
        """While requests wait on a prefill server for their KV, ask its bootstrap endpoint every second; after MISSES
        misses in a row those requests fail (a peer that is gone ends every wait, not only the transfer timeout).
        Requests whose KV has landed are no longer in `rooms` (see `landed`): they decode on."""
        while True:
            await asyncio.sleep(self.HEARTBEAT_S)
            for address in {boot.address for boot in self.rooms.values()}:
                peer = self.peers.get(address)
                if peer is None:
                    continue
                try:
                    async with self.session.get(f"http://{address}/bootstrap/info", timeout=aiohttp.ClientTimeout(total=1.0)) as a:
                        a.raise_for_status()
                    peer.misses = 0
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    peer.misses += 1
                if peer.misses >= self.MISSES:
                    del self.peers[address]
                    for rid, boot in list(self.rooms.items()):
                        if boot.address == address:
                            self.rooms.pop(rid)
                            self.loop.drop(rid, 502, f"the prefill server {address} stopped answering its bootstrap "
                                                     "endpoint", UPSTREAM_PREFILL)

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)
        if self._session is not None:
            await self._session.close()


def pd_side(loop, facts) -> Any:
    mode = facts.config.disaggregation_mode
    return PrefillSide(loop, facts) if mode == "prefill" else DecodeSide(loop, facts) if mode == "decode" else None


__all__ = ["Bootstrap", "DecodeSide", "PrefillSide", "base64", "pd_side", "take_bootstrap"]
