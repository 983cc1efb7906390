"""The serving benchmarks' load generator: streaming /v1/completions requests from a fixed number of clients.

Used by benchmarks/serving.py and benchmarks/pd_serving.py. The client is aiohttp: it shares the machine
with the server, and httpx's connection pool cost it several times more CPU per request at concurrency 64
(py-spy), which showed up as TTFT.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time

import aiohttp
import attrs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(server: subprocess.Popen, url: str, seconds: float, what: str) -> None:
    """Until `url`/health answers 200; SystemExit (the server killed) if it has not within `seconds` or exited."""
    import httpx

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
    server.kill()
    raise SystemExit(f"{what} did not come up within {seconds:.0f} s")


@attrs.define
class Trace:
    """One request as the client saw it."""

    start: float
    wanted: int  # new tokens asked for (eos ignored: what a finished request must have received)
    first_token: float | None = None
    token_times: list[float] = attrs.Factory(list)  # arrival time of each token
    tokens: int = 0
    done: bool = False


async def one_request(http: aiohttp.ClientSession, url: str, prompt: list[int], new_tokens: int) -> Trace:
    """One streaming request. The events are read as the bytes arrive and their tokens counted without parsing the
    JSON (the key "token_ids" can only appear unescaped as a key): at concurrency 64 the load generator shares the
    machine with the server, and json.loads per event was most of its CPU."""
    body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    trace = Trace(time.perf_counter(), new_tokens)
    pending = b""
    async with http.post(f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for data in response.content.iter_any():
            now = time.perf_counter()
            *events, pending = (pending + data).split(b"\n\n")
            for event in events:
                if event == b"data: [DONE]":
                    trace.done = True
                    continue
                count = token_count(event)
                trace.token_times += [now] * count
                trace.tokens += count
    trace.first_token = trace.token_times[0] if trace.token_times else None
    return trace


def token_count(event: bytes) -> int:
    """Tokens in one `data: {...}` completion chunk; ValueError for anything else (an error event)."""
    at = event.find(KEY)
    if at < 0:
        if b'"choices":[]' in event:  # the usage chunk
            return 0
        raise ValueError(f"not a completion chunk: {event[:300]!r}")
    ids = event[at + len(KEY) : event.index(b"]", at)]
    return ids.count(b",") + 1 if ids else 0


KEY = b'"token_ids":['


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far, all its threads (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


@attrs.define
class Level:
    """One concurrency level as measured: the traces, its wall time, the server's engine steps, CPU seconds per process."""

    traces: list[Trace]
    elapsed: float
    steps: int
    cpu: dict[str, float]
    kinds: dict[str, tuple[int, float]] = attrs.Factory(dict)  # the server's steps by kind: (steps, host seconds)


async def run_level(url: str, work, concurrency: int, time_limit: float, grace: float, headers: dict,
                    pids: dict[str, int], profile: tuple[float, str] | None = None) -> Level:
    """Send `work` from `concurrency` clients; `pids`: the processes whose CPU time is counted (this one is "client");
    `profile`: (seconds, folder) to sample them with py-spy."""
    traces: list[Trace] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, headers=headers, timeout=aiohttp.ClientTimeout()) as http:
        pending = list(work)
        steps_before, kinds_before = await server_steps(http, url)
        samplers = sample_stacks(pids, *profile) if profile else []
        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        start = time.perf_counter()

        async def worker() -> None:
            while pending and time.perf_counter() - start < time_limit:
                prompt, new_tokens = pending.pop(0)
                traces.append(await one_request(http, url, prompt, new_tokens))

        tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        _, unfinished = await asyncio.wait(tasks, timeout=time_limit + grace)
        elapsed = time.perf_counter() - start
        cpu = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()}
        for task in unfinished:
            task.cancel()
        steps, kinds = await server_steps(http, url)
    for sampler in samplers:
        sampler.wait()
    return Level(traces, elapsed, steps - steps_before, cpu, kinds_since(kinds, kinds_before))


async def server_steps(http: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, tuple[int, float]]]:
    """The server's engine steps since start-up, and by kind: (steps, host seconds)."""
    async with http.get(f"{url}/get_server_info") as response:
        info = await response.json()
    kinds = {kind: (v["steps"], v["seconds"]) for kind, v in info.get("engine_steps", {}).items()}
    return info["steps"], kinds


def kinds_since(now: dict[str, tuple[int, float]], before: dict[str, tuple[int, float]]) -> dict[str, tuple[int, float]]:
    return {kind: (n - before.get(kind, (0, 0.0))[0], t - before.get(kind, (0, 0.0))[1]) for kind, (n, t) in now.items()}


def kinds_text(kinds: dict[str, tuple[int, float]]) -> str:
    """"decode 700 x 1.52 ms, mixed 40 x 2.10 ms": the kinds that ran, their steps and mean host ms a step."""
    return ", ".join(f"{kind} {n} x {1e3 * t / n:.2f} ms" for kind, (n, t) in kinds.items() if n) or "-"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summarize(level: Level) -> dict:
    done = [t for t in level.traces if t.done]
    ttft = [t.first_token - t.start for t in done if t.first_token is not None]
    itl = [b - a for t in done for a, b in zip(t.token_times, t.token_times[1:])]
    tokens = sum(t.tokens for t in level.traces)
    steps = max(level.steps, 1)
    return {
        "requests": len(done),
        "wrong_lengths": sum(t.tokens != t.wanted for t in done),  # the served work differs from the offline one
        "req_per_s": len(done) / level.elapsed,
        "tok_per_s": sum(t.tokens for t in done) / level.elapsed,
        "ms_per_step": 1e3 * level.elapsed / steps,
        "tok_per_step": tokens / steps,
        "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
        "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99),
        "cpu_ms_per_step": {name: 1e3 * seconds / steps for name, seconds in level.cpu.items()},
        "kinds": level.kinds,
    }
