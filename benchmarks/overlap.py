"""Time per forward step under the overlap strategies none / tbo / sbo, over real ranks.

    python benchmarks/overlap.py --ranks 2 4 --preset small                        # CPU, gloo
    python benchmarks/overlap.py --ranks 2 --preset v3 --set num_hidden_layers=4 \
        --set first_k_dense_replace=1 --dummy --dispatchers naive deepep-normal deepep-ll   # one GPU per rank

Every rank runs DP attention over its own batch (decode: N requests with a cached prefix;
prefill: 4096 new tokens) and shares the MoE layers through each dispatcher (`naive`: gloo on
CPU, NCCL on GPUs; DeepEP's where installed). The step time is the slowest rank's median. A
strategy the start-up check refuses for a dispatcher, and a batch larger than a dispatcher's
fixed buffer, are listed with the reason. Prints a Markdown table with the ratio of each
strategy to `none`.
"""

from __future__ import annotations

import argparse
import json
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
from moeplex.ranks.launcher import launch
from moeplex.models.make_model import write_checkpoint
from moeplex.parallel import ParallelConfig, init_parallel, rank_device
from moeplex.registry import PluginError, lookup
from moeplex.selection import resolve

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


def time_step(engine: Engine, batch, strategy, repeats: int, host_group) -> float:
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
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=host_group)
    return float(slowest)


def refusal(config: EngineConfig, strategy: str, ep_size: int) -> str | None:
    """Why the start-up check refuses `strategy` with the config's dispatcher, if it does."""
    try:
        resolve(attrs.evolve(config, overlap=strategy), ep_size=ep_size)
    except PluginError as exc:
        return str(exc)
    return None


def rank_main(rank, parallel_config, args, folder, device):
    torch_device = torch.device(rank_device(device, rank, parallel_config))
    parallel = init_parallel(parallel_config, rank, torch_device)
    rows = []
    for dispatcher in args.dispatchers:
        dcaps = lookup("dispatcher", dispatcher).caps
        decode_only = dcaps.fixed_max_tokens and not dcaps.other_layouts  # a buffer sized for decode batches
        config = EngineConfig(
            model=folder, device=str(torch_device), dtype=args.dtype, show_progress=False, dispatcher=dispatcher,
            parallel=parallel_config, load_format="dummy" if args.dummy else "auto", disable_cuda_graph=True,
            max_total_tokens=max(args.prefill, max(args.decode) * (PREFIX + 16)) + 1024,
            max_running_requests=max(args.decode),
            max_batched_tokens=max(args.decode) if decode_only else max(args.prefill, max(args.decode)),
        )
        engine = Engine(config, parallel=parallel)
        refused = {name: refusal(config, name, parallel_config.ep_size) for name in STRATEGIES}
        buffer = engine.model.moe_runtime.ctx.max_tokens_per_rank
        for label, tokens, batch in batches(engine, args.decode, args.prefill):
            row = {"dispatcher": dispatcher, "batch": label, "tokens": tokens}
            if dcaps.fixed_max_tokens and tokens > buffer:
                row["skipped"] = f"more tokens than its {buffer}-token buffer"
            else:
                for name in STRATEGIES:
                    row[name] = refused[name] or time_step(engine, batch, lookup("overlap", name)(), args.repeats,
                                                           parallel.world.host_group)
            rows.append(row)
        del engine
        if torch_device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def cell(value) -> str:
    return f"{value * 1e3:.1f}" if isinstance(value, float) else "refused"


def ratio(row, name: str) -> str:
    none, other = row.get("none"), row.get(name)
    return f"{none / other:.2f}x" if isinstance(none, float) and isinstance(other, float) else "-"


def table_rows(ranks: int, rows: list[dict]) -> tuple[list[str], set[str]]:
    lines, reasons = [], set()
    for row in rows:
        head = f"| {ranks} | {row['dispatcher']} | {row['batch']} | {row['tokens']} |"
        if "skipped" in row:
            lines.append(f"{head} skipped: {row['skipped']} | | | | |")
            continue
        reasons.update(row[name] for name in STRATEGIES if isinstance(row[name], str))
        lines.append(f"{head} {' | '.join(cell(row[name]) for name in STRATEGIES)} | {ratio(row, 'tbo')} | {ratio(row, 'sbo')} |")
    return lines, reasons


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="EP/DP ranks per run (default: 2 4)")
    parser.add_argument("--arch", default="deepseek_v3")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    parser.add_argument("--dummy", action="store_true", help="write config.json only; ranks make random weights")
    parser.add_argument("--dispatchers", nargs="+", default=["naive"], help="dispatchers to time (default: naive)")
    parser.add_argument("--dtype", default=None, help="model dtype (default: bf16 on GPUs, fp32 on CPU)")
    parser.add_argument("--decode", type=int, nargs="+", default=[32, 128, 256], help="decode tokens per rank")
    parser.add_argument("--prefill", type=int, default=4096, help="prefill tokens per rank")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dtype = args.dtype or ("bf16" if device == "cuda" else "fp32")
    overrides = {key: json.loads(value) for key, value in (item.split("=", 1) for item in args.set)}
    folder = write_checkpoint(tempfile.mkdtemp(prefix="moeplex-overlap-"), args.arch, args.preset, seed=0,
                              overrides=overrides, config_only=args.dummy)
    shape = f"{args.arch} {args.preset}" + "".join(f", {item}" for item in args.set)
    lines = [
        f"Overlap strategies, {shape}, {args.dtype}, DP attention + EP, {device}, torch {torch.__version__}, "
        f"{os.cpu_count()} cores; slowest rank's median step (ms)",
        "",
        "| ranks | dispatcher | batch | tokens/rank | none ms | tbo ms | sbo ms | tbo speed-up | sbo speed-up |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    reasons = set()
    for ranks in args.ranks:
        parallel = ParallelConfig(tp_size=ranks, ep_size=ranks, dp_size=ranks, enable_dp_attention=True,
                                  dist_init_addr=free_address(), timeout_s=600)
        rows, why = table_rows(ranks, launch(rank_main, parallel, parallel, args, folder, device))
        lines += rows
        reasons |= why
    lines += [""] + [f"Refused: {reason}" for reason in sorted(reasons)]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    sys.exit(main())
