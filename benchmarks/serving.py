"""Serving benchmark: served against offline throughput, a bounded load against `moeplex serve` on loopback.

    python benchmarks/serving.py --concurrency 64 --num-requests 128 --runs 3      # CPU: tiny DeepSeek-V3
    python benchmarks/serving.py --model DIR --url http://127.0.0.1:30000           # an already running server
    python benchmarks/serving.py --device cuda --arch qwen3_moe --preset 30b-a3b --layers 4 --load-format dummy \
        --dtype bf16 --moe-kernel triton --max-total-tokens 65536 --concurrency 64 --runs 3   # one GPU

It sends the mixed-length workload of benchmarks/workload.py (prompts of 32-256 tokens, 16-256 greedy new tokens,
eos ignored) as streaming /v1/completions requests from a fixed number of clients, at each concurrency level in
turn, and the same requests, all submitted at once, to `Engine.generate` (what `moeplex generate` runs) in a process
of its own, as the server's rank 0 is, with the same engine flags (the offline reference, offline_reference.py).
Both are warmed up alike first: the server's GPU warm-up (ranks/warmup.py), then the first requests of the workload
with a few new tokens each. Each of --runs runs measures the offline engine and every
level, in alternating order (a shared machine's load changes under both alike), with the prefix cache flushed
before each. Printed: a row per run and level (requests/s, output tokens/s, TTFT and ITL p50/p99, the server's
engine steps: ms and tokens per step, CPU ms per step of the client, the front end and rank 0), then the median
and min-max over the runs of served tok/s, offline tok/s, served / offline, and served / offline by CPU time: the
offline engine's CPU per output token over rank 0's (what the ratio would be with rank 0 on a core of its own and
the front end and the load generator on others; on a machine shared with other work, the wall clock mostly
measures the neighbours). --control times a second offline process beside the first in every run (their order
alternating too): the ratio of two identical engines is what the machine's noise alone does to a ratio (H100
guests, session 26: one engine's host work ran 1.1-1.6x slower for minutes at a time).

Every level is bounded: no new request starts after --time-limit seconds, and whatever is still running --grace
seconds later is cancelled and counted as unfinished. --profile DIR runs the server under benchmarks/profiled_serve.py
(its front end's event loop sampled, rank 0 under cProfile) and writes the top functions to DIR; the profilers slow
the server, so that run's ratios are not the measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from offline_reference import OfflineReference  # noqa: E402
from serving_load import free_port, kinds_text, run_level, summarize, wait_healthy  # noqa: E402
from workload import mixed_workload  # noqa: E402

ENGINE_FLAGS = ("max_running_requests", "max_batched_tokens", "chunked_prefill_size", "max_total_tokens", "dtype", "device",
                "load_format", "moe_kernel", "attention_backend", "kv_memory_fraction")
WARM_TOKENS = 8  # new tokens of each warm-up request


def engine_settings(args) -> dict:
    return {name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name) is not None}


def launch_server(args, extra: list[str] = ()) -> tuple[subprocess.Popen, str]:
    """`moeplex serve` with the engine flags of `args` (and `extra` flags) on a free loopback port; (process, url)."""
    port = free_port()
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in engine_settings(args).items()]
    main = [os.path.join(HERE, "profiled_serve.py"), args.profile] if args.profile else \
        ["-c", "import sys; from moeplex.cli import main; sys.exit(main())"]
    command = [sys.executable, *main, "serve", "--model", args.model, "--port", str(port), "--log-level", "warning", *flags, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)} if args.threads else None
    server = subprocess.Popen(command, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(server, url, 600, "moeplex serve")
    return server, url


def server_pids(url: str, server: subprocess.Popen | None) -> dict[str, int]:
    """This load generator and, when the server was launched here, its front end and rank 0 (/get_server_info)."""
    if server is None:  # maybe on another machine: its processes' CPU time is not ours to read
        return {"client": os.getpid()}
    ranks = httpx.get(f"{url}/get_server_info", timeout=10).json()["parallel"]["ranks"]
    return {"client": os.getpid(), "frontend": server.pid, "rank0": ranks[0]["pid"]}


def pin(pid: int, cores: set[int]) -> None:
    """Every thread of a process onto `cores` (Linux: an affinity is per thread)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cores)


