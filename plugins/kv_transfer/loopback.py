"""`loopback`: two (or more) pools in one process, for tests. Nothing leaves the process.

Endpoints name an entry in an in-process hub (one per process: the only way two instances that never
saw each other's objects can meet through endpoint bytes). A transfer is delivered by the sender's
worker thread after `delay_s`: under the hub's lock it copies every run of every region straight into
the receiver's tensors, stores the metadata row, marks the receiver's room DONE and then the sender's.

Injected faults, constructor arguments that may also be changed as attributes between transfers:
  delay_s    seconds between `start` and the delivery (the bytes land only then);
  fail_rate  probability that a started transfer fails: nothing lands, both sides see FAILED;
  drop_rate  probability that a started transfer is lost: nothing lands and both sides stay PENDING
             until someone aborts (what a silent peer looks like; the caller's deadline must end it);
  seed       for the fault draws.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
import uuid
import weakref
from typing import Sequence

import torch

from moeplex.interfaces import KVRegion, KVTransfer, KVTransferCaps, PluginError, TransferStatus

from .common import DONE, FAILED, PENDING, Faults, Layout, Rooms, check_pages, check_transfer, decode_endpoint, encode_endpoint, page_slice


class _Hub:
    """The process's loopback instances by endpoint id; its lock orders every delivery against every abort."""

    def __init__(self):
        self.lock = threading.Lock()
        self.instances: weakref.WeakValueDictionary[str, LoopbackTransfer] = weakref.WeakValueDictionary()


_HUB = _Hub()


class LoopbackTransfer(KVTransfer):
    caps = KVTransferCaps(devices=frozenset({"cpu", "cuda"}), cross_host=False, cross_process=False)

    def __init__(self, delay_s: float = 0.0, fail_rate: float = 0.0, drop_rate: float = 0.0, seed: int = 0):
        self.delay_s = delay_s
        self.faults = Faults(fail_rate, seed)
        self._drops = Faults(drop_rate, seed + 1)
        self.id = uuid.uuid4().hex
        self.regions: list[KVRegion] = []
        self.layout: Layout | None = None
        self._in, self._out = Rooms(), Rooms()
        self._expected: dict[int, frozenset[int]] = {}
        self._metadata: dict[int, bytes] = {}
        self._peers: dict[str, tuple[str, Layout]] = {}
        self._queue: list = []  # (due, seq, job)
        self._seq = itertools.count()
        self._wake = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="moeplex-kv-loopback", daemon=True)
        self._worker.start()

    @property
    def fail_rate(self) -> float:
        return self.faults.fail_rate

    @fail_rate.setter
    def fail_rate(self, value: float) -> None:
        self.faults.fail_rate = value

    @property
    def drop_rate(self) -> float:
        return self._drops.fail_rate

    @drop_rate.setter
    def drop_rate(self, value: float) -> None:
        self._drops.fail_rate = value

    # --- the contract ---------------------------------------------------------------------------------
    def register(self, regions: Sequence[KVRegion], metadata_bytes: int) -> None:
        self.layout = Layout.of(regions, metadata_bytes)
        self.regions = list(regions)
        _HUB.instances[self.id] = self

    def endpoint(self) -> bytes:
        return encode_endpoint("loopback", self._registered(), id=self.id)

    def connect(self, peer: bytes) -> str:
        data, layout = decode_endpoint(peer, "loopback")
        self._registered().check_peer(layout, "loopback")
        if data["id"] not in _HUB.instances:
            raise PluginError("loopback: the peer endpoint names no loopback instance in this process.")
        self._peers[data["id"]] = (data["id"], layout)
        return data["id"]

    def expect(self, room: int, dst_pages: Sequence[int]) -> None:
        check_pages(dst_pages, self._registered().num_pages, "destination")
        with _HUB.lock:
            self._in.state[room] = PENDING
            self._expected[room] = frozenset(dst_pages)

    def start(self, room: int, peer: str, src_pages: Sequence[int], dst_pages: Sequence[int], metadata: bytes) -> None:
        if peer not in self._peers:
            raise PluginError(f"loopback: peer '{peer}' is not connected; call connect with its endpoint first.")
        runs = check_transfer(self._registered(), self._peers[peer][1], src_pages, dst_pages, metadata)
        with _HUB.lock:
            self._out.state[room] = PENDING
        with self._wake:
            heapq.heappush(self._queue, (time.monotonic() + self.delay_s, next(self._seq), (room, peer, runs, bytes(metadata))))
            self._wake.notify()

    def poll(self, room: int) -> TransferStatus:
        with _HUB.lock:
            return self._in.poll(room) or self._out.poll(room) or FAILED

    def metadata(self, room: int) -> bytes:
        if self.poll(room) is not DONE or room not in self._metadata:
            raise KeyError(f"room {room} has not received its metadata row")
        return self._metadata[room]

    def abort(self, room: int) -> None:
        with _HUB.lock:  # a delivery in progress finishes first; none starts for this room after
            for side in (self._in, self._out):
                if room in side.state:
                    side.state[room] = FAILED
                    side.reason.setdefault(room, "aborted")
            self._expected.pop(room, None)

    def reason(self, room: int) -> str:
        return self._in.reason.get(room) or self._out.reason.get(room) or ""

    def release(self, room: int) -> None:
        with _HUB.lock:
            self._in.forget(room)
            self._out.forget(room)
            self._expected.pop(room, None)
            self._metadata.pop(room, None)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._worker.join(timeout=5)
        _HUB.instances.pop(self.id, None)

    # --- delivery ---------------------------------------------------------------------------------------
    def _registered(self) -> Layout:
        if self.layout is None:
            raise RuntimeError("loopback: register the KV regions first")
        return self.layout

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._closed and (not self._queue or self._queue[0][0] > time.monotonic()):
                    self._wake.wait(None if not self._queue else self._queue[0][0] - time.monotonic())
                if self._closed:
                    return
                _, _, job = heapq.heappop(self._queue)
            self._deliver(*job)

    def _deliver(self, room: int, peer: str, runs: list, metadata: bytes) -> None:
        if self._drops.fail_next():
            return  # lost: both sides stay PENDING until aborted
        failed = self.faults.fail_next()
        with _HUB.lock:
            if self._out.state.get(room) is not PENDING:
                return  # aborted before delivery: nothing moves
            receiver = _HUB.instances.get(peer)
            if receiver is None:
                self._out.fail(room, "the receiver closed")
                return
            if failed:
                self._out.fail(room, "injected failure")
                receiver._in.fail(room, "injected failure") if room in receiver._in.state else None
                return
            expected = receiver._expected.get(room)
            wanted = {d + i for _, d, n in runs for i in range(n)}
            if receiver._in.state.get(room) is not PENDING or expected is None or not wanted <= expected:
                self._out.fail(room, "the receiver does not expect this room on these pages")
                return
            for src_start, dst_start, count in runs:
                for mine, theirs in zip(self.regions, receiver.regions):
                    page_slice(theirs, dst_start, count).copy_(page_slice(mine, src_start, count))
            if any(r.tensor.is_cuda for r in receiver.regions):
                torch.cuda.current_stream().synchronize()
            receiver._metadata[room] = metadata
            receiver._in.state[room] = DONE
            self._out.state[room] = DONE
