"""PD serving benchmark: time to first token and inter-token latency, co-located vs prefill/decode disaggregated,
at a fixed request rate (Poisson arrivals), with long prompts arriving while short-prompt requests decode.

    .venv/bin/python benchmarks/pd_serving.py --runs 3                         # CPU: tiny DeepSeek-V3, zmq
    .venv/bin/python benchmarks/pd_serving.py --device cuda --model DIR --load-format dummy --serve-flag=--dtype \
        --serve-flag=bf16 --kv-memory-fraction 0.3 --backend cuda-ipc --rate 4 --long-prompt 8192 --chunk 8192 \
        --decode-tokens 256 --runs 3                                             # one H200: P and D on one GPU

Setups (both started once, then --runs measured runs of each, alternating, the prefix cache flushed before each):
- co-located: one `moeplex serve`;
- PD: `serve --disaggregation-mode prefill`, `serve --disaggregation-mode decode` and `moeplex router --pd`, every
  one its own process (on one GPU, P and D share it: each takes --kv-memory-fraction of what it finds free).

Workload: decode requests (short prompt, --decode-tokens new tokens) and long-prompt requests (--long-prompt
tokens, --long-tokens new tokens), one in --long-every, arriving at --rate per second for --duration seconds.
The table: TTFT p50/p99 of each class and the decode requests' ITL p50/p99 (the number PD exists for: a long
prompt never stalls the decoding batch), median of the runs with min-max, and PD / co-located.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import aiohttp
import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving_load import one_request, percentile  # noqa: E402

MAIN = [sys.executable, "-c", "import sys; from moeplex.cli import main; sys.exit(main())"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Fleet:
    """The processes of one setup; `url` is where clients send requests."""

    def __init__(self, args, pd: bool):
        self.args, self.pd = args, pd
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []

    def serve(self, *flags: str) -> str:
        port = free_port()
        a = self.args
        engine = ["--model", a.model, "--device", a.device, "--port", str(port), "--log-level", "warning",
                  "--dist-init-addr", f"127.0.0.1:{free_port()}", "--chunked-prefill-size", str(a.chunk),
                  "--max-running-requests", str(a.max_running)]
        engine += ["--load-format", a.load_format] + (["--max-total-tokens", str(a.max_total_tokens)] if a.max_total_tokens else [])
        engine += ["--kv-memory-fraction", str(a.kv_memory_fraction)] if a.kv_memory_fraction else []
        engine += a.serve_flag
        self.procs.append(subprocess.Popen([*MAIN, "serve", *engine, *flags]))
        return f"http://127.0.0.1:{port}"

    def __enter__(self):
        if not self.pd:
            self.url = self.serve()
            self.urls = [self.url]
        else:
            boot = free_port()
            backend = ["--disaggregation-transfer-backend", self.args.backend]
            p = self.serve("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot), *backend)
            wait_health(p, self.procs)  # on one GPU, D sizes its KV cache from what P left free
            d = self.serve("--disaggregation-mode", "decode", *backend)
            self.urls = [p, d]
            port = free_port()
            self.procs.append(subprocess.Popen([*MAIN, "router", "--pd", "--port", str(port), "--log-level", "warning",
                                                "--prefill", f"{p},{boot}", "--decode", d]))
            self.url = f"http://127.0.0.1:{port}"
        for url in self.urls + [self.url]:
            wait_health(url, self.procs)
        return self

    def flush(self) -> None:
        for url in self.urls:
            httpx.post(f"{url}/flush_cache", timeout=30)

    def __exit__(self, *exc):
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def wait_health(url: str, procs, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise SystemExit(f"a process of the setup exited before {url} came up")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not come up within {timeout:.0f} s")


def workload(args, seed: int) -> list[tuple[float, str, list[int], int]]:
    """(arrival second, class, prompt, new tokens): Poisson arrivals at --rate for --duration seconds."""
    rng = random.Random(seed)
    at, work, i = 0.0, [], 0
    while True:
        at += rng.expovariate(args.rate)
        if at > args.duration:
            return work
        long = i % args.long_every == args.long_every - 1
        length = args.long_prompt if long else rng.randint(16, 64)
        prompt = [256] + [rng.randrange(256) for _ in range(length - 1)]
        work.append((at, "long" if long else "decode", prompt, args.long_tokens if long else args.decode_tokens))
        i += 1


async def run_once(url: str, work) -> dict:
    """Send the workload on its schedule; per class, TTFT and ITL lists in seconds."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout()) as http:
        start = time.perf_counter()

        async def at(when, kind, prompt, new_tokens):
            await asyncio.sleep(max(0.0, start + when - time.perf_counter()))
            return kind, await one_request(http, url, prompt, new_tokens)

        done = await asyncio.gather(*(at(*w) for w in work))
    out: dict = {"decode": {"ttft": [], "itl": []}, "long": {"ttft": [], "itl": []}}
    for kind, trace in done:
        if not trace.done or trace.first_token is None:
            raise SystemExit("a request did not finish: the setup is broken or overloaded")
        out[kind]["ttft"].append(trace.first_token - trace.start)
        out[kind]["itl"] += [b - a for a, b in zip(trace.token_times, trace.token_times[1:])]
    return out


