"""Time one MoE layer's dispatch + combine: `naive` (all-to-all) against `local` (no moving), at 1, 2 and 4 EP ranks.

    python benchmarks/dispatch.py [--ranks 1 2 4] [--iters 20] [--warmup 3] [--out benchmarks/results/dispatch_cpu.md]

Ranks are processes: gloo on the CPU, or one process per GPU on NCCL where CUDA devices are
present (rank counts above the device count are skipped). Every rank routes its tokens to
top-k distinct experts drawn uniformly; the experts are identity and hand back each received
row as a fused kernel does (summed, weights applied), so only the moving is timed.

For each rank count and batch the table gives:
- the time of one layer (dispatch_start .. combine_finish; median over iterations, slowest rank);
- `local`, the reference measured in the same processes: the same tokens handed to the kernel
  and back on one rank holding every expert, so naive / local is the price of expert parallelism;
- bytes moved: what one rank's all-to-alls carry, rows to itself included (dispatch: hidden
  rows plus 2K float32 of ids and weights each; combine: the hidden rows back), mean over ranks;
- naive GB/s = bytes moved / layer time, against the roofline measured in the same run: one
  even `all_to_all_single` of the same byte count, the best this backend does for that size.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import attrs
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from report import emit  # benchmarks/report.py, beside this file

from moeplex.conformance.dispatch_ranks import free_port
from moeplex.interfaces import ExpertOutput, MoEContext
from moeplex.registry import lookup

COLLECTIVE_TIMEOUT_S = 120


@attrs.frozen
class Shape:
    hidden: int
    experts: int
    top_k: int
    batches: tuple[tuple[str, int], ...]  # (label, tokens per rank)
    dtype: torch.dtype = torch.bfloat16


CPU_SHAPE = Shape(hidden=1024, experts=64, top_k=8, batches=(("prefill", 512), ("decode", 32)))
GPU_SHAPE = Shape(hidden=7168, experts=256, top_k=8, batches=(("prefill", 4096), ("decode", 128)))


@attrs.frozen
class Row:
    ranks: int
    batch: str
    tokens: int
    local_s: float
    naive_s: float
    bytes_moved: float  # per rank, mean over ranks
    roofline_gbps: float  # an even all-to-all of the same bytes


def make_batch(shape: Shape, tokens: int, seed: int, device: torch.device):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, shape.experts, generator=gen).argsort(dim=1)[:, : shape.top_k]
    weights = torch.rand(tokens, shape.top_k, generator=gen)
    hidden = torch.randn(tokens, shape.hidden, generator=gen).to(shape.dtype)
    return hidden.to(device), ids.to(device), weights.to(device)


def context(shape: Shape, tokens: int, rank: int, world: int, device: torch.device) -> MoEContext:
    group = dist.group.WORLD if world > 1 else None
    return MoEContext(
        shape.hidden, shape.hidden, shape.experts, shape.top_k, shape.dtype, device, rank, world, group, tokens
    )


def layer(dispatcher, hidden, ids, weights) -> torch.Tensor:
    dispatched = dispatcher.dispatch_finish(dispatcher.dispatch_start(hidden, ids, weights))
    output = ExpertOutput(dispatched.layout.hidden, weights_applied=True, summed=True)  # identity experts
    return dispatcher.combine_finish(dispatcher.combine_start(output, dispatched.handle))


def slowest_median(step, iters: int, warmup: int, device: torch.device) -> float:
    """Median seconds of `step` on this rank, then the largest over ranks (a layer waits for its slowest rank)."""
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return _all_reduce(statistics.median(times), dist.ReduceOp.MAX, device)


def bytes_moved(shape: Shape, ids: torch.Tensor, received_rows: int, world: int, device: torch.device) -> float:
    """Bytes this rank's dispatch and combine all-to-alls carry, mean over ranks."""
    dest = ids // (shape.experts // world)
    rows_sent = int(torch.nn.functional.one_hot(dest, world).amax(dim=1).sum())
    row_bytes = shape.hidden * torch.finfo(shape.dtype).bits // 8
    moved = rows_sent * (row_bytes + 2 * shape.top_k * 4) + received_rows * row_bytes
    return _all_reduce(float(moved), dist.ReduceOp.SUM, device) / world


