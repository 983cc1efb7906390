"""Served speculative decoding: `moeplex serve --speculative-algorithm ngram` against the same server without it.

    .venv/bin/python benchmarks/spec_serving.py --num-requests 64 --output-len 64 --runs 5 --threads 1     CPU, tiny
    python benchmarks/spec_serving.py --device cuda --arch qwen3_moe --preset 30b-a3b --layers 12 --load-format dummy \
        --dtype bf16 --moe-kernel triton --num-requests 128 --runs 3                                 # one H200

Both servers are launched once (same engine flags, one with --speculative-algorithm ngram and the adaptive policy,
the default) and warmed up alike; then each of --runs runs sends the workload at every concurrency level to both,
in turns (which server goes first alternates), with their prefix caches flushed before each level, so a shared
machine's load drifts under both alike. The load generator is benchmarks/serving_load.py's (streaming
/v1/completions from a fixed number of clients, aiohttp).

The workload is repetitive, where ngram has something to find: each prompt is a random phrase of --phrase tokens
said --repeats times (benchmarks/speculative.py's), greedy, --output-len new tokens, eos ignored. With random weights
the model's own output loops as well, which is what ngram's accepted drafts are (the accept length column, from the
server's /metrics: tokens per verify step, averaged over the finished requests).

Printed: a row per run, level and server (output tok/s, TTFT and ITL p50/p99, the server's ms and tokens per engine
step), then per level the median (min-max) over runs of both servers' output tok/s, of the ratio ngram / none taken
within each run, and of ITL p50 and p99.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import statistics
import sys

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from serving import flush, launch_server, model_folder, server_pids  # noqa: E402
from serving_load import run_level, summarize  # noqa: E402

WARM_TOKENS = 8


def repetitive_workload(num_requests: int, phrase: int, repeats: int, output_len: int, seed: int = 0,
                        spread: float = 0.0):
    """(prompt, new tokens) pairs: a bos, then a random phrase of byte tokens said `repeats` times; new tokens
    output_len, or with `spread` uniform in output_len x [1 - spread, 1 + spread] (requests that finish apart)."""
    rng = random.Random(seed)
    work = []
    for _ in range(num_requests):
        prompt = [256] + [rng.randrange(256) for _ in range(phrase)] * repeats
        work.append((prompt, max(1, round(output_len * (1 + spread * (2 * rng.random() - 1)))) if spread else output_len))
    return work


def step_counts(url: str) -> dict:
    """The server's engine steps by kind ({kind: (steps, seconds)}) and overlap breaks by reason, since start-up."""
    info = httpx.get(f"{url}/get_server_info", timeout=30).json()
    kinds = {kind: (v["steps"], v["seconds"]) for kind, v in info.get("engine_steps", {}).items()}
    return {"kinds": kinds, "breaks": dict(info.get("overlap_breaks", {}))}


def step_mix(before: dict, after: dict) -> dict:
    kinds = {k: (n - before["kinds"].get(k, (0, 0.0))[0], t - before["kinds"].get(k, (0, 0.0))[1])
             for k, (n, t) in after["kinds"].items()}
    return {"kinds": kinds, "breaks": {r: n - before["breaks"].get(r, 0) for r, n in after["breaks"].items()}}


MIX_KINDS = ("prompt", "decode", "verify_overlap", "verify_idle", "verify", "none")


def mix_row(run: int, concurrency: int, name: str, mix: dict) -> str:
    """Steps of each kind in the level, with their mean host ms, and the overlap breaks."""
    cells = []
    for kind in MIX_KINDS:
        n, t = mix["kinds"].get(kind, (0, 0.0))
        cells.append(f"{n} ({1e3 * t / n:.2f})" if n else "0")
    breaks = mix["breaks"]
    return (f"| {run} | {concurrency} | {name} | " + " | ".join(cells) +
            f" | {breaks.get('drafts_wanted', 0)} | {breaks.get('verify_run_ended', 0)} |")


