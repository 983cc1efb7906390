"""`zmq`: KV pages over TCP with pyzmq, between processes or hosts; GPU pages staged through pinned host memory.

One I/O thread per instance owns every socket: a ROUTER the receiver side listens on, and one DEALER per
connected receiver. The caller's calls only queue commands for it (and wake it through a pipe), so none
of them waits on the network.

Sender: for each started room the thread reads one chunk of a page run (every region, at most
`chunk_bytes`) into a fresh host buffer, sends it as [P, {room, dst, n}, one frame per region], and after
the last chunk [E, {room, pages}, metadata row]. Reading happens under the instance's lock after a check
that the room is still live, so once `abort` returns no byte of the source pages is read again (abort also
tells the receiver, [X, room]). CUDA regions: `start` records an event on the caller's stream and the
thread's side stream waits for it before copying to pinned memory, so the prefill's KV writes are in.

Receiver: a chunk for a room it `expect`s, on pages the room owns, is written into the registered tensors
under the lock (dropped otherwise, and the sender told [F, room, reason]); on [E] with every page in, the
room turns DONE and only then the sender hears [A, room] and its `poll` turns DONE.

Liveness: while a sender has rooms in flight to a peer it pings it every `heartbeat_s`; a peer silent for
`timeout_s` fails those rooms (a dead or unreachable receiver). A receiver fails a begun room whose sender
has been silent for `timeout_s` (a dead sender). A room expected but never begun waits for the caller's
own deadline and `abort`.

Options (constructor arguments): host (address bound and advertised, default 127.0.0.1), port (0: any),
timeout_s, heartbeat_s, chunk_bytes, fail_rate and seed (injected failures: a started transfer fails on
both sides with that probability, for fault tests).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import uuid
from typing import Sequence

import torch
import zmq

from moeplex.interfaces import KVRegion, KVTransferCaps, TransferStatus

from .common import DONE, FAILED, PENDING, Faults, Layout, PipedBackend, Rooms, decode_endpoint, encode_endpoint, page_slice


class _Out:
    """A room this instance sends: its chunks, the next one to send, and the CUDA event its pages wait for."""

    def __init__(self, room: int, peer: str, chunks: list, metadata: bytes, ready):
        self.room, self.peer, self.chunks, self.metadata, self.ready = room, peer, chunks, metadata, ready
        self.next = 0
        self.pages = sum(n for chunk in chunks for _, _, n in chunk)
        self.finished_sending = False


class _Peer:
    def __init__(self, sock: zmq.Socket):
        self.sock = sock
        self.outbox: list[list] = []  # messages zmq has not taken yet (its queue was full)
        self.heard = time.monotonic()
        self.pinged = 0.0


class ZmqTransfer(PipedBackend):
    label = "zmq"
    room_books = ("_expected", "_landed", "_senders", "_metadata", "_peer_of")  # per-room dicts that release() clears
    caps = KVTransferCaps(devices=frozenset({"cpu", "cuda"}), cross_host=True)

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0, heartbeat_s: float = 0.5,
                 chunk_bytes: int = 4 << 20, fail_rate: float = 0.0, seed: int = 0):
        self.host, self.port = host, port
        self.timeout_s, self.heartbeat_s, self.chunk_bytes = timeout_s, heartbeat_s, chunk_bytes
        self.faults = Faults(fail_rate, seed)
        self.id = uuid.uuid4().hex
        self.regions: list[KVRegion] = []
        self.layout: Layout | None = None
        self._lock = threading.Lock()  # rooms, and the bytes of live rooms' pages
        self._in, self._out = Rooms(), Rooms()
        self._expected: dict[int, frozenset[int]] = {}
        self._landed: dict[int, int] = {}  # room -> pages written
        self._senders: dict[int, bytes] = {}  # room -> the routing id of the sender that began it
        self._heard_senders: dict[bytes, float] = {}  # routing id -> when the receiver last heard from it
        self._metadata: dict[int, bytes] = {}
        self._layouts: dict[str, Layout] = {}  # peer id -> its layout
        self._peer_of: dict[int, str] = {}  # room -> the peer it was started to
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    # --- the contract ---------------------------------------------------------------------------------
    def register(self, regions: Sequence[KVRegion], metadata_bytes: int) -> None:
        if self._thread is not None:
            raise RuntimeError("zmq: the KV regions are registered once")
        self.layout = Layout.of(regions, metadata_bytes)
        self.regions = list(regions)
        self._cuda = any(r.tensor.is_cuda for r in regions)
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if self.port:
            self._router.bind(f"tcp://{self.host}:{self.port}")
            self.address = f"tcp://{self.host}:{self.port}"
        else:
            self.address = f"tcp://{self.host}:{self._router.bind_to_random_port(f'tcp://{self.host}')}"
        self._wake_r, self._wake_w = os.pipe()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="moeplex-kv-zmq", daemon=True)
        self._thread.start()

    def endpoint(self) -> bytes:
        return encode_endpoint("zmq", self._registered(), id=self.id, address=self.address)

    def connect(self, peer: bytes) -> str:
        data, layout = decode_endpoint(peer, "zmq")
        self._registered().check_peer(layout, "zmq")
        peer_id = f"{data['id']}@{data['address']}"
        if peer_id not in self._layouts:
            self._layouts[peer_id] = layout
            self._command(("connect", peer_id, data["address"]))
        return peer_id

    def expect(self, room: int, dst_pages: Sequence[int]) -> None:
        self._landed[room] = 0  # before the room is expected: the receiver counts into it from then on
        super().expect(room, dst_pages)

    def start(self, room: int, peer: str, src_pages: Sequence[int], dst_pages: Sequence[int], metadata: bytes) -> None:
        runs = self._runs_to(peer, src_pages, dst_pages, metadata)
        ready = None
        if self._cuda:  # the caller's KV writes, queued on its stream, come before our copies
            ready = torch.cuda.Event()
            ready.record()
        with self._lock:
            self._out.state[room] = PENDING
            self._peer_of[room] = peer
        self._command(("start", _Out(room, peer, self._chunks(runs), bytes(metadata), ready)))

    def poll(self, room: int) -> TransferStatus:
        status = self._in.poll(room) or self._out.poll(room) or FAILED
        if status is PENDING and not self._thread.is_alive():
            return FAILED  # the I/O thread ended (closed, or broke): nothing will move any more
        return status  # dict reads only: never waits for a copy

    def abort(self, room: int) -> None:
        with self._lock:  # waits for at most the one chunk being read or written
            sending = self._peer_of.get(room) if self._out.state.get(room) is PENDING else None
            self._mark_aborted(room)
        if sending is not None:
            self._command(("abort", room, sending))

    # --- caller side helpers ----------------------------------------------------------------------------
    def _chunks(self, runs: list) -> list[list[tuple[int, int, int]]]:
        """Messages of at most `chunk_bytes`: a long run is cut, short runs share one message."""
        step = max(1, self.chunk_bytes // max(sum(r.page_bytes for r in self.regions), 1))
        pieces = [(s + i, d + i, min(step, n - i)) for s, d, n in runs for i in range(0, n, step)]
        chunks: list[list[tuple[int, int, int]]] = []
        for piece in pieces:
            if chunks and sum(n for _, _, n in chunks[-1]) + piece[2] <= step:
                chunks[-1].append(piece)
            else:
                chunks.append([piece])
        return chunks

    # --- the I/O thread ------------------------------------------------------------------------------------
    def _loop(self) -> None:
        self._peers: dict[str, _Peer] = {}
        self._sending: dict[int, _Out] = {}  # rooms with chunks left or an answer awaited
        self._stream = torch.cuda.Stream() if self._cuda else None
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._closing:
                busy = any(not o.finished_sending and not self._peers[o.peer].outbox for o in self._sending.values())
                for peer in self._peers.values():
                    poller.register(peer.sock, zmq.POLLIN | (zmq.POLLOUT if peer.outbox else 0))
                events = dict(poller.poll(0 if busy else int(self.heartbeat_s * 1000)))
                if self._wake_r in events:
                    os.read(self._wake_r, 4096)
                    self._drain_commands()
                while self._router.poll(0):
                    _guarded(self._on_receiver_message, self._router.recv_multipart(copy=False))
                for peer in self._peers.values():
                    while peer.sock.poll(0):
                        _guarded(self._on_sender_message, peer, peer.sock.recv_multipart())
                    self._flush(peer)
                self._send_chunks()
                self._check_liveness()
        finally:
            self._shutdown()

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = command[0]
            if kind == "connect":
                sock = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 4)  # a few chunks queued per peer; the rest wait as pages, not copies
                sock.setsockopt(zmq.ROUTING_ID, self.id.encode())
                sock.connect(command[2])
                self._peers[command[1]] = _Peer(sock)
            elif kind == "start":
                out: _Out = command[1]
                if self.faults.fail_next():
                    with self._lock:
                        self._out.fail(out.room, "injected failure")
                    self._post(self._peers[out.peer], [b"X", _room(out.room)])
                    continue
                self._sending[out.room] = out
                peer = self._peers[out.peer]
                if not any(o.peer == out.peer for o in self._sending.values() if o is not out):
                    peer.heard = time.monotonic()  # silence is counted from when we start waiting on it
            elif kind == "abort":  # the receiver hears of it, whatever this thread had already seen
                self._sending.pop(command[1], None)
                self._post(self._peers[command[2]], [b"X", _room(command[1])])

    def _send_chunks(self) -> None:
        for out in list(self._sending.values()):
            peer = self._peers[out.peer]
            if peer.outbox or out.finished_sending:
                continue
            if self._out.poll(out.room) is not PENDING:
                self._sending.pop(out.room)
                continue
            if out.next < len(out.chunks):
                message = self._read_chunk(out)
                if message is None:
                    continue
                out.next += 1
            else:
                message = [b"E", json.dumps({"room": out.room, "pages": out.pages}).encode(), out.metadata]
                out.finished_sending = True
            self._post(peer, message)

    def _read_chunk(self, out: _Out) -> list | None:
        pieces = out.chunks[out.next]
        with self._lock:
            if self._out.poll(out.room) is not PENDING:
                return None  # aborted: not one more byte is read
            if self._stream is None:
                frames = [torch.cat([page_slice(r, s, n) for s, _, n in pieces]).numpy() for r in self.regions]
            else:
                with torch.cuda.stream(self._stream):
                    if out.ready is not None:
                        self._stream.wait_event(out.ready)
                    total = sum(n for _, _, n in pieces)
                    staged = [torch.empty(r.page_bytes * total, dtype=torch.uint8, pin_memory=True) for r in self.regions]
                    for buf, r in zip(staged, self.regions):
                        at = 0
                        for s, _, n in pieces:
                            buf[at : at + n * r.page_bytes].copy_(page_slice(r, s, n), non_blocking=True)
                            at += n * r.page_bytes
                self._stream.synchronize()
                frames = [buf.numpy() for buf in staged]
        runs = [[d, n] for _, d, n in pieces]
        return [b"P", json.dumps({"room": out.room, "runs": runs}).encode(), *frames]

    def _post(self, peer: _Peer, message: list) -> None:
        peer.outbox.append(message)
        self._flush(peer)

    def _flush(self, peer: _Peer) -> None:
        while peer.outbox:
            try:
                peer.sock.send_multipart(peer.outbox[0], flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            peer.outbox.pop(0)

    def _on_sender_message(self, peer: _Peer, frames: list) -> None:
        peer.heard = time.monotonic()
        kind = frames[0]
        if kind == b"h":
            return
        room = int(frames[1])
        out = self._sending.pop(room, None)
        with self._lock:
            if kind == b"A" and self._out.poll(room) is PENDING and out is not None:
                self._out.state[room] = DONE
            elif kind == b"F":
                self._out.fail(room, frames[2].decode())

    def _on_receiver_message(self, frames: list) -> None:
        sender, kind = frames[0].bytes, frames[1].bytes
        self._heard_senders[sender] = time.monotonic()
        if kind == b"H":
            self._answer(sender, [b"h"])
            return
        if kind == b"X":
            with self._lock:
                if self._in.poll(int(frames[2].bytes)) is PENDING:
                    self._in.fail(int(frames[2].bytes), "the sender aborted")
            return
        header = json.loads(frames[2].bytes)
        room = header["room"]
        refusal = self._write_chunk(sender, room, header, frames[3:]) if kind == b"P" else self._finish(room, header, frames[3])
        if refusal == "done":
            self._answer(sender, [b"A", _room(room)])
        elif refusal:
            self._answer(sender, [b"F", _room(room), refusal.encode()])

    def _write_chunk(self, sender: bytes, room: int, header: dict, frames: list) -> str | None:
        runs = header["runs"]
        pages = {d + i for d, n in runs for i in range(n)}
        with self._lock:
            if self._in.poll(room) is not PENDING:
                return f"the receiver does not expect room {room}"
            if not pages <= self._expected[room] or len(frames) != len(self.regions):
                self._in.fail(room, "pages outside the room")
                return f"pages {sorted(pages - self._expected[room])} are not destination pages of room {room}"
            self._senders[room] = sender
            for frame, region in zip(frames, self.regions):
                data, at = torch.frombuffer(frame.buffer, dtype=torch.uint8), 0
                for dst, n in runs:
                    page_slice(region, dst, n).copy_(data[at : at + n * region.page_bytes])
                    at += n * region.page_bytes
            self._landed[room] += sum(n for _, n in runs)
        return None

    def _finish(self, room: int, header: dict, metadata) -> str:
        with self._lock:
            if self._in.poll(room) is not PENDING:
                return f"the receiver does not expect room {room}"
            if self._landed[room] != header["pages"]:
                self._in.fail(room, "pages missing")
                return f"room {room}: {self._landed[room]} of {header['pages']} pages landed"
            if self._cuda:
                torch.cuda.current_stream().synchronize()  # pageable host-to-device copies are in before DONE
            self._metadata[room] = metadata.bytes
            self._in.state[room] = DONE
        return "done"

    def _answer(self, sender: bytes, message: list) -> None:
        try:
            self._router.send_multipart([sender, *message], flags=zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError):
            pass  # the sender is gone or not reading: its own silence check ends its rooms

    def _check_liveness(self) -> None:
        now = time.monotonic()
        waiting = {out.peer for out in self._sending.values()}
        for peer_id, peer in self._peers.items():
            if peer_id not in waiting:
                continue
            if now - peer.heard > self.timeout_s:
                with self._lock:
                    for out in [o for o in self._sending.values() if o.peer == peer_id]:
                        self._out.fail(out.room, f"the receiver at {peer_id} did not answer for {self.timeout_s:.0f} s")
                        self._sending.pop(out.room)
            elif now - peer.pinged > self.heartbeat_s:
                peer.pinged = now
                self._post(peer, [b"H"])
        heard = self._heard_senders
        with self._lock:
            for room, sender in self._senders.items():
                if self._in.poll(room) is PENDING and now - heard.get(sender, now) > self.timeout_s:
                    self._in.fail(room, f"the sender was silent for {self.timeout_s:.0f} s")

    def _shutdown(self) -> None:
        with self._lock:
            for side in (self._in, self._out):
                for room, state in list(side.state.items()):
                    if state is PENDING:
                        side.fail(room, "closed")
        for peer in self._peers.values():
            peer.sock.close(linger=0)
        self._router.close(linger=0)
        self._ctx.term()


def _room(room: int) -> bytes:
    return str(room).encode()


def _guarded(handle, *args) -> None:
    """A malformed message (a stray client on the port) is dropped and logged; it never stops the I/O thread."""
    try:
        handle(*args)
    except Exception:
        logging.getLogger(__name__).exception("zmq kv_transfer: dropped a message it could not read")
