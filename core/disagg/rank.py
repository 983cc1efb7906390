"""One rank's side of disaggregation: its kv_transfer backend, the pages it holds for transfers, the rooms it expects.

Prefill: a request with a room runs as usual (one output token); when it finishes its pages stay held (out of the
scheduler, still owned by the request) and, once the decode side's destination is known, the group's rank i sends
its pages to the decode group's rank i. Decode: a request with a room waits here until its pages (the prompt and
the first token) can be reserved; then the rank expects them. Every change that frees or admits (EndTransfer)
comes from the leader in a round, so the ranks of a group allocate and free in the same order.
"""

from __future__ import annotations

import json
from collections import deque

from ..interfaces import KVTransfer, TransferStatus, kv_regions
from ..messages import EndTransfer, SendKV
from ..registry import lookup
from ..request import Request

METADATA_BYTES = 4096  # the first token, its logprob and up to 20 top logprobs as JSON


def first_token_row(request: Request) -> bytes:
    """The metadata row a prefill rank sends with the pages: the first token and, when asked, its logprobs."""
    row = {"token": request.output_ids[0], "logprob": request.logprobs[0] if request.logprobs else None}
    data = json.dumps(row, separators=(",", ":")).encode()
    if len(data) > METADATA_BYTES:
        raise ValueError(f"the first token's metadata takes {len(data)} bytes; the row holds {METADATA_BYTES}")
    return data


def transfer_backend(config) -> type[KVTransfer]:
    """The configured kv_transfer class, or ValueError / PluginError in one sentence when it cannot serve this role."""
    name = config.disaggregation_transfer_backend
    backend_class = lookup("kv_transfer", name)
    caps = backend_class.caps
    if not caps.cross_process:
        raise ValueError(f"kv_transfer '{name}' moves pages within one process only; a prefill and a decode server are "
                         "separate processes: choose a backend with cross_process (see `moeplex plugins`)")
    device = str(config.device).split(":")[0]
    if device not in caps.devices:
        raise ValueError(f"kv_transfer '{name}' registers {', '.join(sorted(caps.devices))} buffers, and this engine's "
                         f"KV cache is on {device}")
    return backend_class


