"""Starting the local ranks of one engine, and telling the user which rank (or node) failed.

The rendezvous store is the launcher's: node 0's launcher hosts it before any rank starts, on a socket
it binds itself (loopback and a free port on one node; the --dist-init-addr host and port across nodes),
so a taken port fails at once with the reason and nothing listens on an address it does not need.
Every rank joins the process group as a client of that store.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import socket
import sys
import tempfile
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..parallel import ParallelConfig, default_backend

LOOPBACK = "127.0.0.1"
BEAT_S = 1.0  # how often a launcher tells the store its node is alive
STOP_GRACE_S = 3.0


class RankFailed(RuntimeError):
    pass


class Rendezvous:
    """The store all ranks meet at: hosted here on node 0, reached over the network from the other nodes."""

    def __init__(self, parallel: ParallelConfig):
        self.parallel = parallel
        self.timeout = datetime.timedelta(seconds=parallel.timeout_s)
        host, port = parallel.dist_init_addr.rsplit(":", 1)
        self.host, self.port = (LOOPBACK, 0) if parallel.nnodes == 1 else (host, int(port))
        self.bound: tuple[str, int] | None = None  # where node 0 listens
        self.store: dist.TCPStore | None = None
        self._stop = threading.Event()
        if parallel.node_rank == 0:
            self._host()
        self.address = f"{self.host}:{self.port}"

    def _host(self) -> None:
        listener = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind((self.host, self.port))
            listener.listen(1024)
        except OSError as exc:
            listener.close()
            raise RankFailed(f"cannot host the rendezvous on {self.host}:{self.port} (--dist-init-addr): {exc.strerror}") from None
        self.bound = listener.getsockname()[:2]
        self.port = self.bound[1]
        # the store owns the socket from here on (and closes it when dropped)
        self.store = dist.TCPStore(
            self.host, self.port, None, True, self.timeout, wait_for_workers=False, master_listen_fd=listener.detach()
        )

    def client(self) -> dist.TCPStore:
        return dist.TCPStore(self.host, self.port, None, False, self.timeout)

    def start_beating(self) -> None:
        """Across nodes: count this node's heartbeats in the store, so another node can tell it is gone."""
        if self.parallel.nnodes == 1:
            return
        store = self.store or self.client()
        key = f"moeplex/node/{self.parallel.node_rank}/beats"
        threading.Thread(target=self._beat, args=(store, key), name="moeplex-node-beat", daemon=True).start()

    def _beat(self, store: dist.TCPStore, key: str) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                store.add(key, 1)
            except Exception:  # the store's host is gone: silent_nodes() says so
                return

    def silent_nodes(self) -> str | None:
        """Which other node stopped beating (or that the rendezvous host is unreachable); None if all are alive."""
        if self.parallel.nnodes == 1:
            return None
        try:
            store = self.store or dist.TCPStore(self.host, self.port, None, False, datetime.timedelta(seconds=3))
            others = [n for n in range(self.parallel.nnodes) if n != self.parallel.node_rank]
            before = {n: store.add(f"moeplex/node/{n}/beats", 0) for n in others}
            self._stop.wait(3 * BEAT_S)
            silent = [n for n in others if store.add(f"moeplex/node/{n}/beats", 0) == before[n]]
        except Exception:
            return f"node 0 (the rendezvous host, {self.address}) is unreachable"
        if not silent:
            return None
        per = self.parallel.ranks_per_node
        return "; ".join(f"node {n} (ranks {n * per}..{(n + 1) * per - 1}) stopped answering" for n in silent)

    def close(self) -> None:
        self._stop.set()
        self.store = None


def launch(fn: Callable[..., Any], parallel: ParallelConfig, *args, device: str = "cpu") -> Any:
    """Run fn(rank, *args) on this node's ranks; return what global rank 0 returned (None on other nodes).

    One rank: in this process. Several: one spawned process per local rank, each already in the process
    group (for `device`'s default backend) when fn starts; if any fails or dies, the others are stopped
    and RankFailed names the first one, or the node that went silent.
    """
    if not parallel.distributed:
        return fn(0, *args)
    rendezvous = Rendezvous(parallel)
    rendezvous.start_beating()
    backend = parallel.dist_backend or default_backend(torch.device(device))
    joining = (rendezvous.host, rendezvous.port, backend)
    try:
        with tempfile.TemporaryDirectory(prefix="moeplex-ranks-") as tmp:
            result_path = os.path.join(tmp, "rank0.pkl")
            try:
                ranks = mp.start_processes(
                    _rank_main, args=(fn, parallel, joining, result_path, args), nprocs=parallel.ranks_per_node,
                    start_method="spawn", join=False,
                )
                # after a failure the others get a few seconds, not torch's 30, before SIGTERM and then SIGKILL:
                # a stopped or hung rank (or one ignoring SIGTERM, as served ranks do) would hold the exit
                while not ranks.join(grace_period=STOP_GRACE_S):
                    pass
            except mp.ProcessRaisedException as exc:
                rank = parallel.node_rank * parallel.ranks_per_node + exc.error_index
                raise RankFailed(_blame(rendezvous, f"rank {rank} failed: {last_line(str(exc))}")) from None
            except mp.ProcessExitedException as exc:
                rank = parallel.node_rank * parallel.ranks_per_node + exc.error_index
                message = f"rank {rank} died (exit code {exc.exit_code}); the other ranks were stopped"
                raise RankFailed(_blame(rendezvous, message)) from None
            if os.path.exists(result_path):
                with open(result_path, "rb") as f:
                    return pickle.load(f)
            return None
    finally:
        rendezvous.close()


def _blame(rendezvous: Rendezvous, message: str) -> str:
    """A local rank's failure is often another node's: say so first when one went silent."""
    silent = rendezvous.silent_nodes()
    return f"{silent} ({message})" if silent else message


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text


def set_rank_threads(ranks_per_node: int) -> None:
    """Torch's CPU threads for each of a node's ranks: OMP_NUM_THREADS where it is set (torch read it at start-up),
    else the node's cores shared by its ranks (one rank keeps torch's own choice). On a GPU rank one thread was
    measured too (H100, tiny DeepSeek-V3 at concurrency 64, results/serving_offline_h100_s15.md): served 5% faster,
    offline 19% slower, so GPU ranks keep the same rule."""
    if os.environ.get("OMP_NUM_THREADS") or ranks_per_node == 1:
        return
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_per_node))  # more threads per rank would only contend


def _rank_main(local_rank: int, fn, parallel: ParallelConfig, joining: tuple, result_path: str, args) -> None:
    rank = parallel.node_rank * parallel.ranks_per_node + local_rank
    logging.basicConfig(level=logging.INFO, format="moeplex: %(message)s")  # a spawned process starts unconfigured
    set_rank_threads(parallel.ranks_per_node)
    host, port, backend = joining
    timeout = datetime.timedelta(seconds=parallel.timeout_s)
    store = dist.TCPStore(host, port, None, False, timeout)
    dist.init_process_group(backend=backend, store=store, world_size=parallel.world_size, rank=rank, timeout=timeout)
    try:
        result = fn(rank, *args)
        if rank == 0:
            with open(result_path, "wb") as f:
                pickle.dump(result, f)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    exit_rank()


def exit_rank() -> None:
    """Leave a spawned rank that succeeded without finalizing the interpreter: gloo's worker threads may still drop the
    last reference to a finished collective's tensors, and a thread that needs the GIL while the interpreter
    finalizes aborts the process (SIGABRT after a clean run: pytorch/pytorch#190489). Nothing is left to do."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
