"""KV transfer contract: how a prefill server's KV pages reach a decode server's pool.

A backend registers one rank's KV buffers once (`KVPool.buffers`: per layer, per cached quantity, one
tensor whose page p is the contiguous byte range [p * page_bytes, (p + 1) * page_bytes)), describes itself
as endpoint bytes a peer can connect to, and moves (source pages -> destination pages) plus one small
metadata row per room. Every call returns at once: `start` launches, `poll` reports, `abort` ends
(`abort` may wait for one page run being copied, so that no byte moves after it returns).

Who calls what: the receiver (decode) registers, `expect`s each room's destination pages and hands its
`endpoint()` to the sender; the sender (prefill) `connect`s to that endpoint and `start`s. Whichever side
moves the bytes (the sender pushes in zmq and loopback, the receiver pulls in nixl and cuda-ipc),
the calls are the same.

Ownership (docs/pd.md): the receiver owns its destination pages and frees them only once no more bytes can
land; `poll` returning DONE on either side promises that every byte of the transfer is in the receiver's
buffers. A backend that reports DONE before the bytes land is wrong; the conformance suite catches it.
The sender's source pages may be reused once its `poll` says DONE or FAILED, or once `abort` returned.
Bytes for a room the receiver does not expect (never expected, aborted, released) are dropped, and the
sender's `poll` turns FAILED. docs/kv_transfer.md has the per-backend details.
"""

from __future__ import annotations

import abc
import enum
from typing import ClassVar, Sequence

import attrs
import torch


class TransferStatus(str, enum.Enum):
    PENDING = "pending"  # launched, not finished
    DONE = "done"  # every byte and the metadata row are in the receiver's memory
    FAILED = "failed"  # the transfer will never complete (peer lost, injected failure, deadline, abort)


@attrs.frozen
class KVTransferCaps:
    devices: frozenset[str] = frozenset({"cpu"})  # device types whose buffers it can register
    cross_host: bool = True  # peers may be on another host (cuda-ipc: False)
    cross_process: bool = True  # peers may be other processes (loopback: False, its peers share one process)
    needs_extra: str | None = None  # the pip extra that brings its library; without it the constructor raises
    # PluginError saying "install moeplex[<extra>]"


@attrs.frozen
class KVRegion:
    """One registered buffer: a layer's cached quantity, `page_bytes` per page, pages laid out in order."""

    tensor: torch.Tensor
    page_bytes: int


def kv_regions(buffers: Sequence[Sequence[torch.Tensor]], page_size: int) -> list[KVRegion]:
    """The regions of a KVPool's buffers (pool.buffers), one per layer and quantity, in a fixed order."""
    regions = []
    for layer in buffers:
        for tensor in layer:
            regions.append(KVRegion(tensor, page_size * tensor[0].numel() * tensor.element_size()))
    return regions


def page_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs where both page lists advance by one: each moves as one range."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source pages but {len(dst)} destination pages")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class KVTransfer(abc.ABC):
    """One rank's end of KV movement; the same object sends (prefill) and receives (decode)."""

    caps: ClassVar[KVTransferCaps]

    @abc.abstractmethod
    def register(self, regions: Sequence[KVRegion], metadata_bytes: int) -> None:
        """Register this rank's KV regions once, plus room for one `metadata_bytes` row per room."""

    @abc.abstractmethod
    def endpoint(self) -> bytes:
        """Serialisable description a peer passes to `connect` (address, memory handles, region sizes)."""

    @abc.abstractmethod
    def connect(self, peer: bytes) -> str:
        """Sender: connect to a receiver's endpoint; returns a peer id for `start`.

        Raises PluginError naming what does not match (region count or page sizes, backend)."""

    @abc.abstractmethod
    def expect(self, room: int, dst_pages: Sequence[int]) -> None:
        """Receiver: pages of room `room` will land in `dst_pages`; writes to a room not expected are dropped."""

    @abc.abstractmethod
    def start(self, room: int, peer: str, src_pages: Sequence[int], dst_pages: Sequence[int], metadata: bytes) -> None:
        """Sender: launch the copy of src_pages (every region) to the peer's dst_pages, then the metadata row.

        Never blocks; runs of consecutive pages move as one range. Raises ValueError at once for a metadata row
        longer than the registered `metadata_bytes`, a page list of unequal lengths or a page out of range."""

    @abc.abstractmethod
    def poll(self, room: int) -> TransferStatus:
        """Either side: the state of a room's transfer (receiver: DONE once bytes and metadata landed;
        sender: DONE once the receiver said so). A room this side does not know is FAILED."""

    @abc.abstractmethod
    def metadata(self, room: int) -> bytes:
        """Receiver, after DONE: the metadata row the sender attached, exactly the bytes passed to `start`."""

    @abc.abstractmethod
    def abort(self, room: int) -> None:
        """Either side: end the room; later bytes for it are dropped and `poll` says FAILED. Idempotent."""

    def reason(self, room: int) -> str:
        """Either side, after FAILED: why, in a few words ("aborted", "the receiver did not answer for 30 s",
        "injected failure"), for the error the client sees; "" when the backend does not say."""
        return ""

    def release(self, room: int) -> None:
        """Forget a finished room's bookkeeping (after DONE or FAILED has been acted on)."""

    def close(self) -> None:
        """Stop background threads and free registrations."""
