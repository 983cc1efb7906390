"""Running the dispatcher checks on several EP ranks: real processes joined by torch.distributed.

One spawn runs every check in order on every rank (starting processes costs seconds;
the checks cost milliseconds), and each rank writes what it saw to a JSON file, so a
failure is reported under the check and the rank that saw it.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moeplex.ranks.launcher import exit_rank
from moeplex.registry import lookup

from .dispatch_checks import backend_for, device_for_rank, hidden_size_for, make_context, payloads_for, run_check

COLLECTIVE_TIMEOUT_S = 60  # a dispatcher that deadlocks fails instead of hanging the run
SPAWN_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_key(check: str, payload: str) -> str:
    return check if payload == "bf16" else f"{check}[{payload}]"


def run_on_ranks(plugin_name: str, checks: tuple[str, ...], world: int, out_dir: Path) -> dict[str, str | None]:
    """{check_key(check, payload): None if it passed on every rank, else what failed on which rank}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    context = mp.spawn(
        _rank_main, args=(world, free_port(), plugin_name, checks, str(out_dir)), nprocs=world, join=False
    )
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{world} ranks of dispatcher '{plugin_name}' did not finish in {SPAWN_TIMEOUT_S} s")
    return _merge([_read(out_dir, rank) for rank in range(world)])


def _read(out_dir: Path, rank: int) -> dict[str, str | None]:
    with open(Path(out_dir) / f"rank{rank}.json") as f:
        return json.load(f)


def _merge(per_rank: list[dict[str, str | None]]) -> dict[str, str | None]:
    merged = {}
    for check in per_rank[0]:
        errors = [f"rank {rank}: {results[check]}" for rank, results in enumerate(per_rank) if results[check]]
        merged[check] = "\n".join(errors) or None
    return merged


def _rank_main(rank: int, world: int, port: int, plugin_name: str, checks: tuple[str, ...], out_dir: str) -> None:
    dispatcher_cls = lookup("dispatcher", plugin_name)  # before joining, so a slow import delays no collective
    device = device_for_rank(rank, world, dispatcher_cls.caps.needs_gpu)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # the ranks share this machine's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    backend = backend_for(device, world)
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    try:
        results, in_step = {}, True
        for payload in payloads_for(dispatcher_cls.caps):
            ctx = make_context(
                rank, world, dist.group.WORLD, device, hidden_size_for(dispatcher_cls.caps), payload == "fp8"
            )
            if in_step:
                found, in_step = _run_checks(dispatcher_cls, checks, ctx)
            else:
                found = dict.fromkeys(checks, "not run: an earlier check raised on this rank")
            results.update({check_key(check, payload): error for check, error in found.items()})
        with open(Path(out_dir) / f"rank{rank}.json", "w") as f:
            json.dump(results, f)
        if in_step:
            _leave_together()
    finally:
        dist.destroy_process_group()
    exit_rank()


def _leave_together() -> None:
    """Tearing down while a peer still talks can abort that peer, so ranks in step leave at once."""
    try:
        dist.barrier()
    except RuntimeError:
        pass  # a peer raised and left early; what it saw is in its own file


def _run_checks(dispatcher_cls: type, checks: tuple[str, ...], ctx) -> tuple[dict[str, str | None], bool]:
    """Runs the checks in order on one rank: ({check: None or what failed}, whether the ranks are still in step).

    A failed assertion comes after every collective of its check, so the ranks stay in
    step and the next check runs; any other exception may leave another rank inside a
    collective, so this rank stops there.
    """
    try:
        dispatcher = dispatcher_cls(ctx)
    except Exception:
        return dict.fromkeys(checks, f"setting up the dispatcher failed:\n{traceback.format_exc()}"), False
    results: dict[str, str | None] = {}
    raised = None
    for check in checks:
        if raised is not None:
            results[check] = f"not run: check '{raised}' raised before it on this rank"
            continue
        try:
            run_check(dispatcher, check)
            results[check] = None
        except AssertionError:
            results[check] = traceback.format_exc()
        except Exception:
            results[check] = traceback.format_exc()
            raised = check
    return results, raised is None