def measure(args) -> tuple[list[dict], list[dict]]:
    """--runs runs of each setup, co-located and PD alternating (a shared machine's load changes under both alike);
    each run a row of the table's numbers (seconds)."""
    rows: tuple[list[dict], list[dict]] = ([], [])
    with Fleet(args, pd=False) as co, Fleet(args, pd=True) as pd:
        for fleet in (co, pd):
            asyncio.run(run_once(fleet.url, workload(args, seed=99)[:4]))  # warm-up
        for run in range(args.runs):
            for fleet, out in zip((co, pd), rows):
                fleet.flush()
                out.append(row(asyncio.run(run_once(fleet.url, workload(args, seed=run)))))
    return rows


def row(got: dict) -> dict:
    return {
        "TTFT decode p50": percentile(got["decode"]["ttft"], 50), "TTFT decode p99": percentile(got["decode"]["ttft"], 99),
        "TTFT long p50": percentile(got["long"]["ttft"], 50), "TTFT long p99": percentile(got["long"]["ttft"], 99),
        "ITL decode p50": percentile(got["decode"]["itl"], 50), "ITL decode p99": percentile(got["decode"]["itl"], 99),
    }


def table(co: list[dict], pd: list[dict]) -> str:
    lines = ["| metric (ms) | co-located median (min-max) | PD median (min-max) | PD / co-located |", "|---|---|---|---|"]
    for key in co[0]:
        a, b = [1e3 * r[key] for r in co], [1e3 * r[key] for r in pd]
        ma, mb = statistics.median(a), statistics.median(b)
        lines.append(f"| {key} | {ma:.1f} ({min(a):.1f}-{max(a):.1f}) | {mb:.1f} ({min(b):.1f}-{max(b):.1f}) | {mb / ma:.2f} |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint folder (default: a tiny random DeepSeek-V3 written here)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    p.add_argument("--backend", default="zmq", help="kv_transfer backend of the PD setup (default: zmq)")
    p.add_argument("--rate", type=float, default=1.5, help="requests per second (default: 1.5)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per run (default: 20)")
    p.add_argument("--long-every", type=int, default=4, help="one request in N has a long prompt (default: 4)")
    p.add_argument("--long-prompt", type=int, default=384, help="tokens of a long prompt (default: 384)")
    p.add_argument("--long-tokens", type=int, default=4, help="new tokens of a long-prompt request (default: 4)")
    p.add_argument("--decode-tokens", type=int, default=32, help="new tokens of a decode request (default: 32)")
    p.add_argument("--chunk", type=int, default=128, help="--chunked-prefill-size of every server (default: 128)")
    p.add_argument("--max-running", type=int, default=64, help="--max-running-requests (default: 64)")
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV cache size of each server")
    p.add_argument("--kv-memory-fraction", type=float, default=None, help="each server's share of free memory for KV")
    p.add_argument("--serve-flag", action="append", default=[], metavar="FLAG",
                   help="a further `moeplex serve` flag for every server, repeated per word, e.g. --serve-flag=--dtype "
                   "--serve-flag=bf16")
    p.add_argument("--runs", type=int, default=3)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.model is None:
        from moeplex.models.make_model import write_checkpoint

        args.model = write_checkpoint(tempfile.mkdtemp(), "deepseek_v3", "tiny", seed=0)
        args.max_total_tokens = args.max_total_tokens or 16384
    co, pd = measure(args)
    print(f"rate {args.rate}/s for {args.duration:g} s, one in {args.long_every} a {args.long_prompt}-token prompt; "
          f"device {args.device}, PD backend {args.backend}, {args.runs} runs")
    print(table(co, pd))


if __name__ == "__main__":
    main()