class Pinning:
    """--pin-rank CORE: rank 0 and the offline engine on CORE, the front end and the load generator on the others, so
    the served/offline ratio compares one core's engine with one core's engine (as on a machine with cores to spare)."""

    def __init__(self, core: int | None, pids: dict[str, int], offline_pid: int | None):
        self.core, self.pids, self.offline_pid = core, pids, offline_pid
        self.others = set(range(os.cpu_count() or 1)) - {core} if core is not None else set()
        if core is not None and not self.others:
            raise SystemExit("--pin-rank needs a machine with more than one core")
        if core is not None and "rank0" not in pids:
            raise SystemExit("--pin-rank needs the server launched here (not --url)")

    def served(self) -> None:
        if self.core is not None:
            pin(self.pids["rank0"], {self.core})
            for name in ("frontend", "client"):
                pin(self.pids[name], self.others)

    def offline(self) -> None:
        if self.core is not None and self.offline_pid is not None:
            pin(self.offline_pid, {self.core})


def flush(url: str) -> None:
    for _ in range(50):  # 409 while the last level's cancelled requests are still being dropped
        if httpx.post(f"{url}/flush_cache", timeout=30).status_code == 200:
            return
        time.sleep(0.1)
    raise SystemExit(f"{url}/flush_cache kept refusing")


class Report:
    """Lines printed as they come, and written to --out at the end."""

    def __init__(self, out: str | None):
        self.out, self.lines = out, []

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.lines.append(text)

    def close(self) -> None:
        if self.out:
            with open(self.out, "w") as f:
                f.write("\n".join(self.lines).strip("\n") + "\n")


def measure(args, work, offline: OfflineReference | None, url: str, pids: dict, headers: dict, report: Report,
            control: OfflineReference | None = None) -> list[dict]:
    """--runs runs, each the offline reference and every level (served first in odd runs); a row per run and level.
    With a `control` (a second offline process, --control) each run times it beside the first, in turns."""
    rows = []
    pinning = Pinning(args.pin_rank, pids, offline.pid if offline is not None else None)
    for run in range(args.runs):
        reference = second = None
        steps = ["offline", *args.concurrency] if run % 2 == 0 else [*args.concurrency, "offline"]
        served = []
        for what in steps:
            if what == "offline":
                pinning.offline()
                if control is not None and run % 2:
                    second = control.run(work)
                reference = offline.run(work) if offline is not None else None
                if control is not None and not run % 2:
                    second = control.run(work)
                continue
            pinning.served()
            flush(url)
            profile = (args.py_spy_seconds, args.py_spy) if args.py_spy and run == args.runs - 1 and what == steps[-1] else None
            level = asyncio.run(run_level(url, work, what, args.time_limit, args.grace, headers, pids, profile))
            served.append((what, summarize(level)))
        for concurrency, s in served:
            rows.append({"run": run + 1, "concurrency": concurrency, "served": s, "offline": reference,
                         "control": second})
            report.say(row(rows[-1], args.num_requests))
    return rows