def roofline_gbps(num_bytes: float, world: int, iters: int, warmup: int, device: torch.device) -> float:
    """GB/s of one even all_to_all_single carrying `num_bytes` per rank."""
    chunk = max(int(num_bytes) // world, 1)
    send = torch.ones(chunk * world, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)
    seconds = slowest_median(lambda: dist.all_to_all_single(recv, send), iters, warmup, device)
    return chunk * world / seconds / 1e9


def measure(shape: Shape, label: str, tokens: int, rank: int, world: int, args, device: torch.device) -> Row:
    hidden, ids, weights = make_batch(shape, tokens, seed=rank, device=device)
    naive = lookup("dispatcher", "naive")(context(shape, tokens, rank, world, device))
    local = lookup("dispatcher", "local")(context(shape, tokens, 0, 1, device))
    naive_s = slowest_median(lambda: layer(naive, hidden, ids, weights), args.iters, args.warmup, device)
    local_s = slowest_median(lambda: layer(local, hidden, ids, weights), args.iters, args.warmup, device)
    received = naive.dispatch(hidden, ids, weights).layout.num_rows
    moved = bytes_moved(shape, ids, received, world, device)
    roofline = roofline_gbps(moved, world, args.iters, args.warmup, device)
    return Row(world, label, tokens, local_s, naive_s, moved, roofline)


def rank_main(rank: int, world: int, port: int, shape: Shape, args, out_path: str) -> None:
    device = _device(rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # NVLink multicast (NVLS) stays off: on shared GPU hosts a program using it can put the GPUs out of service
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    torch.set_num_threads(args.threads)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    try:
        rows = [measure(shape, label, tokens, rank, world, args, device) for label, tokens in shape.batches]
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out_path).write_text(json.dumps([attrs.asdict(row) for row in rows]))


def run_ranks(world: int, shape: Shape, args) -> list[Row]:
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rows.json")
        mp.spawn(rank_main, args=(world, free_port(), shape, args, out_path), nprocs=world)
        return [Row(**row) for row in json.loads(Path(out_path).read_text())]


def table(rows: list[Row], shape: Shape, backend: str, machine: str, args) -> str:
    lines = [
        f"# dispatch + combine per MoE layer: naive vs local ({backend})",
        "",
        f"{machine}; torch {torch.__version__}; {str(shape.dtype).removeprefix('torch.')} hidden {shape.hidden}, "
        f"{shape.experts} experts, top-{shape.top_k}, uniform routing, identity experts; median of {args.iters} "
        f"iterations after {args.warmup}, slowest rank; {args.threads} torch thread(s) per rank.",
        "`local` hands the tokens to the kernel without moving them, so naive / local is the whole price of "
        "moving; bytes moved count every row the all-to-alls carry, rows a rank sends itself included.",
        "",
        "| ranks | batch | tokens/rank | local ms | naive ms | naive / local | MB moved/rank | naive GB/s "
        "| even all-to-all GB/s | % of even all-to-all |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        gbps = row.bytes_moved / row.naive_s / 1e9
        lines.append(
            f"| {row.ranks} | {row.batch} | {row.tokens} | {row.local_s * 1e3:.3f} | {row.naive_s * 1e3:.3f} "
            f"| {row.naive_s / row.local_s:.0f}x | {row.bytes_moved / 1e6:.2f} | {gbps:.2f} "
            f"| {row.roofline_gbps:.2f} | {100 * gbps / row.roofline_gbps:.0f}% |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="EP rank counts to time")
    parser.add_argument("--iters", type=int, default=20, help="timed layers per measurement; the median is reported")
    parser.add_argument("--warmup", type=int, default=3, help="untimed layers before each measurement")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank process")
    parser.add_argument("--out", type=Path, help="also write the Markdown table to this file")
    args = parser.parse_args()

    gpus = torch.cuda.device_count()
    shape, backend = (GPU_SHAPE, "NCCL") if gpus else (CPU_SHAPE, "gloo")
    cpus = f"{os.cpu_count()} CPU cores ({platform.machine()})"
    machine = f"{gpus} x {torch.cuda.get_device_name(0)}" if gpus else cpus
    rows = []
    for world in args.ranks:
        if gpus and world > gpus:
            print(f"skipping {world} ranks: {gpus} CUDA device(s)")
            continue
        rows.extend(run_ranks(world, shape, args))
    emit(table(rows, shape, backend, machine, args), args.out)


def _device(rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _all_reduce(value: float, op, device: torch.device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return tensor.item()


if __name__ == "__main__":
    main()
