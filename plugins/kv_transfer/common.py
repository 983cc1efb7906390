"""What every built-in KV transfer backend shares: the layout in an endpoint, page checks, room states, fault injection."""

from __future__ import annotations

import json
import os
import random
import threading
from typing import ClassVar, Sequence

import attrs
import torch

from moeplex.interfaces import KVRegion, KVTransfer, PluginError, TransferStatus, page_runs

PENDING, DONE, FAILED = TransferStatus.PENDING, TransferStatus.DONE, TransferStatus.FAILED


@attrs.frozen
class Layout:
    """The shape of one rank's registration: (page_bytes, pages) per region, and the metadata row's size."""

    regions: tuple[tuple[int, int], ...]
    metadata_bytes: int

    @classmethod
    def of(cls, regions: Sequence[KVRegion], metadata_bytes: int) -> "Layout":
        shapes = []
        for i, region in enumerate(regions):
            nbytes = region.tensor.numel() * region.tensor.element_size()
            if not region.tensor.is_contiguous() or region.page_bytes <= 0 or nbytes % region.page_bytes:
                raise ValueError(f"region {i} is not a contiguous whole number of {region.page_bytes}-byte pages")
            shapes.append((region.page_bytes, nbytes // region.page_bytes))
        return cls(tuple(shapes), metadata_bytes)

    @property
    def num_pages(self) -> int:
        return min((pages for _, pages in self.regions), default=0)

    def to_json(self) -> dict:
        return {"regions": [list(r) for r in self.regions], "metadata_bytes": self.metadata_bytes}

    @classmethod
    def from_json(cls, data: dict) -> "Layout":
        return cls(tuple(tuple(r) for r in data["regions"]), data["metadata_bytes"])

    def check_peer(self, peer: "Layout", backend: str) -> None:
        """A sender's check at connect time: the same regions page for page, or one sentence naming both sides."""
        mine = [b for b, _ in self.regions]
        theirs = [b for b, _ in peer.regions]
        if mine != theirs:
            raise PluginError(
                f"{backend}: this rank registered {len(mine)} KV regions of {sorted(set(mine))} bytes per page, "
                f"the peer {len(theirs)} of {sorted(set(theirs))}; both sides need the same KV layout."
            )
        if peer.metadata_bytes < self.metadata_bytes:
            raise PluginError(
                f"{backend}: the peer holds {peer.metadata_bytes}-byte metadata rows, this rank sends up to "
                f"{self.metadata_bytes}."
            )


def encode_endpoint(backend: str, layout: Layout, **fields) -> bytes:
    return json.dumps({"backend": backend, **layout.to_json(), **fields}).encode()


def decode_endpoint(peer: bytes, backend: str) -> tuple[dict, Layout]:
    try:
        data = json.loads(peer)
    except (ValueError, UnicodeDecodeError) as exc:
        raise PluginError(f"{backend}: the peer endpoint is not a {backend} endpoint ({exc}).") from None
    if not isinstance(data, dict) or data.get("backend") != backend:
        found = data.get("backend") if isinstance(data, dict) else None
        raise PluginError(f"{backend}: the peer endpoint belongs to kv_transfer '{found}', not '{backend}'.")
    return data, Layout.from_json(data)


def check_transfer(layout: Layout, peer: Layout, src: Sequence[int], dst: Sequence[int], metadata: bytes) -> list:
    """The runs of a transfer (page_runs), after the checks `start` makes before launching anything."""
    if len(metadata) > layout.metadata_bytes:
        raise ValueError(f"a {len(metadata)}-byte metadata row; {layout.metadata_bytes} bytes were registered")
    check_pages(src, layout.num_pages, "source")
    check_pages(dst, peer.num_pages, "destination")
    return page_runs(src, dst)


def check_pages(pages: Sequence[int], num_pages: int, what: str) -> None:
    bad = [p for p in pages if not 0 <= p < num_pages]
    if bad:
        raise ValueError(f"{what} page {bad[0]} is outside the {num_pages} registered pages")


def flat(region: KVRegion) -> torch.Tensor:
    """A region as one row of bytes: page p is [p * page_bytes, (p + 1) * page_bytes)."""
    return region.tensor.view(-1).view(torch.uint8)


def page_rows(region: KVRegion) -> torch.Tensor:
    """A region as [pages, words]: 8-byte words where a page divides into them (a gather of byte rows runs ~8x
    more element operations for the same bytes), else bytes."""
    data = flat(region)
    if region.page_bytes % 8 == 0 and data.numel() % 8 == 0 and data.data_ptr() % 8 == 0:
        return data.view(torch.int64).view(-1, region.page_bytes // 8)
    return data.view(-1, region.page_bytes)


def page_slice(region: KVRegion, start: int, count: int) -> torch.Tensor:
    return flat(region)[start * region.page_bytes : (start + count) * region.page_bytes]


class Faults:
    """Injected faults for tests: each started transfer fails with probability `fail_rate` (both sides see FAILED)."""

    def __init__(self, fail_rate: float = 0.0, seed: int = 0):
        if not 0.0 <= fail_rate <= 1.0:
            raise ValueError(f"fail_rate {fail_rate} is not a probability")
        self.fail_rate = fail_rate
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def fail_next(self) -> bool:
        with self._lock:
            return self.fail_rate > 0 and self._rng.random() < self.fail_rate


class Rooms:
    """Room -> state for one side, with the bookkeeping `release` forgets."""

    def __init__(self):
        self.state: dict[int, TransferStatus] = {}
        self.reason: dict[int, str] = {}

    def fail(self, room: int, reason: str) -> None:
        if self.state.get(room) is not DONE:
            self.state[room] = FAILED
            self.reason.setdefault(room, reason)

    def poll(self, room: int) -> TransferStatus | None:
        return self.state.get(room)

    def forget(self, room: int) -> None:
        self.state.pop(room, None)
        self.reason.pop(room, None)


class RoomBackend(KVTransfer):
    """What every built-in backend keeps: each side's Rooms (`_in`, `_out`) under `_lock`, per-room dicts named in
    `room_books`, and the registered `layout`; `label` names the backend in messages."""

    label: ClassVar[str]
    room_books: ClassVar[tuple[str, ...]] = ()

    def reason(self, room: int) -> str:
        return self._in.reason.get(room) or self._out.reason.get(room) or ""

    def release(self, room: int) -> None:
        with self._lock:
            self._in.forget(room)
            self._out.forget(room)
            for name in self.room_books:
                getattr(self, name).pop(room, None)

    def metadata(self, room: int) -> bytes:
        if self._in.poll(room) is not DONE:
            raise KeyError(f"room {room} has not received its metadata row")
        return self._metadata[room]

    def _mark_aborted(self, room: int) -> None:
        """Both sides of `room` FAILED ("aborted" unless a reason came first), its expected pages dropped;
        the caller holds the lock that guards the rooms."""
        for side in (self._in, self._out):
            if room in side.state:
                side.state[room] = FAILED
                side.reason.setdefault(room, "aborted")
        self._expected.pop(room, None)

    def expect(self, room: int, dst_pages: Sequence[int]) -> None:
        check_pages(dst_pages, self._registered().num_pages, "destination")
        with self._lock:
            self._in.state[room] = PENDING
            self._expected[room] = frozenset(dst_pages)

    def _registered(self) -> Layout:
        if self.layout is None:
            raise RuntimeError(f"{self.label}: register the KV regions first")
        return self.layout

    def _runs_to(self, peer: str, src_pages: Sequence[int], dst_pages: Sequence[int], metadata: bytes) -> list:
        """A start's page runs, once the peer is known and the transfer fits both layouts."""
        if peer not in self._layouts:
            raise PluginError(f"{self.label}: peer '{peer}' is not connected; call connect with its endpoint first.")
        return check_transfer(self._registered(), self._layouts[peer], src_pages, dst_pages, metadata)


class PipedBackend(RoomBackend):
    """A backend whose control thread takes commands from `_commands` and wakes on a byte in its pipe."""

    def close(self) -> None:
        if self._thread is None or self._closing:
            return
        self._closing = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=10)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _command(self, command: tuple) -> None:
        if self._thread is None or self._closing or not self._thread.is_alive():
            raise RuntimeError(f"{self.label}: the backend is not running (register first; not after close)")
        self._commands.put(command)
        os.write(self._wake_w, b"x")