def accept_length(url: str) -> tuple[float, float]:
    """(sum, count) of the server's per-request accept length histogram (/metrics)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values = {}
    for name in ("sum", "count"):
        found = re.search(rf"^moeplex_spec_accept_length_{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
        values[name] = float(found.group(1)) if found else 0.0
    return values["sum"], values["count"]


class Server:
    def __init__(self, name: str, args, extra: list[str]):
        self.name = name
        self.process, self.url = launch_server(args, extra)
        self.pids = server_pids(self.url, self.process)

    def level(self, args, work, concurrency: int) -> dict:
        flush(self.url)
        before, steps_before = accept_length(self.url), step_counts(self.url)
        result = summarize(asyncio.run(run_level(self.url, work, concurrency, args.time_limit, args.grace, {}, self.pids)))
        after = accept_length(self.url)
        count = after[1] - before[1]
        result["accept_length"] = (after[0] - before[0]) / count if count else None
        result["mix"] = step_mix(steps_before, step_counts(self.url))
        return result

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(120)


def fmt(values: list[float], digits: int, scale: float = 1.0) -> str:
    values = [v * scale for v in values]
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def row(run: int, concurrency: int, name: str, s: dict, wanted: int) -> str:
    length = f"{s['accept_length']:.2f}" if s.get("accept_length") else "-"
    return (f"| {run} | {concurrency} | {name} | {s['requests']}/{wanted} | {s['tok_per_s']:.1f} | "
            f"{1e3 * s['ttft_p50']:.1f} | {1e3 * s['ttft_p99']:.1f} | {1e3 * s['itl_p50']:.2f} | {1e3 * s['itl_p99']:.2f} | "
            f"{s['ms_per_step']:.2f} | {s['tok_per_step']:.2f} | {length} |")


def summary(results: dict, levels: list[int]) -> list[str]:
    lines = ["| concurrency | none tok/s | ngram tok/s | ngram / none | ITL p50 ms none / ngram | ITL p99 ms none / ngram "
             "| accept length |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for c in levels:
        none, ngram = results["none", c], results["ngram", c]
        ratios = [b["tok_per_s"] / a["tok_per_s"] for a, b in zip(none, ngram)]
        lengths = [r["accept_length"] for r in ngram if r.get("accept_length")]
        length = f"{statistics.median(lengths):.2f}" if lengths else "-"
        lines.append(
            f"| {c} | {fmt([r['tok_per_s'] for r in none], 1)} | {fmt([r['tok_per_s'] for r in ngram], 1)} | "
            f"{fmt(ratios, 2)} | {statistics.median(r['itl_p50'] for r in none) * 1e3:.2f} / "
            f"{statistics.median(r['itl_p50'] for r in ngram) * 1e3:.2f} | "
            f"{statistics.median(r['itl_p99'] for r in none) * 1e3:.2f} / "
            f"{statistics.median(r['itl_p99'] for r in ngram) * 1e3:.2f} | {length} |")
    return lines


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: one of --arch/--preset written to a temporary folder)")
    parser.add_argument("--arch", default="deepseek_v3", choices=("deepseek_v3", "qwen3_moe", "mixtral"))
    parser.add_argument("--preset", default="tiny", help="tiny, small, or a released shape (needs --load-format dummy)")
    parser.add_argument("--layers", type=int, help="num_hidden_layers of the written config")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--num-requests", type=int, default=None, help="per level (default: 4 x the largest concurrency)")
    parser.add_argument("--output-len", type=int, default=128, help="new tokens per request (default: %(default)s)")
    parser.add_argument("--output-spread", type=float, default=0.0,
                        help="new tokens per request uniform in output-len x [1 - S, 1 + S] (default: %(default)s: all "
                             "alike, so the plain server's requests finish and are replaced in waves)")
    parser.add_argument("--phrase", type=int, default=24, help="tokens of each prompt's phrase (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=4, help="times the phrase is said (default: %(default)s)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="--speculative-num-steps (default: %(default)s)")
    parser.add_argument("--policy", default="adaptive", choices=("adaptive", "fixed"), help="--speculative-policy")
    parser.add_argument("--time-limit", type=float, default=300.0, help="seconds per level during which requests start")
    parser.add_argument("--grace", type=float, default=120.0, help="seconds after the limit before in-flight ones are cancelled")
    parser.add_argument("--threads", type=int, help="the servers' torch CPU threads (OMP_NUM_THREADS)")
    parser.add_argument("--out", metavar="FILE", help="also write the Markdown to FILE")
    for name, default in (("max_running_requests", 64), ("max_batched_tokens", 8192), ("chunked_prefill_size", 4096)):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default, help="engine flag (both servers)")
    parser.add_argument("--max-total-tokens", type=int, default=None,
                        help="engine flag (both servers); default: twice what --max-running-requests requests of the "
                        "workload hold (set, so the second server on a GPU gets the KV the first did)")
    parser.add_argument("--kv-memory-fraction", type=float, default=None, help="engine flag (both servers)")
    for name in ("dtype", "device", "load_format", "moe_kernel", "attention_backend"):
        parser.add_argument(f"--{name.replace('_', '-')}", default=None, help="engine flag (both servers)")
    args = parser.parse_args()
    args.profile = None  # serving.launch_server's
    args.num_requests = args.num_requests or 4 * max(args.concurrency)
    if args.max_total_tokens is None:
        longest = round(args.output_len * (1 + args.output_spread))
        per_request = 1 + args.phrase * args.repeats + longest + args.steps + 64  # + page and draft slack
        args.max_total_tokens = 2 * args.max_running_requests * per_request
    return args


def main() -> None:
    args = parse_args()
    args.model = model_folder(args)
    work = repetitive_workload(args.num_requests, args.phrase, args.repeats, args.output_len, spread=args.output_spread)
    warm = [(prompt, WARM_TOKENS) for prompt, _ in work[: max(args.concurrency)]]
    lines = [f"{args.num_requests} requests per level, prompts a {args.phrase}-token phrase x {args.repeats}, "
             f"{args.output_len} greedy new tokens (spread {args.output_spread}; eos ignored), device {args.device or 'cpu'}, ngram "
             f"--speculative-num-steps {args.steps} --speculative-policy {args.policy}, {args.runs} runs", "",
             "| run | concurrency | server | requests done | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
             "| ITL p99 ms | ms/step | tok/step | accept length |", "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    servers = {}
    try:
        servers["none"] = Server("none", args, [])
        servers["ngram"] = Server("ngram", args, ["--speculative-algorithm", "ngram", "--speculative-num-steps",
                                                  str(args.steps), "--speculative-policy", args.policy])
        for server in servers.values():  # warm-up (and, on CPU, the adaptive policy's lazily measured sizes)
            server.level(args, warm, max(args.concurrency))
        results: dict[tuple[str, int], list[dict]] = {}
        mixes = []
        for run in range(args.runs):
            for i, concurrency in enumerate(args.concurrency):
                order = ["none", "ngram"] if (run + i) % 2 == 0 else ["ngram", "none"]
                for name in order:
                    result = servers[name].level(args, work, concurrency)
                    results.setdefault((name, concurrency), []).append(result)
                    lines.append(row(run + 1, concurrency, name, result, args.num_requests))
                    mixes.append(mix_row(run + 1, concurrency, name, result["mix"]))
                    print(lines[-1], flush=True)
    finally:
        for server in servers.values():
            server.stop()
    lines += ["", "The engine's steps in each level by what they launched (/get_server_info `engine_steps`: count, mean "
              "host ms a step), and the overlap schedule's breaks (a step in flight read before the next launched):", "",
              "| run | concurrency | server | " + " | ".join(MIX_KINDS) + " | breaks: drafts wanted | breaks: verify run "
              "ended |", "|---:|---:|---|" + "---:|" * (len(MIX_KINDS) + 2), *mixes]
    lines += ["", f"median (min-max) of {args.runs} runs; ngram / none taken within each run:", "",
              *summary(results, args.concurrency)]
    text = "\n".join(lines)
    print("\n".join(lines[-len(args.concurrency) - 2:]))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    wrong = sum(r["wrong_lengths"] for runs in results.values() for r in runs)
    if wrong:
        raise SystemExit(f"{wrong} served requests finished with another number of tokens than they asked for")


if __name__ == "__main__":
    main()
