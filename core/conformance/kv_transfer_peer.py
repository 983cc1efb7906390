"""The other end of a KV transfer conformance test: a backend and its KV pool, in this process or in a child process.

`Side` is one instance with its pool; `LocalPeer` holds sides in the test's process and `RemotePeer` in a
spawned child (the only honest test of a backend whose peers are other processes), answering the same
calls over a pipe. Pools are filled with random values, so a page that did not move is never equal by luck.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
import traceback
from typing import Sequence

import attrs
import torch

from moeplex.interfaces import kv_regions


@attrs.frozen
class PoolSpec:
    """A KVPool-like set of buffers: `layers` layers of `per_layer` tensors [(pages + 1) * page_size, *token_shape]."""

    layers: int
    per_layer: int  # MHA: 2 (key, value); MLA: 1 (latent + rope key)
    token_shape: tuple[int, ...]
    pages: int = 24
    page_size: int = 4
    dtype: str = "bfloat16"
    device: str = "cpu"
    metadata_bytes: int = 256

    def buffers(self, seed: int) -> list[list[torch.Tensor]]:
        gen = torch.Generator(device=self.device).manual_seed(seed)
        shape = ((self.pages + 1) * self.page_size, *self.token_shape)
        dtype = getattr(torch, self.dtype)
        return [
            [torch.randn(shape, generator=gen, dtype=dtype, device=self.device) for _ in range(self.per_layer)]
            for _ in range(self.layers)
        ]


class Side:
    """One backend instance with its registered pool."""

    def __init__(self, cls: type, spec: PoolSpec, seed: int, options: dict | None = None):
        self.spec = spec
        self.buffers = spec.buffers(seed)
        self.backend = cls(**(options or {}))  # as --disaggregation-transfer-config's JSON object is passed
        self.backend.register(kv_regions(self.buffers, spec.page_size), spec.metadata_bytes)

    def pages(self, pages: Sequence[int]) -> list[torch.Tensor]:
        """The bytes of `pages` in every buffer, in region order, as CPU tensors."""
        size = self.spec.page_size
        if self.spec.device == "cuda":
            torch.cuda.synchronize()
        return [
            torch.cat([tensor[p * size : (p + 1) * size] for p in pages]).cpu() if pages else tensor[:0].cpu()
            for layer in self.buffers
            for tensor in layer
        ]

    def call(self, method: str, *args):
        return getattr(self.backend, method)(*args)

    def byte_views(self) -> list | None:
        """Per buffer, a numpy uint8 view of its memory (CPU pools; None for CUDA ones)."""
        if self.spec.device != "cpu":
            return None
        return [tensor.view(torch.uint8).numpy().reshape(tensor.shape[0], -1) for layer in self.buffers for tensor in layer]

    def page_bytes(self, views: list, pages: Sequence[int]) -> bytes:
        """The bytes of `pages` in every buffer, as `pages` orders them: plain bytes copies under the GIL."""
        size = self.spec.page_size
        return b"".join(view[p * size : (p + 1) * size].tobytes() for view in views for p in pages)


class LocalPeer:
    """Sides in this process."""

    def __init__(self, cls: type):
        self.cls = cls
        self.sides: dict[int, Side] = {}

    def new(self, spec: PoolSpec, seed: int, options: dict | None = None) -> int:
        self.sides[seed] = Side(self.cls, spec, seed, options)
        return seed

    def call(self, side: int, method: str, *args):
        return self.sides[side].call(method, *args)

    def pages(self, side: int, pages: Sequence[int]) -> list[torch.Tensor]:
        return self.sides[side].pages(pages)

    def drop(self, side: int) -> None:
        self.sides.pop(side).call("close")

    def wait_landed(self, polled: int, room: int, receiver: int, dst: Sequence[int], want: list[torch.Tensor],
                    limit_s: float):
        """Poll `polled` until it leaves PENDING and, when it says DONE, compare the receiver's `dst` pages with
        `want` at once, in this process. For CPU pools the poll and the look run under one hold of the GIL (the
        switch interval raised for that span, the look done in plain bytes, which no other thread can enter):
        no Python thread of the backend runs between the DONE and the look, so a copy it makes after its DONE
        is always caught. (status, landed: None unless DONE), or (PENDING, None) after `limit_s`."""
        backend, side = self.sides[polled].backend, self.sides[receiver]
        want_bytes = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in want)
        views = side.byte_views()  # made before the loop: no torch call inside the look
        deadline, interval = time.monotonic() + limit_s, sys.getswitchinterval()
        while True:
            sys.setswitchinterval(30.0)  # no forced switch from here to the look; a thread blocking still yields
            try:
                status = backend.poll(room)
                if status.value == "done":
                    landed = side.page_bytes(views, dst) == want_bytes if views else None
                    break
            finally:
                sys.setswitchinterval(interval)
            if status.value != "pending" or time.monotonic() > deadline:
                return status, None
            time.sleep(0)  # let the backend's threads run between polls
        if landed is None:  # CUDA pools: read back through torch, right after the DONE
            landed = all(torch.equal(a, b) for a, b in zip(want, side.pages(dst)))
        return status, landed

    def kill(self) -> None:
        """The peer dies: here, its instances are closed and forgotten without aborting anything."""
        self.shutdown()

    def shutdown(self) -> None:
        for side in list(self.sides):
            self.drop(side)


class RemotePeer(LocalPeer):
    """Sides in a spawned child process; every call is a round trip over a pipe (exceptions come back raised)."""

    def __init__(self, kind: str, name: str):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(child, kind, name), daemon=True)
        self.process.start()
        child.close()

    def _ask(self, *request):
        self.conn.send(request)
        if not self.conn.poll(60):
            raise TimeoutError(f"the peer process did not answer {request[0]} within 60 s")
        ok, value = self.conn.recv()
        if not ok:
            raise value
        return value

    def new(self, spec: PoolSpec, seed: int, options: dict | None = None) -> int:
        return self._ask("new", spec, seed, options)

    def wait_landed(self, polled: int, room: int, receiver: int, dst: Sequence[int], want: list[torch.Tensor],
                    limit_s: float):
        return self._ask("wait_landed", polled, room, receiver, dst, want, limit_s)

    def kill(self) -> None:
        """The peer process dies at once (SIGKILL): no close, no abort, sockets torn down by the OS."""
        self.process.kill()
        self.process.join(10)
        self.conn.close()

    def call(self, side: int, method: str, *args):
        return self._ask("call", side, method, *args)

    def pages(self, side: int, pages: Sequence[int]) -> list[torch.Tensor]:
        return self._ask("pages", side, pages)

    def drop(self, side: int) -> None:
        self._ask("drop", side)

    def shutdown(self) -> None:
        if not self.process.is_alive():
            return
        try:
            self._ask("exit")
        except (EOFError, OSError, TimeoutError):
            pass
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()


def serve(conn, kind: str, name: str) -> None:
    """The child: load the plugin by name and answer requests until `exit`."""
    from moeplex import registry

    peer = LocalPeer(registry.lookup(kind, name))
    while True:
        try:
            request = conn.recv()
        except EOFError:
            break
        if request[0] == "exit":
            peer.shutdown()
            conn.send((True, None))
            break
        try:
            conn.send((True, getattr(peer, request[0])(*request[1:])))
        except Exception as exc:  # the test process re-raises it
            exc.add_note(traceback.format_exc())
            conn.send((False, exc))
