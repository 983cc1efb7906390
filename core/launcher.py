"""Starting the local ranks of one engine, and telling the user which rank failed."""

from __future__ import annotations

import logging
import os
import pickle
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .parallel import ParallelConfig


class RankFailed(RuntimeError):
    pass


def launch(fn: Callable[..., Any], parallel: ParallelConfig, *args) -> Any:
    """Run fn(rank, *args) on this node's ranks; return what global rank 0 returned (None on other nodes).

    One rank: in this process. Several: one spawned process per local rank; if any
    fails or dies, the others are stopped and RankFailed names the first one.
    """
    if not parallel.distributed:
        return fn(0, *args)
    with tempfile.TemporaryDirectory(prefix="moeplex-ranks-") as tmp:
        result_path = os.path.join(tmp, "rank0.pkl")
        try:
            mp.start_processes(
                _rank_main, args=(fn, parallel, result_path, args), nprocs=parallel.ranks_per_node, start_method="spawn"
            )
        except mp.ProcessRaisedException as exc:
            rank = parallel.node_rank * parallel.ranks_per_node + exc.error_index
            raise RankFailed(f"rank {rank} failed: {_last_line(str(exc))}") from None
        except mp.ProcessExitedException as exc:
            rank = parallel.node_rank * parallel.ranks_per_node + exc.error_index
            raise RankFailed(f"rank {rank} died (exit code {exc.exit_code}); the other ranks were stopped") from None
        if os.path.exists(result_path):
            with open(result_path, "rb") as f:
                return pickle.load(f)
        return None


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text


def _rank_main(local_rank: int, fn, parallel: ParallelConfig, result_path: str, args) -> None:
    rank = parallel.node_rank * parallel.ranks_per_node + local_rank
    logging.basicConfig(level=logging.INFO, format="moeplex: %(message)s")  # a spawned process starts unconfigured
    # the node's cores are shared by its ranks: more threads per rank would only contend
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // parallel.ranks_per_node))
    try:
        result = fn(rank, *args)
        if rank == 0:
            with open(result_path, "wb") as f:
                pickle.dump(result, f)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
