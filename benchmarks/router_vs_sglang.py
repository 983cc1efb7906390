"""`moeplex router` against SGLang's Rust router (PyPI `sglang-router`), both cache_aware, side by side.

    pip install sglang-router
    python benchmarks/router_vs_sglang.py                       # 3 rounds, concurrency 32, 64 slots per worker

The same fake workers (benchmarks/router.py: 20 ms per request, --slots each, so they never queue at
concurrency 32) and the same shared-prefix workload serve every run. Each round runs the client straight
against the workers (direct), then through a fresh `moeplex router` and a fresh SGLang router, the two
routers' order alternating from round to round so that the machine's load falls on both alike.

Reported per run and as the median (with min-max) over rounds: requests/s, the ratio ours/SGLang, the
latency added over direct, stickiness (per prefix group, the share of its requests on its most used
worker) and the router's CPU per answered request (user + system time of the router process, all its
threads, from /proc/<pid>/stat, warm-up included).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from router import (Run, cpu_seconds, free_port, percentile, run_level, start_router, start_workers,  # noqa: E402
                    stickiness, stop, _answers)

OURS, SGLANG = "moeplex", "sglang"


def start_sglang_router(workers: list[str], extra: list[str]) -> tuple[subprocess.Popen, str]:
    """SGLang's Rust router (the `sglang_router` wheel) in its own process, cache_aware, quiet."""
    port = free_port()
    command = [sys.executable, "-m", "sglang_router.launch_router", "--policy", "cache_aware", "--host", "127.0.0.1",
               "--port", str(port), "--log-level", "warn", "--prometheus-port", str(free_port()),
               "--worker-urls", *workers, *extra]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while not _answers(f"{url}/health"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the SGLang router did not come up: {' '.join(command)}")
        time.sleep(0.2)
    return proc, url


def measured(start, items, concurrency, time_limit, grace, profile: str | None = None) -> Run:
    """One run through a fresh router; with `profile`, py-spy records the router meanwhile (raw stacks)."""
    proc, url = start()
    spy = None
    if profile:
        spy = subprocess.Popen(["py-spy", "record", "--pid", str(proc.pid), "-o", profile, "-f", "raw", "-r", "200",
                                "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1)  # attached before the load starts
    try:
        before = cpu_seconds(proc.pid)
        run = asyncio.run(run_level([url], items, concurrency, time_limit, grace))
        after = cpu_seconds(proc.pid)
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file and exits
            spy.wait(30)
        if before is not None and after is not None:
            run.router_cpu = after - before
    finally:
        stop(proc)
    return run


def rate(run: Run) -> float:
    return len(run.served) / run.seconds


def line(round_: int, name: str, run: Run, direct: Run) -> str:
    p50, p99 = (percentile(run.latencies, q) * 1e3 for q in (0.5, 0.99))
    added = (percentile(run.latencies, 0.5) - percentile(direct.latencies, 0.5)) * 1e3
    mean, worst = stickiness(run.served)
    cpu = "–" if run.router_cpu is None else f"{run.router_cpu * 1e3 / max(len(run.served), 1):.3f}"
    added_text = "–" if run is direct else f"{added:+.2f}"
    return (f"| {round_} | {name} | {rate(run):.1f} | {rate(run) / rate(direct):.3f} | {p50:.2f} | {p99:.2f} | "
            f"{added_text} | {cpu} | {mean:.4f} | {worst:.3f} | {run.failed} | {run.unfinished} |")


HEADER = ("| round | route | requests/s | vs direct | p50 ms | p99 ms | adds p50 ms | router CPU ms/request | "
          "stickiness mean | stickiness worst group | failed | unfinished |\n"
          "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def spread(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def print_hot_frames(path: str, count: int = 15) -> None:
    """The frames py-spy sampled most, by their own samples (leaf) and with their callees (inclusive)."""
    own, inclusive, total = Counter(), Counter(), 0
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            frames, n = stack.split(";"), int(n)
            total += n
            own[frames[-1]] += n
            for frame in set(frames):
                inclusive[frame] += n
    for title, counts in (("own samples", own), ("inclusive", inclusive)):
        print(f"\n`moeplex router`, py-spy, {title} ({total} samples):\n")
        for frame, n in counts.most_common(count):
            print(f"- {100 * n / total:4.1f}% {frame}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds of direct + both routers (default: 3)")
    p.add_argument("--workers", type=int, default=4, help="fake workers (default: 4)")
    p.add_argument("--delay-ms", type=float, default=20.0, help="service time of each request (default: 20)")
    p.add_argument("--slots", type=int, default=64, help="requests each worker serves at once (default: 64, never queueing)")
    p.add_argument("--requests", type=int, default=4000, help="requests per run (default: 4000)")
    p.add_argument("--groups", type=int, default=50, help="prefix groups (default: 50)")
    p.add_argument("--prefix-chars", type=int, default=400, help="length of each group's shared prefix (default: 400)")
    p.add_argument("--suffix-chars", type=int, default=100, help="length of each request's own suffix (default: 100)")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight (default: 32)")
    p.add_argument("--time-limit", type=float, default=60.0, help="no request starts after this many seconds of a run")
    p.add_argument("--grace", type=float, default=30.0, help="a run is cancelled this long after its time limit")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload (default: 0)")
    p.add_argument("--ours-only", action="store_true", help="skip SGLang's router (also when it is not installed)")
    p.add_argument("--py-spy", metavar="FILE", help="record `moeplex router` with py-spy during round 1 into FILE "
                   "(raw collapsed stacks; `pip install py-spy`) and print its hottest frames")
    p.add_argument("--router-args", nargs="*", default=[], help="further flags for `moeplex router`")
    args = p.parse_args()
    from router import workload

    with_sglang = not args.ours_only
    if with_sglang and importlib.util.find_spec("sglang_router") is None:
        sys.exit("sglang_router is not installed: `pip install sglang-router`, or pass --ours-only")
    items = workload(args.requests, args.groups, args.prefix_chars, args.suffix_chars, args.seed)
    workers_proc, workers = start_workers(args.workers, args.delay_ms, args.slots)
    starters = {OURS: lambda: start_router("cache_aware", workers, args.router_args)}
    if with_sglang:
        starters[SGLANG] = lambda: start_sglang_router(workers, [])
    results: dict[str, list[Run]] = {name: [] for name in ("direct", *starters)}
    lines = []
    try:
        for r in range(args.rounds):
            direct = asyncio.run(run_level(workers, items, args.concurrency, args.time_limit, args.grace))
            results["direct"].append(direct)
            lines.append(line(r + 1, "direct", direct, direct))
            print(lines[-1], file=sys.stderr, flush=True)
            order = list(starters) if r % 2 == 0 else list(reversed(starters))
            for name in order:
                profile = args.py_spy if name == OURS and r == 0 else None
                run = measured(starters[name], items, args.concurrency, args.time_limit, args.grace, profile)
                results[name].append(run)
                lines.append(line(r + 1, name, run, direct))
                print(lines[-1], file=sys.stderr, flush=True)
    finally:
        stop(workers_proc)
    limit = args.workers * args.slots / (args.delay_ms / 1000)
    print(f"{args.workers} fake workers, {args.delay_ms:g} ms per request, {args.slots} slots each (limit "
          f"{limit:.0f} requests/s); concurrency {args.concurrency}; {args.requests} /v1/completions requests in "
          f"{args.groups} prefix groups ({args.prefix_chars}-character prefix + {args.suffix_chars}-character suffix)\n")
    print(HEADER)
    print("\n".join(lines))
    print("\n| route | requests/s median (min-max) | router CPU ms/request median (min-max) | stickiness mean, worst run |")
    print("|---|---:|---:|---:|")
    for name, runs in results.items():
        cpu = [run.router_cpu * 1e3 / max(len(run.served), 1) for run in runs if run.router_cpu is not None]
        sticky = min(stickiness(run.served)[0] for run in runs)
        print(f"| {name} | {spread([rate(run) for run in runs], '.1f')} | "
              f"{spread(cpu, '.3f') if cpu else '–'} | {sticky:.4f} |")
    if args.py_spy:
        print_hot_frames(args.py_spy)
    if with_sglang:
        ratios = [rate(o) / rate(s) for o, s in zip(results[OURS], results[SGLANG])]
        print(f"\nours / SGLang requests/s, per round: {', '.join(f'{x:.3f}' for x in ratios)}; "
              f"median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
