"""`nixl`: KV pages through NVIDIA NIXL (UCX underneath: RDMA, NVLink, shared memory or TCP, CPU or GPU memory).

The receiver pulls, as vLLM's NIXL connector does: a one-sided WRITE from the sender could land in pages
the receiver has already freed after an abort, and nothing on the receiver could stop it. So:

  sender   connect(D):  add D's agent; notify D [H, its agent metadata, its region addresses]
  sender   start:       notify D [S, room, runs, metadata row]
  receiver on S:        room expected and the pages its own -> one NIXL READ of every run of every region
                        (else notify [F, room, reason])
  receiver read DONE:   notify the sender [R, room] and wait
  sender   on R:        room still live -> DONE (its pages were held for the whole read), notify [C, room];
                        aborted meanwhile -> notify [N, room] (the read may have seen reused pages)
  receiver on C:        DONE, with the metadata row; on N: FAILED

So DONE on either side means the bytes are in the receiver's pool and were read from pages the sender
still owned. `abort` on the receiver cancels its read, or waits for it to end, before it returns (no
byte lands after); on the sender it notifies [X, room] and the receiver fails the room once its read ended.
A room waiting longer than `timeout_s` for the other side fails. NIXL calls come from the caller's thread
and one progress thread, so the agent runs in NIXL's strict thread-safe mode.

Install: `pip install --no-deps nixl-cu12` (the extra `moeplex[nixl]`; the `nixl` meta-package would pull a CUDA torch).
"""

from __future__ import annotations

import base64
import importlib
import json
import logging
import threading
import time
import uuid
from typing import Sequence

from moeplex.interfaces import KVRegion, KVTransferCaps, PluginError, TransferStatus

from .common import DONE, FAILED, PENDING, Layout, RoomBackend, Rooms, decode_endpoint, encode_endpoint

NIXL_MODULES = ("nixl", "nixl_cu12", "nixl_cu13")  # the meta-package's name, then the CUDA-specific wheels


def load_nixl():
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise PluginError(
        "kv_transfer 'nixl' needs NVIDIA NIXL, which is not installed: install moeplex[nixl] "
        "(pip install --no-deps nixl-cu12)."
    )


class _Read:
    def __init__(self, handle, peer: str, metadata: bytes):
        self.handle, self.peer, self.metadata = handle, peer, metadata
        self.since = time.monotonic()
        self.sender_aborted = False


