"""Serving benchmark: a bounded load generator against `moeplex serve` on loopback.

    python benchmarks/serving.py --model DIR                      # launches the server itself
    python benchmarks/serving.py --model DIR --url http://127.0.0.1:30000   # an already running server

It sends the mixed-length workload of benchmarks/workload.py (prompts of 32-256 tokens, 16-256 greedy
new tokens, eos ignored) as streaming /v1/completions requests, at each concurrency level in turn,
and prints a Markdown table: requests/s, output tokens/s, time to first token and inter-token
latency (p50, p99), the server's engine steps (ms per step, tokens per step: batching versus
per-step cost), and the ratio of served output tokens/s to the offline engine's on the same
requests (measured first, in this process, with the same engine flags). Every level is bounded: no
new request starts after --time-limit seconds, and whatever is still running --grace seconds later
is cancelled and counted as unfinished.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import attrs
import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import mixed_workload  # noqa: E402

ENGINE_FLAGS = ("max_running_requests", "max_batched_tokens", "chunked_prefill_size", "max_total_tokens", "dtype", "device")


@attrs.define
class Trace:
    """One request as the client saw it."""

    start: float
    first_token: float | None = None
    token_times: list[float] = attrs.Factory(list)  # arrival time of each token
    tokens: int = 0
    done: bool = False


async def one_request(http: aiohttp.ClientSession, url: str, prompt: list[int], new_tokens: int) -> Trace:
    body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    trace = Trace(time.perf_counter())
    async with http.post(f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for raw in response.content:  # one line at a time
            line = raw.decode().rstrip("\r\n")
            if line == "data: [DONE]":
                trace.done = True
            elif line.startswith("data: "):
                count = len(json.loads(line[6:])["choices"][0]["token_ids"])
                now = time.perf_counter()
                trace.token_times += [now] * count
                trace.tokens += count
    trace.first_token = trace.token_times[0] if trace.token_times else None
    return trace


def sample_stacks(pids: dict[str, int], seconds: float, folder: str) -> list[subprocess.Popen]:
    """py-spy (if installed) samples each process for `seconds`: FOLDER/NAME.txt, one collapsed stack a line."""
    os.makedirs(folder, exist_ok=True)
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    spy = shutil.which("py-spy") or (beside if os.path.exists(beside) else None)
    if spy is None:
        raise SystemExit("--py-spy needs py-spy (pip install py-spy) on PATH or beside this Python")
    return [subprocess.Popen([spy, "record", "--nonblocking", "--format", "raw", "--rate", "200",
                              "--duration", str(int(seconds)), "--pid", str(pid), "--output", f"{folder}/{name}.txt"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, pid in pids.items()]


async def run_level(url: str, work, concurrency: int, time_limit: float, grace: float, headers: dict,
                    profile: tuple[dict, float, str] | None = None):
    """(traces, seconds, engine steps) of one concurrency level; `profile`: (pids, seconds, folder) to sample.

    The client is aiohttp: it shares the machine with the server, and httpx's connection pool cost it
    several times more CPU per request at concurrency 64 (py-spy), which showed up as TTFT.
    """
    traces: list[Trace] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, headers=headers, timeout=aiohttp.ClientTimeout()) as http:
        pending = list(work)
        steps_before = await server_steps(http, url)
        samplers = sample_stacks(*profile) if profile else []
        start = time.perf_counter()

        async def worker() -> None:
            while pending and time.perf_counter() - start < time_limit:
                prompt, new_tokens = pending.pop(0)
                traces.append(await one_request(http, url, prompt, new_tokens))

        tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        _, unfinished = await asyncio.wait(tasks, timeout=time_limit + grace)
        for task in unfinished:
            task.cancel()
        elapsed = time.perf_counter() - start
        steps = await server_steps(http, url) - steps_before
    for sampler in samplers:
        sampler.wait()
    return traces, elapsed, steps


async def server_steps(http: aiohttp.ClientSession, url: str) -> int:
    async with http.get(f"{url}/get_server_info") as response:
        return (await response.json())["steps"]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summarize(traces: list[Trace], elapsed: float, steps: int) -> dict:
    done = [t for t in traces if t.done]
    ttft = [t.first_token - t.start for t in done if t.first_token is not None]
    itl = [b - a for t in done for a, b in zip(t.token_times, t.token_times[1:])]
    tokens = sum(t.tokens for t in traces)
    return {
        "requests": len(done),
        "req_per_s": len(done) / elapsed,
        "tok_per_s": sum(t.tokens for t in done) / elapsed,
        "ms_per_step": 1e3 * elapsed / max(steps, 1),
        "tok_per_step": tokens / max(steps, 1),
        "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
        "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99),
    }


def offline_throughput(args, work) -> dict:
    """Output tokens/s of the engine itself on the same requests, all submitted at once, and its steps."""
    from moeplex.config import EngineConfig
    from moeplex.engine import Engine
    from moeplex.ranks.group import EngineGroup
    from moeplex.sampling import SamplingParams
    from moeplex.ranks.warmup import warm_up

    settings = {name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name) is not None}
    engine = Engine(EngineConfig(model=args.model, show_progress=False, **settings))
    warm_up(EngineGroup(engine))  # as the server does before it serves: kernels of every step size compiled first
    for prompt, n in work:
        engine.add_request(prompt, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
    start, steps = time.perf_counter(), 0
    while engine.has_work:
        engine.step()
        steps += 1
    elapsed, tokens = time.perf_counter() - start, sum(n for _, n in work)
    return {"tok_per_s": tokens / elapsed, "ms_per_step": 1e3 * elapsed / steps, "tok_per_step": tokens / steps}


def launch_server(args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in ENGINE_FLAGS if getattr(args, name) is not None]
    command = [sys.executable, "-c", "import sys; from moeplex.cli import main; sys.exit(main())", "serve",
               "--model", args.model, "--port", str(port), "--log-level", "warning", *flags]
    server = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return server, url
        except httpx.TransportError:
            time.sleep(0.5)
    server.kill()
    raise SystemExit("moeplex serve did not come up within 120 s")


def server_pids(url: str, server: subprocess.Popen | None) -> dict[str, int]:
    """This load generator, the front end (when launched here) and every rank, as /get_server_info lists them."""
    ranks = httpx.get(f"{url}/get_server_info", timeout=10).json()["parallel"]["ranks"]
    front = {"frontend": server.pid} if server is not None else {}
    return {"client": os.getpid(), **front, **{f"rank{i}": rank["pid"] for i, rank in enumerate(ranks)}}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model folder (for the offline reference, and to launch the server)")
    parser.add_argument("--url", help="a running server; default: launch `moeplex serve` on a free loopback port")
    parser.add_argument("--api-key", help="the server's API key, if it has one")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-range", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--output-range", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--time-limit", type=float, default=120.0, help="seconds per level during which requests start")
    parser.add_argument("--grace", type=float, default=60.0, help="seconds after the limit before in-flight ones are cancelled")
    parser.add_argument("--skip-offline", action="store_true", help="no offline reference (no ratio column)")
    parser.add_argument("--py-spy", metavar="DIR",
                        help="during the last level, sample the server's processes with py-spy into DIR (collapsed stacks)")
    parser.add_argument("--py-spy-seconds", type=float, default=5.0, help="how long --py-spy samples")
    for name, default in (("max_running_requests", 64), ("max_batched_tokens", 4096), ("chunked_prefill_size", 1024)):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default, help="engine flag (server and offline)")
    parser.add_argument("--max-total-tokens", type=int, default=None, help="engine flag (server and offline)")
    parser.add_argument("--dtype", default=None, help="engine flag (server and offline)")
    parser.add_argument("--device", default=None, help="engine flag (server and offline)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    work = mixed_workload(args.num_requests, prompt_range=tuple(args.prompt_range), output_range=tuple(args.output_range))
    offline = None if args.skip_offline else offline_throughput(args, work)
    server, url = (None, args.url) if args.url else launch_server(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rows = []
    try:
        for concurrency in args.concurrency:
            profile = None
            if args.py_spy and concurrency == args.concurrency[-1]:
                profile = (server_pids(url, server), args.py_spy_seconds, args.py_spy)
            traces, elapsed, steps = asyncio.run(run_level(url, work, concurrency, args.time_limit, args.grace, headers,
                                                           profile))
            rows.append((concurrency, summarize(traces, elapsed, steps)))
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(60)
    print(f"\n{args.num_requests} requests, prompts {args.prompt_range[0]}-{args.prompt_range[1]} tokens, outputs "
          f"{args.output_range[0]}-{args.output_range[1]} greedy, device {args.device or 'cpu'}; offline engine: "
          + (f"{offline['tok_per_s']:.1f} output tok/s, {offline['ms_per_step']:.1f} ms/step, "
             f"{offline['tok_per_step']:.1f} tok/step\n" if offline else "not measured\n"))
    print("| concurrency | requests done | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
          "| ms/step | tok/step | served / offline |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for concurrency, s in rows:
        ratio = f"{s['tok_per_s'] / offline['tok_per_s']:.2f}" if offline else "-"
        print(f"| {concurrency} | {s['requests']}/{args.num_requests} | {s['req_per_s']:.2f} | {s['tok_per_s']:.1f} | "
              f"{1e3 * s['ttft_p50']:.1f} | {1e3 * s['ttft_p99']:.1f} | {1e3 * s['itl_p50']:.1f} | {1e3 * s['itl_p99']:.1f} | "
              f"{s['ms_per_step']:.1f} | {s['tok_per_step']:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
