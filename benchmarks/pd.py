"""Prefill/decode disaggregation benchmarks. `transfer`: KV transfer GB/s per kv_transfer backend over page counts.

    .venv/bin/python benchmarks/pd.py transfer --runs 3 --out benchmarks/results/pd_transfer_cpu.md
    python3 benchmarks/pd.py transfer --device cuda --layers 48 --backends cuda-ipc zmq loopback \\
        --pages 16 256 1024 4096 --out benchmarks/results/pd_transfer_h200.md

Pages have Qwen3-30B-A3B's shape: per layer a key and a value of [4 kv heads, 128] bf16 per token, 16 tokens
a page, so one page of all 48 layers is 1.5 MiB (`--layers` scales it down on CPU: 8 layers, 256 KiB).
For each backend and page count: the median GB/s of --runs transfers with min-max, and the ratio to a plain
torch copy of the same bytes in this process (the same run). See benchmarks/pd_transfer.py for the method.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pd_transfer import PoolSpec, copy_rate, measure, page_bytes, summary  # noqa: E402
from report import emit  # noqa: E402


def transfer(args) -> str:
    spec = PoolSpec(
        layers=args.layers, per_layer=2, token_shape=(args.kv_heads, args.head_dim), pages=max(args.pages),
        page_size=args.page_size, dtype="bfloat16", device=args.device,
    )
    lines = [
        f"# KV transfer throughput ({args.device}, {args.pattern} pages)",
        "",
        f"Command: `{' '.join([os.path.basename(sys.executable), *sys.argv])}`",
        f"Machine: {machine(args.device)}",
        f"Page: {args.layers} layers x (K, V) x {args.page_size} tokens x [{args.kv_heads}, {args.head_dim}] bf16 = "
        f"{page_bytes(spec) / 2**10:.0f} KiB; {args.runs} runs each, median (min-max) GB/s; time from `start` to the "
        "sender's DONE (bytes in the receiver's pool).",
        "",
        "| backend | pages | MiB | GB/s | torch copy GB/s | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for name in args.backends:
        counts = [c for c in args.pages if name not in args.small_only or c <= args.small_only_max]
        print(f"{name}: {counts} pages", file=sys.stderr, flush=True)
        for row in measure(name, spec, counts, args.runs, args.pattern):
            reference = copy_rate(row["bytes"], args.device, args.runs)
            ratio = statistics.median(row["rates"]) / statistics.median(reference)
            lines.append(
                f"| {name} | {row['pages']} | {row['bytes'] / 2**20:.0f} | {summary(row['rates'])} | "
                f"{summary(reference)} | {ratio:.3f} |"
            )
            print(lines[-1], file=sys.stderr, flush=True)
    return "\n".join(lines) + "\n"


def machine(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs (shared with other work), torch {torch.__version__}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("transfer", help="KV transfer GB/s per backend over page counts, against a torch copy")
    t.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where both pools live (default: cpu)")
    t.add_argument("--backends", nargs="+", default=None,
                   help="kv_transfer backends (default: loopback zmq, plus nixl when installed; cuda: cuda-ipc zmq loopback)")
    t.add_argument("--pages", nargs="+", type=int, default=[16, 64, 256, 1024], help="page counts per transfer")
    t.add_argument("--layers", type=int, default=8, help="layers per page (Qwen3-30B-A3B has 48; default: 8)")
    t.add_argument("--kv-heads", type=int, default=4, help="KV heads per token (default: 4)")
    t.add_argument("--head-dim", type=int, default=128, help="head dimension (default: 128)")
    t.add_argument("--page-size", type=int, default=16, help="tokens per page (default: 16)")
    t.add_argument("--pattern", choices=["scattered", "contiguous"], default="scattered",
                   help="random pages (runs of one page) or one block (default: scattered)")
    t.add_argument("--small-only", nargs="*", default=[], help="backends measured only up to --small-only-max pages")
    t.add_argument("--small-only-max", type=int, default=1024, help="the largest count for --small-only backends")
    t.add_argument("--runs", type=int, default=3, help="transfers per point (default: 3)")
    t.add_argument("--out", default=None, help="also write the Markdown table to this file")
    args = parser.parse_args()
    if args.backends is None:
        installed = registry_names()
        args.backends = ["cuda-ipc", "zmq", "loopback"] if args.device == "cuda" else [
            n for n in ("loopback", "zmq", "nixl") if n in installed
        ]
    emit(transfer(args), args.out)


def registry_names() -> list[str]:
    from moeplex import registry

    names = list(registry.discover("kv_transfer"))
    try:
        from moeplex.plugins.kv_transfer.nixl import load_nixl

        load_nixl()
    except Exception:
        names = [n for n in names if n != "nixl"]
    return names


if __name__ == "__main__":
    main()
