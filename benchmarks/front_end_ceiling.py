"""The front end's ceiling: `moeplex serve`'s HTTP side against a stand-in engine that costs nothing but its pace.

    python benchmarks/front_end_ceiling.py --step-ms 2 --concurrency 64 --runs 3      # the H100's tiny step
    python benchmarks/front_end_ceiling.py --step-ms 2 --stream-interval 4

The front end (uvicorn, the tokenizer, the request mirrors, streaming; server/app.py) runs as `moeplex serve` runs
it, in a process of its own, but its leader is a stand-in: a process that answers the same rounds (messages.py) and
every --step-ms gives each running request one token, ending it at its max_tokens. Its steps take no CPU, so what
the clients lose against the stand-in's ideal is the front end's (and the load generator's) doing: the served
tokens per step against the requests the clients keep open (the workload of serving.py, fixed-length outputs), the
front end's CPU per streamed token, TTFT and ITL. It is what `serving.py` measures on a GPU, where a tiny model's
step is ~2 ms of host work, without a GPU, so a change to the front end is measured on any machine.

A request is admitted the round it arrives and gets its first token at the next step (a prompt costs the
stand-in nothing); at most --max-running requests run at once, the rest wait in arrival order.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from serving_load import free_port, run_level, summarize, wait_healthy  # noqa: E402
from workload import mixed_workload  # noqa: E402


def stand_in(connection, step_s: float, max_running: int, vocab_size: int) -> None:
    """The stand-in leader: rounds in, a step every `step_s` while requests run, a RoundReport per step out."""
    import pickle

    from moeplex.messages import Abort, Admit, GroupStats, Halted, LoopStats, RoundReport, Updates
    from moeplex.request import FinishReason

    rng = random.Random(0)
    running: dict[str, int] = {}  # rid -> tokens still to give
    waiting: list[tuple[str, int]] = []
    admitted = steps = 0
    seconds = 0.0
    next_step = time.monotonic()
    ends = (FinishReason.LENGTH, None, None)

    def admit() -> None:  # the waiting requests, in arrival order, into the free slots
        while waiting and len(running) < max_running:
            rid, wanted = waiting.pop(0)
            running[rid] = wanted

    while True:
        timeout = max(0.0, next_step - time.monotonic()) if running else None
        if connection.poll(timeout):
            message = connection.recv()
            for command in message.commands:
                if isinstance(command, Admit):
                    waiting.append((command.rid, command.params.max_new_tokens))
                    admitted += 1
                elif isinstance(command, Abort):
                    running.pop(command.rid, None)
                    waiting = [w for w in waiting if w[0] != command.rid]
            if message.halt:
                connection.send(Halted())
                return
            admit()
        if not running or time.monotonic() < next_step:
            continue
        next_step = max(next_step + step_s, time.monotonic())  # a late step does not bunch the next ones up
        rids = tuple(running)
        finished = {row: ends for row, rid in enumerate(rids) if running[rid] == 1}
        for rid in rids:
            running[rid] -= 1
            if running[rid] == 0:
                del running[rid]
        admit()
        steps += 1
        seconds += step_s
        updates = Updates(rids, tuple(rng.randrange(vocab_size) for _ in rids), ends=finished)
        group = GroupStats(num_running=len(running), num_queued=len(waiting), engine_steps=(("decode", steps, seconds),))
        report = RoundReport((updates,), (), (), LoopStats((group,), (admitted,), steps, 0))
        connection.send_bytes(pickle.dumps(report, pickle.HIGHEST_PROTOCOL))


def offline_steps(work: list[tuple[list[int], int]], max_running: int) -> int:
    """The stand-in's steps for `work` submitted all at once (what the offline engine would take): the ideal."""
    waiting = [n for _, n in work]
    running: list[int] = []
    steps = 0
    while waiting or running:
        while waiting and len(running) < max_running:
            running.append(waiting.pop(0))
        steps += 1
        running = [n - 1 for n in running if n > 1]
    return steps


