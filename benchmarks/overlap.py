"""Time per forward step under the overlap strategies none / tbo / sbo, over real ranks.

    python benchmarks/overlap.py --ranks 2 4 --preset small

Every rank runs DP attention over its own batch (decode: N requests with a cached prefix;
prefill: 4096 new tokens) and shares the MoE layers through the `naive` all-to-all
dispatcher (gloo on CPU, NCCL on GPUs). The step time is the slowest rank's median.
Prints a Markdown table with the ratio of each strategy to `none`.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time

import attrs
import torch
import torch.distributed as dist

from report import emit  # benchmarks/report.py, beside this file

from moeplex.batch_builder import ScheduledSeq, build_forward_batch
from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.interfaces import BatchMeta
from moeplex.launcher import launch
from moeplex.models.make_model import write_checkpoint
from moeplex.parallel import ParallelConfig, init_parallel
from moeplex.registry import lookup

STRATEGIES = ("none", "tbo", "sbo")
PREFIX = 64  # cached tokens of every decoding request


def batches(engine: Engine, decode_sizes, prefill_tokens: int):
    """(label, tokens per rank, ForwardBatch); the KV cache content is irrelevant to timing."""
    kv = engine.kv
    for n in decode_sizes:
        seqs = [ScheduledSeq([1], PREFIX, kv.allocate(kv.pages_for(PREFIX + 1))) for _ in range(n)]
        yield "decode", n, build_forward_batch(seqs, kv, engine.device)
        kv.release([p for s in seqs for p in s.pages])
    chunk = 512
    seqs = [ScheduledSeq([1] * chunk, 0, kv.allocate(kv.pages_for(chunk))) for _ in range(prefill_tokens // chunk)]
    yield "prefill", prefill_tokens, build_forward_batch(seqs, kv, engine.device)
    kv.release([p for s in seqs for p in s.pages])


def time_step(engine: Engine, batch, strategy, repeats: int) -> float:
    """Median seconds of one forward, the slowest rank's."""
    cuts = strategy.cuts(BatchMeta(batch.mode, batch.extend_lens))
    batch = attrs.evolve(batch, global_num_tokens=(batch.num_tokens,) * dist.get_world_size(), overlap_split=cuts is not None)
    times = []
    with torch.inference_mode():
        for i in range(repeats + 2):
            dist.barrier()
            start = time.perf_counter()
            engine.model(batch, engine.kv, strategy)
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - start)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest)


def rank_main(rank, parallel_config, folder, decode_sizes, prefill_tokens, repeats, device):
    parallel = init_parallel(parallel_config, rank, torch.device(device))
    config = EngineConfig(
        model=folder, device=device, show_progress=False, dispatcher="naive", parallel=parallel_config,
        max_total_tokens=max(prefill_tokens, max(decode_sizes) * (PREFIX + 16)) + 1024,
    )
    engine = Engine(config, parallel=parallel)
    rows = []
    for label, tokens, batch in batches(engine, decode_sizes, prefill_tokens):
        row = {"batch": label, "tokens": tokens}
        for name in STRATEGIES:
            row[name] = time_step(engine, batch, lookup("overlap", name)(), repeats)
        rows.append(row)
    return rows


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--arch", default="deepseek_v3")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--decode", type=int, nargs="+", default=[32, 128, 256], help="decode tokens per rank")
    parser.add_argument("--prefill", type=int, default=4096, help="prefill tokens per rank")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    folder = write_checkpoint(tempfile.mkdtemp(prefix="moeplex-overlap-"), args.arch, args.preset, seed=0)
    lines = [
        f"Overlap strategies, {args.arch} {args.preset}, DP attention + `naive` EP, {device}, "
        f"torch {torch.__version__}, {os.cpu_count()} cores; slowest rank's median step (ms)",
        "",
        "| ranks | batch | tokens/rank | none ms | tbo ms | sbo ms | tbo speed-up | sbo speed-up |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for ranks in args.ranks:
        parallel = ParallelConfig(tp_size=ranks, ep_size=ranks, dp_size=ranks, enable_dp_attention=True,
                                  dist_init_addr=free_address(), timeout_s=600)
        for row in launch(rank_main, parallel, parallel, folder, args.decode, args.prefill, args.repeats, device):
            none, tbo, sbo = (row[name] * 1e3 for name in STRATEGIES)
            lines.append(f"| {ranks} | {row['batch']} | {row['tokens']} | {none:.1f} | {tbo:.1f} | {sbo:.1f} | "
                         f"{none / tbo:.2f}x | {none / sbo:.2f}x |")
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    sys.exit(main())