HEADER = ("| run | concurrency | requests done | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
          "| ms/step | tok/step | CPU ms/step client / front end / rank 0 | offline tok/s | offline ms/step, tok/step, CPU ms/step "
          "| served / offline |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def row(r: dict, num_requests: int) -> str:
    s, o = r["served"], r["offline"]
    cpu = " / ".join(f"{s['cpu_ms_per_step'].get(name, float('nan')):.1f}" for name in ("client", "frontend", "rank0"))
    offline = (f"{o['tok_per_s']:.1f} | {o['ms_per_step']:.1f}, {o['tok_per_step']:.1f}, {o['cpu_ms_per_step']:.1f} | "
               f"{s['tok_per_s'] / o['tok_per_s']:.2f}") if o else "- | - | -"
    return (f"| {r['run']} | {r['concurrency']} | {s['requests']}/{num_requests} | {s['req_per_s']:.2f} | {s['tok_per_s']:.1f} | "
            f"{1e3 * s['ttft_p50']:.1f} | {1e3 * s['ttft_p99']:.1f} | {1e3 * s['itl_p50']:.1f} | {1e3 * s['itl_p99']:.1f} | "
            f"{s['ms_per_step']:.1f} | {s['tok_per_step']:.1f} | {cpu} | {offline} |")


def spread(values: list[float], digits: int) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def cpu_ratio(r: dict) -> float | None:
    """Offline CPU per output token over rank 0's served: served/offline if rank 0 had a core of its own, and the
    front end and the load generator theirs (what a shared machine's wall clock cannot show; batching included)."""
    s, o = r["served"], r["offline"]
    rank = s["cpu_ms_per_step"].get("rank0")
    if not o or not rank:
        return None
    return (o["cpu_ms_per_step"] / o["tok_per_step"]) / (rank / s["tok_per_step"])


def summary(rows: list[dict], concurrency: list[int]) -> str:
    lines = ["| concurrency | served tok/s | offline tok/s | served / offline | by rank 0's CPU per token |",
             "|---|---|---|---|---|"]
    controls = {r["run"]: r["control"]["tok_per_s"] / r["offline"]["tok_per_s"] for r in rows
                if r["control"] and r["offline"]}
    if controls:  # the A/A control: the same offline engine in a second process, against the first
        lines.insert(0, f"second offline process / offline (the A/A control, per run): "
                        f"{spread(list(controls.values()), 2)}\n")
    for c in concurrency:
        mine = [r for r in rows if r["concurrency"] == c]
        served = [r["served"]["tok_per_s"] for r in mine]
        offline = [r["offline"]["tok_per_s"] for r in mine if r["offline"]]
        ratio = [r["served"]["tok_per_s"] / r["offline"]["tok_per_s"] for r in mine if r["offline"]]
        by_cpu = [x for x in map(cpu_ratio, mine) if x is not None]
        lines.append(f"| {c} | {spread(served, 1)} | {spread(offline, 1) if offline else '-'} | "
                     f"{spread(ratio, 2) if ratio else '-'} | {spread(by_cpu, 2) if by_cpu else '-'} |")
    return "\n".join(lines)


def kinds_table(rows: list[dict]) -> str:
    lines = ["| run | concurrency | served | offline |", "|---|---|---|---|"]
    for r in rows:
        offline = kinds_text(r["offline"]["kinds"]) if r["offline"] else "-"
        lines.append(f"| {r['run']} | {r['concurrency']} | {kinds_text(r['served']['kinds'])} | {offline} |")
    return "\n".join(lines)


def model_folder(args) -> str:
    """--model, or a checkpoint of --arch/--preset written here (released shapes: config only, dummy weights)."""
    if args.model:
        return args.model
    from moeplex.models.make_model import WEIGHTED_PRESETS, write_checkpoint

    config_only = args.preset not in WEIGHTED_PRESETS
    if config_only and args.load_format != "dummy":
        raise SystemExit(f"--preset {args.preset} is written without weights: add --load-format dummy")
    overrides = {"num_hidden_layers": args.layers} if args.layers else None
    return write_checkpoint(tempfile.mkdtemp(), args.arch, args.preset, seed=0, overrides=overrides, config_only=config_only)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: one of --arch/--preset written to a temporary folder)")
    parser.add_argument("--arch", default="deepseek_v3", choices=("deepseek_v3", "qwen3_moe", "mixtral"),
                        help="without --model: the architecture to write (default: deepseek_v3)")
    parser.add_argument("--preset", default="tiny", help="without --model: tiny, small, or a released shape "
                        "(deepseek_v3: v3, qwen3_moe: 30b-a3b, mixtral: 8x7b; needs --load-format dummy); default tiny")
    parser.add_argument("--layers", type=int, help="without --model: num_hidden_layers of the written config")
    parser.add_argument("--url", help="a running server; default: launch `moeplex serve` on a free loopback port")
    parser.add_argument("--api-key", help="the server's API key, if it has one")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--runs", type=int, default=3, help="measured runs of the offline reference and every level")
    parser.add_argument("--prompt-range", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--output-range", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--time-limit", type=float, default=120.0, help="seconds per level during which requests start")
    parser.add_argument("--grace", type=float, default=60.0, help="seconds after the limit before in-flight ones are cancelled")
    parser.add_argument("--threads", type=int, help="torch CPU threads of the offline engine and of the server's ranks "
                        "(OMP_NUM_THREADS); default: torch's own choice")
    parser.add_argument("--out", metavar="FILE", help="also write the Markdown to FILE")
    parser.add_argument("--pin-rank", type=int, metavar="CORE", help="pin rank 0 and the offline engine to CORE, the "
                        "front end and the load generator to the other cores (needs the server launched here)")
    parser.add_argument("--stream-interval", type=int, default=1, help="the server's --stream-interval (default: 1)")
    parser.add_argument("--skip-offline", action="store_true", help="no offline reference (no ratio column)")
    parser.add_argument("--control", action="store_true",
                        help="also time the offline engine in a second process, beside the first in every run: the "
                             "A/A control of the machine's noise (their ratio is printed above the summary)")
    parser.add_argument("--profile", metavar="DIR", help="profile the server (benchmarks/profiled_serve.py: the front end's "
                        "event loop sampled, rank 0 under cProfile); DIR/frontend.txt and DIR/rank0.txt when it stops")
    parser.add_argument("--py-spy", metavar="DIR",
                        help="during the last level, sample the server's processes with py-spy into DIR (collapsed stacks)")
    parser.add_argument("--py-spy-seconds", type=float, default=5.0, help="how long --py-spy samples")
    for name, default in (("max_running_requests", 64), ("max_batched_tokens", 4096), ("chunked_prefill_size", 1024)):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default, help="engine flag (server and offline)")
    parser.add_argument("--max-total-tokens", type=int, default=None, help="engine flag (server and offline)")
    parser.add_argument("--kv-memory-fraction", type=float, default=None, help="engine flag (server and offline)")
    for name in ("dtype", "device", "load_format", "moe_kernel", "attention_backend"):
        parser.add_argument(f"--{name.replace('_', '-')}", default=None, help="engine flag (server and offline)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    args.model = model_folder(args)
    work = mixed_workload(args.num_requests, prompt_range=tuple(args.prompt_range), output_range=tuple(args.output_range))
    warm = [(prompt, min(n, WARM_TOKENS)) for prompt, n in work[: max(args.concurrency)]]
    offline = None if args.skip_offline else OfflineReference(args.model, engine_settings(args), warm, args.threads)
    control = OfflineReference(args.model, engine_settings(args), warm, args.threads) if args.control and offline else None
    server, url = (None, args.url) if args.url else launch_server(args, [f"--stream-interval={args.stream_interval}"])
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    report = Report(args.out)
    report.say(f"\n{args.num_requests} requests, prompts {args.prompt_range[0]}-{args.prompt_range[1]} tokens, outputs "
               f"{args.output_range[0]}-{args.output_range[1]} greedy, device {args.device or 'cpu'}, {args.runs} runs\n")
    report.say(HEADER)
    try:
        pids = server_pids(url, server)
        asyncio.run(run_level(url, warm, max(args.concurrency), args.time_limit, args.grace, headers, pids))
        rows = measure(args, work, offline, url, pids, headers, report, control)
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(120)
        for reference in (offline, control):
            if reference is not None:
                reference.close()
    report.say(f"\nmedian (min-max) of {args.runs} runs:\n")
    report.say(summary(rows, args.concurrency))
    report.say("\nsteps by kind (steps x mean host ms a step; under the overlap schedule about the device's time):\n")
    report.say(kinds_table(rows))
    if args.profile:
        report.say(f"\nprofile of the server: {args.profile}/frontend.txt, {args.profile}/rank0.txt")
    report.close()
    wrong = sum(r["served"]["wrong_lengths"] for r in rows)
    if wrong:
        raise SystemExit(f"{wrong} served requests finished with another number of tokens than they asked for")

if __name__ == "__main__":
    main()