def serve(args) -> None:
    """The front end of `moeplex serve`, led by the stand-in (run in the server process: --serve)."""
    from moeplex.config import EngineConfig
    from moeplex.messages import GroupStats, LoopStats
    from moeplex.ranks.leader import EngineFacts
    from moeplex.server.app import LeaderLink
    from moeplex.server.processes import HttpServer
    from moeplex.server.settings import ServerSettings

    with open(os.path.join(args.model, "config.json")) as f:
        hf_config = json.load(f)
    vocab = hf_config["vocab_size"]
    spawn = multiprocessing.get_context("spawn")
    here, there = spawn.Pipe()
    leader = spawn.Process(target=stand_in, args=(there, args.step_ms / 1e3, args.max_running, vocab), daemon=True)
    leader.start()
    config = EngineConfig(model=args.model, max_running_requests=args.max_running)
    stats = LoopStats((GroupStats(),), (0,), 0, 0)
    facts = EngineFacts(config, hf_config, vocab, 1 << 20, 1, 1, ({"rank": 0, "pid": leader.pid},), stats)
    settings = ServerSettings(port=args.port, stream_interval=args.stream_interval, warmup=False)
    HttpServer(LeaderLink(here, facts), settings, "warning").run()
    leader.join(5)


def launch(args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, os.path.abspath(__file__), "--serve", "--model", args.model, "--port", str(port),
               "--step-ms", str(args.step_ms), "--max-running", str(args.max_running),
               "--stream-interval", str(args.stream_interval)]
    server = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(server, url, 120, "the front end")
    return server, url


def processor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        name = "unknown"
    return f"{name}, {os.cpu_count()} cores"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-ms", type=float, default=2.0, help="the stand-in's step (default 2: a tiny model on a GPU)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64])
    parser.add_argument("--num-requests", type=int, default=512)
    parser.add_argument("--max-running", type=int, default=64, help="requests the stand-in runs at once (the rest wait)")
    parser.add_argument("--stream-interval", type=int, default=1)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", help="also write the table here")
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return
    from moeplex.models.make_model import write_checkpoint

    args.model = write_checkpoint(tempfile.mkdtemp(), "deepseek_v3", "tiny", seed=0, config_only=True)
    work = mixed_workload(args.num_requests)
    lines = [f"front end against a stand-in engine: step {args.step_ms:g} ms, --stream-interval {args.stream_interval}, "
             f"{args.num_requests} requests (prompts 32-256 token ids, outputs 16-256), {processor()}", "",
             "| run | concurrency | output tok/s | stand-in offline tok/s | served / offline | tok/step | TTFT p50 ms | "
             "TTFT p99 ms | ITL p50 ms | ITL p99 ms | front end CPU us/token | client CPU us/token |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    server, url = launch(args)
    ratios: dict[int, list[float]] = {c: [] for c in args.concurrency}
    per_token: dict[int, list[float]] = {c: [] for c in args.concurrency}
    try:
        pids = {"client": os.getpid(), "frontend": server.pid}
        for c in args.concurrency:  # warm: connections, the tokenizer, the first level's cold caches
            asyncio.run(run_level(url, work[: 2 * c], c, 60, 10, {}, pids))
        for run in range(args.runs):
            for c in args.concurrency:
                level = asyncio.run(run_level(url, work, c, 300, 30, {}, pids))
                s = summarize(level)
                tokens = sum(t.tokens for t in level.traces)
                # the stand-in's rate with every request submitted at once (the offline engine's): the ideal
                best = sum(n for _, n in work) / (offline_steps(work, min(c, args.max_running)) * args.step_ms / 1e3)
                ratio = s["tok_per_s"] / best
                front = 1e6 * level.cpu["frontend"] / max(tokens, 1)
                ratios[c].append(ratio)
                per_token[c].append(front)
                line = (f"| {run + 1} | {c} | {s['tok_per_s']:.0f} | {best:.0f} | {ratio:.2f} | {s['tok_per_step']:.1f} | "
                        f"{1e3 * s['ttft_p50']:.1f} | {1e3 * s['ttft_p99']:.1f} | {1e3 * s['itl_p50']:.1f} | "
                        f"{1e3 * s['itl_p99']:.1f} | {front:.1f} | {1e6 * level.cpu['client'] / max(tokens, 1):.1f} |")
                lines.append(line)
                print(line, flush=True)
    finally:
        server.terminate()
        server.wait(30)
    lines += ["", "median (min-max):", "", "| concurrency | served / offline | front end CPU us/token |", "|---|---|---|"]
    for c in args.concurrency:
        r, p = ratios[c], per_token[c]
        lines.append(f"| {c} | {statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f}) | "
                     f"{statistics.median(p):.1f} ({min(p):.1f}-{max(p):.1f}) |")
    print("\n".join(lines[-3 - len(args.concurrency):]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
