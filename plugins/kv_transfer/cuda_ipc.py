"""`cuda-ipc`: prefill and decode as processes on one GPU host; decode maps prefill's KV buffers and copies on the GPU.

Who does what (the calls are the contract's; the receiver D pulls):

  D  register:  listens on a zmq control socket (127.0.0.1); its endpoint gives that address and its host
  P  connect:   same host or PluginError; sends D [H, the CUDA IPC handles of its regions] (torch's
                reduce_tensor); D maps them once (rebuild_cuda_tensor)
  P  start:     records an interprocess CUDA event on its stream (its KV writes come first) and sends
                [S, room, runs, metadata row, that event's handle]
  D  on S:      room expected and the pages its own -> on a side stream, waits for P's event, then copies
                each run of each region device to device from P's mapped buffers into its own; else [F]
  D  copy done: (its event has completed) sends P [R, room] and waits
  P  on R:      room still live -> DONE (the pages were held for the whole copy) and [C]; aborted -> [N]
  D  on C:      DONE with the metadata row; on N: FAILED

So P's pages stay owned by the transfer until P's poll turns DONE or FAILED (or P aborts), D's until its
poll does: DONE on either side means the bytes are in D's pool, read from pages P still held. D's `abort`
waits for its in-flight copy to finish on the GPU (microseconds to milliseconds) before it returns;
P's `abort` sends [X] and D fails the room once its copy is over. A room waiting more than `timeout_s`
for the other side fails. caps: CUDA memory only, one host.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import queue
import socket
import threading
import time
import uuid
from typing import Sequence

import torch
import zmq
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from moeplex.interfaces import KVRegion, KVTransferCaps, PluginError, TransferStatus

from .common import (
    DONE, FAILED, PENDING, Layout, PipedBackend, Rooms, decode_endpoint, encode_endpoint, page_rows, page_slice,
)


log = logging.getLogger(__name__)


def _guarded(handle, *args) -> None:
    """A malformed control message is dropped (and logged); it never stops the control thread."""
    try:
        handle(*args)
    except Exception:
        log.exception("cuda-ipc: dropped a control message it could not read")


def host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{socket.gethostname()}/{f.read().strip()}"
    except OSError:
        return socket.gethostname()


class _Copy:
    def __init__(self, sender: bytes, metadata: bytes, done):
        self.sender, self.metadata, self.done = sender, metadata, done
        self.since = time.monotonic()
        self.sender_aborted = False


class CudaIpcTransfer(PipedBackend):
    label = "cuda-ipc"
    room_books = ("_expected", "_metadata", "_sent")  # per-room dicts that release() clears
    caps = KVTransferCaps(devices=frozenset({"cuda"}), cross_host=False)
    name = "cuda-ipc"

    def __init__(self, timeout_s: float = 30.0):
        self.timeout_s = timeout_s
        self.id = uuid.uuid4().hex
        self.layout: Layout | None = None
        self.regions: list[KVRegion] = []
        self._lock = threading.RLock()
        self._in, self._out = Rooms(), Rooms()
        self._expected: dict[int, frozenset[int]] = {}
        self._metadata: dict[int, bytes] = {}
        self._copies: dict[int, _Copy] = {}  # D: copies on the GPU
        self._confirming: dict[int, _Copy] = {}  # D: copied, waiting for P's C or N
        self._sent: dict[int, tuple[str, float]] = {}  # P: room -> (peer, when)
        self._layouts: dict[str, Layout] = {}  # P: peers connected
        self._mapped: dict[bytes, list[KVRegion]] = {}  # D: sender -> its regions, mapped here
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closing = False

    # --- the contract ---------------------------------------------------------------------------------
    def register(self, regions: Sequence[KVRegion], metadata_bytes: int) -> None:
        if not regions or not all(r.tensor.device.type in self.caps.devices for r in regions):
            raise ValueError(f"{self.name} registers {sorted(self.caps.devices)} tensors only")
        self.layout = Layout.of(regions, metadata_bytes)
        self.regions = list(regions)
        self.device = regions[0].tensor.device
        self._handles = self._export()
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self._router.bind_to_random_port('tcp://127.0.0.1')}"
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._loop, name="moeplex-kv-cuda-ipc", daemon=True)
        self._thread.start()

    def endpoint(self) -> bytes:
        return encode_endpoint(self.name, self._registered(), id=self.id, address=self.address, host=host_id())

    def connect(self, peer: bytes) -> str:
        data, layout = decode_endpoint(peer, self.name)
        self._registered().check_peer(layout, self.name)
        if data["host"] != host_id():
            raise PluginError(
                f"cuda-ipc: the peer runs on host {data['host'].split('/')[0]}, this rank on "
                f"{host_id().split('/')[0]}; CUDA IPC joins processes of one host only (use zmq or nixl across hosts)."
            )
        peer_id = f"{data['id']}@{data['address']}"
        if peer_id not in self._layouts:
            self._layouts[peer_id] = layout
            self._command(("connect", peer_id, data["address"]))
        return peer_id

    def start(self, room: int, peer: str, src_pages: Sequence[int], dst_pages: Sequence[int], metadata: bytes) -> None:
        runs = self._runs_to(peer, src_pages, dst_pages, metadata)
        written = self._mark_written()
        with self._lock:
            self._out.state[room] = PENDING
            self._sent[room] = (peer, time.monotonic())
        header = json.dumps({"room": room, "runs": runs}).encode()
        self._command(("send", peer, [b"S", header, bytes(metadata), written]))

    def poll(self, room: int) -> TransferStatus:
        status = self._in.poll(room) or self._out.poll(room) or FAILED
        if status is PENDING and not self._thread.is_alive():
            return FAILED  # the I/O thread ended (closed, or broke): nothing will move any more
        return status

    def abort(self, room: int) -> None:
        with self._lock:
            copy = self._copies.pop(room, None) or self._confirming.pop(room, None)
            if copy is not None:
                copy.done.synchronize()  # the copy into our pages has ended before abort returns
                self._command(("answer", copy.sender, [b"F", _room(room)]))
            sent = self._sent.pop(room, None)
            self._mark_aborted(room)
        if sent is not None:
            self._command(("send", sent[0], [b"X", _room(room)]))

    # --- helpers ------------------------------------------------------------------------------------------
    # --- the control thread ------------------------------------------------------------------------------
    def _loop(self) -> None:
        self._start_thread()
        self._dealers: dict[str, zmq.Socket] = {}
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._closing:
                for sock in self._dealers.values():
                    poller.register(sock, zmq.POLLIN)
                events = dict(poller.poll(1 if self._copies else 50))
                if self._wake_r in events:
                    os.read(self._wake_r, 4096)
                    self._drain_commands()
                while self._router.poll(0):
                    _guarded(self._on_receiver_message, self._router.recv_multipart())
                for peer_id, sock in self._dealers.items():
                    while sock.poll(0):
                        _guarded(self._on_sender_message, peer_id, sock, sock.recv_multipart())
                self._progress_copies()
                self._check_deadlines()
        finally:
            with self._lock:
                for copy in list(self._copies.values()) + list(self._confirming.values()):
                    copy.done.synchronize()
                for side in (self._in, self._out):
                    for room, state in list(side.state.items()):
                        if state is PENDING:
                            side.fail(room, "closed")
            for sock in [self._router, *self._dealers.values()]:
                sock.close(linger=0)
            self._ctx.term()

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, target, message = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "connect":
                sock = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(message)
                sock.send_multipart([b"H", self._handles])
                self._dealers[target] = sock
            elif kind == "send":
                self._dealers[target].send_multipart(message)
            else:  # answer a sender through the router
                self._answer(target, message)

    def _answer(self, sender: bytes, message: list) -> None:
        try:
            self._router.send_multipart([sender, *message], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the sender is gone: its own deadline ends its room

    def _on_receiver_message(self, frames: list) -> None:
        sender, kind = frames[0], frames[1]
        if kind == b"H":
            tensors = self._map(frames[2])
            self._mapped[sender] = [KVRegion(t, r.page_bytes) for t, r in zip(tensors, self.regions)]
            return
        if kind == b"X":
            room = int(frames[2])
            with self._lock:
                if room in self._copies:
                    self._copies[room].sender_aborted = True
                elif self._confirming.pop(room, None) is not None or self._in.poll(room) is PENDING:
                    self._in.fail(room, "the sender aborted")
            return
        if kind in (b"C", b"N"):
            return self._on_confirmation(int(frames[2]), kind == b"C")
        header = json.loads(frames[2])
        room, runs = header["room"], header["runs"]
        pages = {d + i for _, d, n in runs for i in range(n)}
        with self._lock:
            if self._in.poll(room) is not PENDING or room in self._copies or room in self._confirming:
                return self._answer(sender, [b"F", _room(room)])
            if not pages <= self._expected[room] or sender not in self._mapped:
                self._in.fail(room, "pages outside the room")
                return self._answer(sender, [b"F", _room(room)])
            source = self._mapped[sender]
            self._copies[room] = _Copy(sender, bytes(frames[3]), self._copy_after(frames[4], source, runs))

    # --- what is CUDA about it (a subclass for other memory replaces these five) ---------------------------
    def _export(self) -> bytes:
        """The regions as CUDA IPC handles (torch's own reduction, as torch.multiprocessing sends tensors),
        written as JSON: the control socket never unpickles what it receives."""
        return json.dumps([_ipc_fields(reduce_tensor(r.tensor)[1]) for r in self.regions]).encode()

    def _map(self, handles: bytes) -> list[torch.Tensor]:
        with torch.cuda.device(self.device):
            return [rebuild_cuda_tensor(*_ipc_args(fields)) for fields in json.loads(handles)]

    def _mark_written(self) -> bytes:
        """An interprocess event after the KV writes the caller's stream has queued so far."""
        written = torch.cuda.Event(interprocess=True)
        written.record(torch.cuda.current_stream(self.device))
        return bytes(written.ipc_handle())

    def _start_thread(self) -> None:
        torch.cuda.set_device(self.device)
        self._stream = torch.cuda.Stream(self.device)

    def _copy_after(self, written: bytes, source: list[KVRegion], runs: list):
        """Launch the copy on the side stream once the sender's event passed; returns an event to query."""
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(torch.cuda.Event.from_ipc_handle(self.device, written))
            self._copy(source, runs)
            done = torch.cuda.Event()
            done.record(self._stream)
        return done

    def _copy(self, source: list[KVRegion], runs: list) -> None:
        """Every run of every region, on the current (side) stream: one copy per run when runs are few,
        else one gather and one scatter per region (scattered pages would cost a kernel per page and layer)."""
        if len(runs) <= 4:
            for src, dst, n in runs:
                for theirs, mine in zip(source, self.regions):
                    page_slice(mine, dst, n).copy_(page_slice(theirs, src, n), non_blocking=True)
            return
        src_pages = torch.tensor([s + i for s, _, n in runs for i in range(n)], device=self.device)
        dst_pages = torch.tensor([d + i for _, d, n in runs for i in range(n)], device=self.device)
        for theirs, mine in zip(source, self.regions):
            page_rows(mine).index_copy_(0, dst_pages, page_rows(theirs).index_select(0, src_pages))

    def _progress_copies(self) -> None:
        with self._lock:
            for room, copy in list(self._copies.items()):
                if not copy.done.query():
                    continue
                del self._copies[room]
                if copy.sender_aborted or self._in.poll(room) is not PENDING:
                    self._in.fail(room, "the sender aborted")
                    self._answer(copy.sender, [b"F", _room(room)])
                else:
                    copy.since = time.monotonic()
                    self._confirming[room] = copy
                    self._answer(copy.sender, [b"R", _room(room)])

    def _on_confirmation(self, room: int, confirmed: bool) -> None:
        with self._lock:
            copy = self._confirming.pop(room, None)
            if copy is None or self._in.poll(room) is not PENDING:
                return
            if confirmed:
                self._metadata[room] = copy.metadata
                self._in.state[room] = DONE
            else:
                self._in.fail(room, "the sender released its pages before the copy was confirmed")

    def _on_sender_message(self, peer_id: str, sock: zmq.Socket, frames: list) -> None:
        kind, room = frames[0], int(frames[1])
        with self._lock:
            if kind == b"R":
                live = self._out.poll(room) is PENDING
                if live:
                    self._out.state[room] = DONE
                    self._sent.pop(room, None)
                sock.send_multipart([b"C" if live else b"N", _room(room)])
            elif kind == b"F":
                self._out.fail(room, "refused by the receiver")
                self._sent.pop(room, None)

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        with self._lock:
            for room, (peer, since) in list(self._sent.items()):
                if now - since > self.timeout_s and self._out.poll(room) is PENDING:
                    self._out.fail(room, f"the receiver did not finish within {self.timeout_s:.0f} s")
                    self._sent.pop(room)
                    self._dealers[peer].send_multipart([b"X", _room(room)])
            for room, copy in list(self._confirming.items()):
                if now - copy.since > self.timeout_s:
                    self._confirming.pop(room)
                    self._in.fail(room, "the sender did not confirm the copy")


def _room(room: int) -> bytes:
    return str(room).encode()


def _ipc_fields(args: tuple) -> dict:
    """reduce_tensor's arguments for rebuild_cuda_tensor, as JSON-able fields (bytes in base64)."""
    (_, size, stride, offset, _, dtype, device, handle, size_bytes, offset_bytes, _, ref_handle, ref_offset,
     event, event_sync) = args
    b64 = lambda b: None if b is None else base64.b64encode(bytes(b)).decode()  # noqa: E731
    return {"size": list(size), "stride": list(stride), "offset": offset, "dtype": str(dtype).removeprefix("torch."),
            "device": device, "handle": b64(handle), "size_bytes": size_bytes, "offset_bytes": offset_bytes,
            "ref_handle": b64(ref_handle), "ref_offset": ref_offset, "event": b64(event), "event_sync": event_sync}


def _ipc_args(f: dict) -> tuple:
    raw = lambda s: None if s is None else base64.b64decode(s)  # noqa: E731
    return (torch.Tensor, torch.Size(f["size"]), tuple(f["stride"]), f["offset"], torch.storage.TypedStorage,
            getattr(torch, f["dtype"]), f["device"], raw(f["handle"]), f["size_bytes"], f["offset_bytes"], False,
            raw(f["ref_handle"]), f["ref_offset"], raw(f["event"]), f["event_sync"])