class RankTransfers:
    def __init__(self, engine, backend: KVTransfer):
        self.engine = engine
        self.kv = engine.kv
        self.prefill = engine.config.disaggregation_mode == "prefill"
        self.tp_rank = engine.parallel.attn.rank
        self.backend = backend
        backend.register(kv_regions(self.kv.buffers, self.kv.page_size), METADATA_BYTES)
        self.rooms: dict[str, int] = {}  # rid -> room, for every request of this rank that moves KV
        self._peers: dict[bytes, str] = {}  # endpoint -> peer id
        # prefill
        self.held: dict[str, Request] = {}  # finished, pages kept for the transfer
        self.destinations: dict[str, SendKV] = {}
        self.sending: set[str] = set()  # started on this rank
        self.started: set[str] = set()  # started in the group (this rank sends or not)
        # decode
        self.queued: deque[Request] = deque()  # waiting for pages
        self.expecting: dict[str, Request] = {}
        self._reserved: list[tuple[str, tuple[int, ...]]] = []

    @classmethod
    def create(cls, engine) -> "RankTransfers":
        config = engine.config
        backend_class = transfer_backend(config)
        options = json.loads(config.disaggregation_transfer_config)
        try:
            backend = backend_class(**options)
        except TypeError as exc:
            raise ValueError(f"--disaggregation-transfer-config {config.disaggregation_transfer_config}: {exc}") from None
        return cls(engine, backend)

    def endpoint(self) -> bytes:
        return self.backend.endpoint()

    @property
    def has_work(self) -> bool:
        return bool(self.held or self.queued or self.expecting)

    # --- requests arriving ----------------------------------------------------------------------------
    def add(self, request: Request, room: int) -> bool:
        """Track a request with a room; True if the scheduler takes it now (prefill), False if it waits here."""
        self.rooms[request.rid] = room
        if self.prefill:
            return True
        self.queued.append(request)
        return False

    def before_step(self) -> None:
        """Decode: reserve pages for waiting requests, oldest first, while the pool (after evicting cached pages) allows."""
        cache = self.engine.prefix_cache
        while self.queued:
            request = self.queued[0]
            needed = self.kv.pages_for(len(request.prompt_ids) + 1)
            if cache is not None and self.kv.num_free_pages < needed:
                cache.evict(needed - self.kv.num_free_pages)
            pages = self.kv.allocate(needed)
            if pages is None:
                return
            self.queued.popleft()
            request.pages = pages
            self.backend.expect(self.rooms[request.rid], pages)
            self.expecting[request.rid] = request
            self._reserved.append((request.rid, tuple(pages)))

    def take_reserved(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        reserved, self._reserved = tuple(self._reserved), []
        return reserved

    # --- prefill: hold, then send -------------------------------------------------------------------
    def send_to(self, command: SendKV) -> None:
        if command.rid in self.rooms:
            self.destinations[command.rid] = command
            self._maybe_start(command.rid)

    def _maybe_start(self, rid: str) -> None:
        request, where = self.held.get(rid), self.destinations.get(rid)
        if request is None or where is None or rid in self.started:
            return
        self.started.add(rid)
        if self.tp_rank >= len(where.peers):
            return  # the decode group has fewer ranks: another rank of this group sends
        src = request.pages[: self.kv.pages_for(len(request.prompt_ids))]
        peer = self._peers.get(where.peers[self.tp_rank])
        if peer is None:
            peer = self._peers[where.peers[self.tp_rank]] = self.backend.connect(where.peers[self.tp_rank])
        self.backend.start(self.rooms[rid], peer, src, list(where.dst_pages[: len(src)]), first_token_row(request))
        self.sending.add(rid)

    # --- the leader's decisions ---------------------------------------------------------------------------
    def polls(self) -> dict[str, str]:
        """This rank's view of each transfer it takes part in (the leader combines the group's): pending, done, or
        failed with the backend's reason ("failed: injected failure")."""
        rids = self.sending if self.prefill else self.expecting
        polls = {}
        for rid in rids:
            status = self.backend.poll(self.rooms[rid])
            polls[rid] = status.value
            if status == TransferStatus.FAILED:
                polls[rid] += f": {self.backend.reason(self.rooms[rid])}"
        return polls

    def end(self, command: EndTransfer) -> None:
        rid = command.rid
        if self.prefill:
            request = self.held.pop(rid, None)
            self.destinations.pop(rid, None)
            self._close(rid, abort=not command.ok)
            if request is not None:
                self.engine.scheduler.finish(request)  # source pages back to the pool (or into the prefix cache)
            return
        request = self.expecting.get(rid)
        if request is None:
            queued = next((r for r in self.queued if r.rid == rid), None)
            if queued is not None and not command.ok:
                self.engine.fail(queued, command.reason)
            return
        if not command.ok:
            self.engine.fail(request, command.reason)
            return
        row = json.loads(self.backend.metadata(self.rooms[rid]).rstrip(b"\0"))
        del self.expecting[rid]
        self._close(rid, abort=False)
        request.num_cached = len(request.prompt_ids)
        self.engine.admit_transferred(request, row["token"], row["logprob"])

    def on_retire(self, request: Request) -> bool:
        """A request leaves the engine: True if its pages stay held for a transfer (prefill, finished well)."""
        rid = request.rid
        if rid not in self.rooms:
            return False
        if self.prefill and request.error is None and request.finish_reason != "abort" and request.output_ids:
            self.engine.scheduler.detach(request)
            self.held[rid] = request
            self._maybe_start(rid)
            return True
        # every other end: no byte may land in (decode) or leave from (prefill) its pages after this
        if request in self.queued:
            self.queued.remove(request)
        self.expecting.pop(rid, None)
        self.held.pop(rid, None)
        self.destinations.pop(rid, None)
        self._close(rid, abort=True)
        return False

    def abort_held(self, rid: str) -> None:
        """Prefill: the decode side or the client gave up on a finished request: free its held pages now."""
        self.end(EndTransfer(rid, ok=False))

    def _close(self, rid: str, abort: bool) -> None:
        room = self.rooms.pop(rid, None)
        self.started.discard(rid)
        self.sending.discard(rid)
        if room is None:
            return
        if abort:
            self.backend.abort(room)
        self.backend.release(room)

    def close(self) -> None:
        self.backend.close()


__all__ = ["RankTransfers", "TransferStatus", "first_token_row", "METADATA_BYTES"]
