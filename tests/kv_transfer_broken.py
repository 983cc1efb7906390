"""KV transfer backends with the bugs the conformance suite exists to catch, registered (with cuda-ipc's CPU
twin, tests/kv_transfer_cpu_pull.py) through a test-only dist-info."""

from __future__ import annotations

import threading

import torch

from moeplex.interfaces import KVTransferCaps, TransferStatus
from moeplex.plugins.kv_transfer.common import page_slice
from moeplex.plugins.kv_transfer.loopback import _HUB, LoopbackTransfer
from moeplex.plugins.kv_transfer.zmq import ZmqTransfer

CPU_ONLY = KVTransferCaps(devices=frozenset({"cpu"}), cross_host=False, cross_process=False)


def copy_runs(sender, receiver, runs) -> None:
    for src, dst, count in runs:
        for mine, theirs in zip(sender.regions, receiver.regions):
            page_slice(theirs, dst, count).copy_(page_slice(mine, src, count))


class AcksBeforeBytes(LoopbackTransfer):
    """Broken: reports DONE on both sides as soon as a transfer is delivered and copies the pages a moment later.

    Everything else is right: the bytes do land, the metadata row is exact, unexpected rooms fail.
    """

    caps = CPU_ONLY
    late_s = 0.05  # how long after DONE the pages are copied

    def _deliver(self, room, peer, runs, metadata):
        receiver = _HUB.instances.get(peer)
        if receiver is None or receiver._in.state.get(room) is not TransferStatus.PENDING:
            return super()._deliver(room, peer, runs, metadata)
        with _HUB.lock:
            receiver._metadata[room] = metadata
            receiver._in.state[room] = self._out.state[room] = TransferStatus.DONE
        threading.Timer(self.late_s, copy_runs, args=(self, receiver, runs)).start()


class DoneBeforeItsCopies(ZmqTransfer):
    """Broken: the receiver counts a chunk as landed when it arrives and copies the room's chunks into the pool
    20 ms after it said DONE (as non_blocking copies nobody waits for would land), so its DONE, and the
    sender's after it, always come before the bytes. A look from another process, a message or two later, on a
    loaded machine may find them there."""

    late_s = 0.02

    def _write_chunk(self, sender, room, header, frames):
        with self._lock:
            if self._in.poll(room) is not TransferStatus.PENDING:
                return f"the receiver does not expect room {room}"
            self._senders[room] = sender
            self._landed[room] += sum(n for _, n in header["runs"])
            self.__dict__.setdefault("later", {}).setdefault(room, []).append((header["runs"], frames))
        return None

    def _finish(self, room, header, metadata):
        answer = super()._finish(room, header, metadata)
        threading.Timer(self.late_s, self._copy, args=(self.__dict__.get("later", {}).pop(room, []),)).start()
        return answer

    def _copy(self, chunks):
        for runs, frames in chunks:
            for frame, region in zip(frames, self.regions):
                data, at = torch.frombuffer(frame.buffer, dtype=torch.uint8), 0
                for dst, n in runs:
                    page_slice(region, dst, n).copy_(data[at : at + n * region.page_bytes])
                    at += n * region.page_bytes


class IgnoresADeadPeer(ZmqTransfer):
    """Broken: zmq without its liveness check (takes `timeout_s` and never acts on it): a room whose receiver
    died stays PENDING for ever."""

    def __init__(self, timeout_s: float = 30.0, **options):
        super().__init__(timeout_s=float("inf"), **options)


class WritesAfterAbort(LoopbackTransfer):
    """Broken: delivers on its own schedule (10 ms after start) and writes a room the receiver aborted meanwhile."""

    caps = CPU_ONLY

    def __init__(self):
        super().__init__(delay_s=0.01)

    def _deliver(self, room, peer, runs, metadata):
        receiver = _HUB.instances.get(peer)
        super()._deliver(room, peer, runs, metadata)
        if receiver is not None and receiver._in.state.get(room) is TransferStatus.FAILED:
            copy_runs(self, receiver, runs)  # the late write into pages that may belong to another request now


ENTRY_POINTS = {
    "acks-before-bytes": "kv_transfer_broken:AcksBeforeBytes",
    "writes-after-abort": "kv_transfer_broken:WritesAfterAbort",
    "done-before-its-copies": "kv_transfer_broken:DoneBeforeItsCopies",
    "ignores-a-dead-peer": "kv_transfer_broken:IgnoresADeadPeer",
    "cpu-pull": "kv_transfer_cpu_pull:SharedFilePull",  # not broken: cuda-ipc's protocol on CPU memory
}


def write_distribution(folder) -> None:
    info = folder / "test_kv_transfer_backends-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: test-kv-transfer-backends\nVersion: 0.1\n")
    lines = ["[moeplex.kv_transfer]"] + [f"{name} = {target}" for name, target in ENTRY_POINTS.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