class NixlTransfer(RoomBackend):
    label = "nixl"
    room_books = ("_expected", "_metadata", "_sent")  # per-room dicts that release() clears
    caps = KVTransferCaps(devices=frozenset({"cpu", "cuda"}), cross_host=True, needs_extra="nixl")

    def __init__(self, timeout_s: float = 30.0, backends: Sequence[str] = ("UCX",)):
        self._nixl = load_nixl()
        self.timeout_s = timeout_s
        self.name = uuid.uuid4().hex
        config = self._nixl.nixl_agent_config(
            backends=list(backends), sync_mode=self._nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        )
        self.agent = self._nixl.nixl_agent(self.name, config)
        self.layout: Layout | None = None
        self.regions: list[KVRegion] = []
        self._lock = threading.RLock()
        self._in, self._out = Rooms(), Rooms()
        self._expected: dict[int, frozenset[int]] = {}
        self._metadata: dict[int, bytes] = {}
        self._reads: dict[int, _Read] = {}  # receiver: reads in flight
        self._confirming: dict[int, _Read] = {}  # receiver: read done, waiting for the sender's C or N
        self._sent: dict[int, tuple[str, float]] = {}  # sender: room -> (peer, when started)
        self._layouts: dict[str, Layout] = {}  # sender: receivers connected
        self._senders: dict[str, tuple[list[int], int]] = {}  # receiver: sender agent -> (region addresses, device)
        self._early: list[tuple[str, bytes]] = []  # receiver: S messages from a sender whose H has not come
        self._closing = False
        self._thread: threading.Thread | None = None

    # --- the contract ---------------------------------------------------------------------------------
    def register(self, regions: Sequence[KVRegion], metadata_bytes: int) -> None:
        self.layout = Layout.of(regions, metadata_bytes)
        self.regions = list(regions)
        self._mem = "VRAM" if regions and regions[0].tensor.is_cuda else "DRAM"
        self._dev = max(regions[0].tensor.get_device(), 0) if regions else 0
        self._registered_descs = self.agent.register_memory([r.tensor for r in regions])
        self._thread = threading.Thread(target=self._loop, name="moeplex-kv-nixl", daemon=True)
        self._thread.start()

    def endpoint(self) -> bytes:
        return encode_endpoint("nixl", self._registered(), agent=self.name, **self._identity())

    def connect(self, peer: bytes) -> str:
        data, layout = decode_endpoint(peer, "nixl")
        self._registered().check_peer(layout, "nixl")
        name = data["agent"]
        if name not in self._layouts:
            self.agent.add_remote_agent(base64.b64decode(data["metadata"]))
            self._layouts[name] = layout
            self.agent.send_notif(name, b"H" + json.dumps(self._identity()).encode())
        return name

    def start(self, room: int, peer: str, src_pages: Sequence[int], dst_pages: Sequence[int], metadata: bytes) -> None:
        runs = self._runs_to(peer, src_pages, dst_pages, metadata)
        with self._lock:
            self._out.state[room] = PENDING
            self._sent[room] = (peer, time.monotonic())
        message = {"room": room, "runs": runs, "metadata": base64.b64encode(metadata).decode()}
        try:
            self.agent.send_notif(peer, b"S" + json.dumps(message).encode())
        except Exception as exc:  # NIXL raises nixlRemoteDisconnectError for a receiver that died: start never raises
            with self._lock:
                self._sent.pop(room, None)
                self._out.fail(room, f"the receiver is gone ({type(exc).__name__})")

    def poll(self, room: int) -> TransferStatus:
        return self._in.poll(room) or self._out.poll(room) or FAILED

    def abort(self, room: int) -> None:
        with self._lock:
            read = self._reads.pop(room, None) or self._confirming.pop(room, None)
            if read is not None:
                self._end_read(read)  # cancelled, or waited for: no byte lands after this returns
                self._notify(read.peer, b"F", room, "the receiver aborted")
            sent = self._sent.pop(room, None)
            self._mark_aborted(room)
        if sent is not None:
            self._notify(sent[0], b"X", room)

    def close(self) -> None:
        if self._thread is None or self._closing:
            return
        self._closing = True
        self._thread.join(timeout=10)
        with self._lock:
            for room in list(self._reads):
                self.abort(room)
            for side in (self._in, self._out):
                for room, state in list(side.state.items()):
                    if state is PENDING:
                        side.fail(room, "closed")
        for name in list(self._layouts) + list(self._senders):
            try:
                self.agent.remove_remote_agent(name)
            except Exception:
                pass  # already gone
        self.agent.deregister_memory(self._registered_descs)

    # --- helpers ------------------------------------------------------------------------------------------
    def _identity(self) -> dict:
        metadata = base64.b64encode(self.agent.get_agent_metadata()).decode()
        return {"metadata": metadata, "addrs": [r.tensor.data_ptr() for r in self.regions], "mem": self._mem,
                "dev": self._dev}

    def _notify(self, peer: str, kind: bytes, room: int, reason: str = "") -> None:
        try:
            self.agent.send_notif(peer, kind + json.dumps({"room": room, "reason": reason}).encode())
        except Exception:
            pass  # the peer is gone: its own timeout ends its side

    def _end_read(self, read: _Read) -> None:
        """Cancel a read, or wait (up to timeout_s) for it to end, and free its handle (once)."""
        if read.handle is None:
            return
        handle, read.handle = read.handle, None
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                handle.release()
                return
            except Exception:
                if self.agent.check_xfer_state(handle) != "PROC" or time.monotonic() > deadline:
                    try:
                        handle.release()
                    except Exception:
                        pass
                    return
                time.sleep(0.0005)

    # --- the progress thread ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._closing:
            busy = False
            for peer, messages in self.agent.get_new_notifs().items():
                for message in messages:
                    try:
                        self._on_message(peer.decode() if isinstance(peer, bytes) else peer, message)
                    except Exception:  # a malformed notification never stops the progress thread
                        logging.getLogger(__name__).exception("nixl kv_transfer: dropped a notification it could not read")
                    busy = True
            busy |= self._progress_reads()
            self._check_deadlines()
            time.sleep(0.0002 if busy or self._reads else 0.002)

    def _on_message(self, peer: str, message: bytes) -> None:
        kind, body = message[:1], json.loads(message[1:])
        if kind == b"H":
            self.agent.add_remote_agent(base64.b64decode(body["metadata"]))
            self._senders[peer] = (body["addrs"], body["dev"])
            early, self._early = self._early, []
            for who, msg in early:
                self._on_message(who, msg)
        elif kind == b"S":
            if peer not in self._senders:
                self._early.append((peer, message))
            else:
                self._start_read(peer, body)
        else:
            self._on_answer(peer, kind, body["room"])

    def _start_read(self, peer: str, body: dict) -> None:
        room, runs = body["room"], body["runs"]
        pages = {d + i for _, d, n in runs for i in range(n)}
        with self._lock:
            if self._in.poll(room) is not PENDING or room in self._reads or room in self._confirming:
                return self._notify(peer, b"F", room, f"the receiver does not expect room {room}")
            if not pages <= self._expected[room]:
                self._in.fail(room, "pages outside the room")
                return self._notify(peer, b"F", room, f"pages {sorted(pages - self._expected[room])} are not the room's")
            local, remote = [], []
            bases, device = self._senders[peer]
            for src, dst, n in runs:
                for region, base in zip(self.regions, bases):
                    size = region.page_bytes
                    local.append((region.tensor.data_ptr() + dst * size, n * size, self._dev))
                    remote.append((base + src * size, n * size, device))
            read = _Read(None, peer, base64.b64decode(body["metadata"]))
            try:
                read.handle = self.agent.initialize_xfer(
                    "READ", self.agent.get_xfer_descs(local, self._mem), self.agent.get_xfer_descs(remote, self._mem), peer
                )
                state = self.agent.transfer(read.handle)
            except Exception as exc:  # NIXL refused the descriptors or the peer
                self._in.fail(room, f"nixl refused the read: {exc}")
                return self._notify(peer, b"F", room, f"nixl refused the read: {exc}")
            self._reads[room] = read
            if state == "ERR":
                self._reads.pop(room)
                self._end_read(read)
                self._in.fail(room, "the read failed")
                self._notify(peer, b"F", room, "the read failed")

    def _progress_reads(self) -> bool:
        moved = False
        with self._lock:
            for room, read in list(self._reads.items()):
                state = self.agent.check_xfer_state(read.handle)
                if state == "PROC":
                    continue
                moved = True
                del self._reads[room]
                self._end_read(read)
                if state == "DONE" and not read.sender_aborted and self._in.poll(room) is PENDING:
                    read.since = time.monotonic()
                    self._confirming[room] = read
                    self._notify(read.peer, b"R", room)
                else:
                    self._in.fail(room, "the read failed" if state != "DONE" else "the sender aborted")
                    self._notify(read.peer, b"F", room, "the read failed")
        return moved

    def _on_answer(self, peer: str, kind: bytes, room: int) -> None:
        with self._lock:
            if kind == b"R":  # sender: the receiver's read of our pages ended
                live = self._out.poll(room) is PENDING
                if live:
                    self._out.state[room] = DONE
                    self._sent.pop(room, None)
                self._notify(peer, b"C" if live else b"N", room)
            elif kind == b"C" and room in self._confirming:
                read = self._confirming.pop(room)
                if self._in.poll(room) is PENDING:
                    self._metadata[room] = read.metadata
                    self._in.state[room] = DONE
            elif kind == b"N" and room in self._confirming:
                self._confirming.pop(room)
                self._in.fail(room, "the sender released its pages before the read was confirmed")
            elif kind == b"F":
                self._out.fail(room, "refused by the receiver")
                self._sent.pop(room, None)
            elif kind == b"X":
                if room in self._reads:
                    self._reads[room].sender_aborted = True
                else:
                    self._confirming.pop(room, None)
                    if self._in.poll(room) is PENDING:
                        self._in.fail(room, "the sender aborted")

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        with self._lock:
            for room, (peer, since) in list(self._sent.items()):
                if now - since > self.timeout_s and self._out.poll(room) is PENDING:
                    self._out.fail(room, f"the receiver did not finish within {self.timeout_s:.0f} s")
                    self._sent.pop(room)
                    self._notify(peer, b"X", room)
            for room, read in list(self._confirming.items()):
                if now - read.since > self.timeout_s:
                    self._confirming.pop(room)
                    self._in.fail(room, "the sender did not confirm the read")
            for room, read in list(self._reads.items()):
                if now - read.since > self.timeout_s:
                    self._reads.pop(room)
                    self._end_read(read)
                    self._in.fail(room, "the read did not finish in time")
