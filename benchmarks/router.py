"""Router benchmark: `moeplex router` in front of 4 fake workers on loopback, cache_aware versus round_robin.

    python benchmarks/router.py                                  # 2000 requests per run, concurrency 1, 32, 64

The fake workers (python -m moeplex.router.fake_worker) hold each request for a fixed service time
(20 ms), one request at a time by default (--slots), so 4 workers serve at most 200 requests/s. The
workload is --requests /v1/completions requests in --groups prefix groups: every request of a group
starts with the group's prompt prefix and ends with a suffix of its own, in a seeded random order. Each
concurrency level runs first straight against the workers (the client spreads requests round
robin: the workers' own limit, with no router in the way), then through a fresh router per policy.

Reported per run: requests/s and its ratio to the direct run; the latency the router adds (client
latency through the router minus the direct run's, at p50 and p99); stickiness (per prefix group,
the fraction of its requests on the worker that served most of them; the mean over groups and the
worst group); and the requests each worker served. Every run is bounded: no request starts after
--time-limit seconds, and the run is cancelled --grace seconds later, its unfinished requests
counted as failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import Counter, defaultdict

import aiohttp
import attrs

POLICIES = ("cache_aware", "round_robin")


@attrs.define
class Run:
    seconds: float = 0.0
    latencies: list[float] = attrs.Factory(list)
    served: list[tuple[int, str]] = attrs.Factory(list)  # (prefix group, worker) of each answered request
    failed: int = 0  # answered with an error, or no answer
    unfinished: int = 0  # not sent, or cut, when the run's time was up
    router_cpu: float | None = None  # seconds of CPU the router process spent on the run


def workload(requests: int, groups: int, prefix_chars: int, suffix_chars: int, seed: int) -> list[tuple[int, str]]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz "
    prefixes = ["".join(rng.choices(letters, k=prefix_chars)) for _ in range(groups)]
    order = [rng.randrange(groups) for _ in range(requests)]
    return [(g, prefixes[g] + "".join(rng.choices(letters, k=suffix_chars))) for g in order]


async def run_level(urls: list[str], items: list[tuple[int, str]], concurrency: int, time_limit: float, grace: float) -> Run:
    """Send `items` with `concurrency` requests in flight, spreading them over `urls` in turn."""
    run = Run()
    queue = list(reversed(list(enumerate(items))))
    # aiohttp: the client shares the machine with the router and workers, and costs a fifth of httpx's CPU
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as http:
        await _warm_up(http, urls, concurrency)
        start = time.perf_counter()

        async def sender() -> None:
            while queue and time.perf_counter() - start < time_limit:
                i, (group, text) = queue.pop()
                await _one(http, urls[i % len(urls)], group, text, run)

        tasks = [asyncio.ensure_future(sender()) for _ in range(concurrency)]
        done, pending = await asyncio.wait(tasks, timeout=time_limit + grace)
        for task in pending:
            task.cancel()
        run.seconds = time.perf_counter() - start
    run.unfinished = len(items) - len(run.served) - run.failed
    return run


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process, where /proc tells (Linux); None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _one(http: aiohttp.ClientSession, url: str, group: int, text: str, run: Run) -> None:
    began = time.perf_counter()
    try:
        async with http.post(f"{url}/v1/completions", json={"model": "fake", "prompt": text, "max_tokens": 8}) as response:
            if response.status != 200:
                run.failed += 1
                return
            answer = await response.json()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        run.failed += 1
        return
    run.latencies.append(time.perf_counter() - began)
    run.served.append((group, answer["worker"]))


async def _warm_up(http: aiohttp.ClientSession, urls: list[str], concurrency: int) -> None:
    """Open the connections of both hops with texts that share nothing with the workload."""
    bodies = [{"model": "fake", "prompt": f"warm-up {i} " + "#" * 40, "max_tokens": 1} for i in range(2 * concurrency)]

    async def post(url: str, body: dict) -> None:
        async with http.post(f"{url}/v1/completions", json=body) as response:
            await response.read()

    for start in range(0, len(bodies), concurrency):
        await asyncio.gather(*(post(urls[i % len(urls)], b) for i, b in enumerate(bodies[start:start + concurrency])))


def stickiness(served: list[tuple[int, str]]) -> tuple[float, float]:
    """Per prefix group, the share of its requests on its most used worker: mean over groups, worst group."""
    by_group: dict[int, Counter] = defaultdict(Counter)
    for group, worker in served:
        by_group[group][worker] += 1
    shares = [c.most_common(1)[0][1] / sum(c.values()) for c in by_group.values()]
    return statistics.fmean(shares), min(shares)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --- processes -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_workers(count: int, delay_ms: float, slots: int) -> tuple[subprocess.Popen, list[str]]:
    command = [sys.executable, "-m", "moeplex.router.fake_worker", "--count", str(count), "--delay-ms", str(delay_ms),
               "--slots", str(slots)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    ports = json.loads(proc.stdout.readline())["ports"]
    return proc, [f"http://127.0.0.1:{p}" for p in ports]


def start_router(policy: str, workers: list[str], extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "moeplex.cli", "router", "--policy", policy, "--port", str(port), "--log-level",
               "warning", "--worker-urls", *workers, *extra]
    proc = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while not _answers(f"{url}/health"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the router did not come up: {' '.join(command)}")
        time.sleep(0.1)
    return proc, url


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# --- report --------------------------------------------------------------------------------------


def row(policy: str, concurrency: int, run: Run, direct: Run, workers: list[str]) -> str:
    rate, base_rate = len(run.served) / run.seconds, len(direct.served) / direct.seconds
    if policy == "direct":
        added = "–", "–"
    else:
        added = tuple(f"{(percentile(run.latencies, q) - percentile(direct.latencies, q)) * 1e3:+.2f}" for q in (0.5, 0.99))
    p50, p99 = (percentile(run.latencies, q) * 1e3 for q in (0.5, 0.99))
    mean, worst = stickiness(run.served)
    per_worker = Counter(w for _, w in run.served)
    counts = " / ".join(str(per_worker[u.removeprefix("http://")]) for u in workers)
    cpu = "–" if run.router_cpu is None else f"{run.router_cpu * 1e3 / max(len(run.served), 1):.2f}"
    return (f"| {concurrency} | {policy} | {rate:.1f} | {rate / base_rate:.3f} | {p50:.2f} | {p99:.2f} | {added[0]} | "
            f"{added[1]} | {cpu} | {mean:.4f} | {worst:.3f} | {counts} | {run.failed} | {run.unfinished} |")


HEADER = ("| concurrency | route | requests/s | vs direct | p50 ms | p99 ms | router adds p50 ms | router adds p99 ms | "
          "router CPU ms/request | stickiness mean | stickiness worst group | requests per worker | failed | unfinished |\n"
          "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4, help="fake workers (default: 4)")
    p.add_argument("--delay-ms", type=float, default=20.0, help="service time of each request at a worker (default: 20)")
    p.add_argument("--slots", type=int, default=1, help="requests each worker serves at once (default: 1)")
    p.add_argument("--requests", type=int, default=2000, help="requests per run (default: 2000)")
    p.add_argument("--groups", type=int, default=50, help="prefix groups (default: 50)")
    p.add_argument("--prefix-chars", type=int, default=400, help="length of each group's shared prefix (default: 400)")
    p.add_argument("--suffix-chars", type=int, default=100, help="length of each request's own suffix (default: 100)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 64], help="levels (default: 1 32 64)")
    p.add_argument("--time-limit", type=float, default=90.0, help="no request starts after this many seconds of a run")
    p.add_argument("--grace", type=float, default=30.0, help="a run is cancelled this long after its time limit")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload (default: 0)")
    p.add_argument("--router-args", nargs=argparse.REMAINDER, default=[], help="further flags for `moeplex router`")
    args = p.parse_args()
    items = workload(args.requests, args.groups, args.prefix_chars, args.suffix_chars, args.seed)
    workers_proc, workers = start_workers(args.workers, args.delay_ms, args.slots)
    lines = []
    try:
        for concurrency in args.concurrency:
            direct = asyncio.run(run_level(workers, items, concurrency, args.time_limit, args.grace))
            lines.append(row("direct", concurrency, direct, direct, workers))
            print(lines[-1], file=sys.stderr, flush=True)
            for policy in POLICIES:
                router_proc, url = start_router(policy, workers, args.router_args)
                try:
                    cpu_before = cpu_seconds(router_proc.pid)
                    run = asyncio.run(run_level([url], items, concurrency, args.time_limit, args.grace))
                    cpu_after = cpu_seconds(router_proc.pid)
                    if cpu_before is not None and cpu_after is not None:
                        run.router_cpu = cpu_after - cpu_before
                finally:
                    stop(router_proc)
                lines.append(row(policy, concurrency, run, direct, workers))
                print(lines[-1], file=sys.stderr, flush=True)
    finally:
        stop(workers_proc)
    limit = args.workers * args.slots / (args.delay_ms / 1000)
    print(f"{args.workers} fake workers, {args.delay_ms:g} ms per request, {args.slots} slots each (limit "
          f"{limit:.0f} requests/s); {args.requests} /v1/completions requests in {args.groups} prefix groups "
          f"({args.prefix_chars}-character prefix + {args.suffix_chars}-character suffix)\n")
    print(HEADER)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
