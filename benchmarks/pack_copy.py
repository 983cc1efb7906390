"""Packing a step's index arrays for its host-to-device copy: torch.cat against numpy, with the cores idle and busy.

    python benchmarks/pack_copy.py [--threads N] [--calls 2000] [--runs 3] [--out FILE]

The arrays are those of a decode step of 64 requests of ~220 cached tokens (input ids, positions, slots, sequence
lengths, KV indices, indptr, page table: ~45k int64 values). torch.cat of that many values runs on torch's intra-op
threads (above its 32768-element grain); numpy's concatenate runs on the calling thread (what transfer.to_device
does since session 16). Each side runs --calls packs, with every core idle, then with one busy process per core
(what an HTTP front end and its clients are to a served rank). Printed: mean, median, p99 and max microseconds
per pack, median (min-max) over --runs runs; the ratio is torch's mean over numpy's in the same run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import emit, processor  # noqa: E402

SIZES = (64, 64, 64, 64, 14_000, 65, 31_000)  # input ids, positions, slots, seq lens, KV indices, indptr, table


def spin(stop) -> None:
    while not stop.is_set():
        pass


def timed(pack, calls: int) -> list[float]:
    for _ in range(50):
        pack()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        pack()
        times.append(time.perf_counter() - start)
    return sorted(times)


def measure(calls: int) -> dict[str, list[float]]:
    arrays = [torch.from_numpy(np.arange(n, dtype=np.int64)) for n in SIZES]
    total = sum(SIZES)

    def with_torch():
        return torch.cat([a.reshape(-1) for a in arrays])

    def with_numpy():
        out = np.empty(total, dtype=np.int64)
        np.concatenate([a.numpy() for a in arrays], out=out)
        return out

    return {"torch.cat": timed(with_torch, calls), "numpy": timed(with_numpy, calls)}


def summary(times: list[float]) -> tuple[float, float, float, float]:
    us = [1e6 * t for t in times]
    return statistics.fmean(us), us[len(us) // 2], us[int(0.99 * (len(us) - 1))], us[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads (default: the cores)")
    parser.add_argument("--calls", type=int, default=2000, help="packs timed per side and run (default: 2000)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = {}
    for load in ("idle", "busy"):
        for _ in range(args.runs):
            stop, spinners = multiprocessing.Event(), []
            if load == "busy":
                spinners = [multiprocessing.Process(target=spin, args=(stop,)) for _ in range(os.cpu_count() or 1)]
                for p in spinners:
                    p.start()
                time.sleep(0.2)
            try:
                got = measure(args.calls)
            finally:
                stop.set()
                for p in spinners:
                    p.join()
            for side, times in got.items():
                rows.setdefault((load, side), []).append(summary(times))
            rows.setdefault((load, "ratio"), []).append(statistics.fmean(got["torch.cat"]) / statistics.fmean(got["numpy"]))
    spread = lambda xs, d: f"{statistics.median(xs):.{d}f} ({min(xs):.{d}f}-{max(xs):.{d}f})"  # noqa: E731
    lines = [f"{processor()}; {sum(SIZES)} int64 values a pack, {args.calls} packs a run, {args.runs} runs", "",
             "| cores | pack | mean us | median us | p99 us | max us | torch.cat / numpy (mean) |", "|---|---|---|---|---|---|---|"]
    for load in ("idle", "busy"):
        for side in ("torch.cat", "numpy"):
            columns = list(zip(*rows[(load, side)]))
            ratio = spread(rows[(load, "ratio")], 2) if side == "torch.cat" else ""
            lines.append(f"| {load} | {side} | " + " | ".join(spread(c, 1) for c in columns) + f" | {ratio} |")
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
