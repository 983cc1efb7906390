"""The cache-aware router's gain end to end: real `moeplex serve` workers with the prefix cache behind
`moeplex router`, cache_aware versus round_robin, on prompts that share prefixes.

    python benchmarks/router_cache.py --workers 2 --runs 3                        # CPU, tiny qwen3_moe
    python benchmarks/router_cache.py --device cuda --dtype bf16 --workers 4 --preset small --runs 3 \
        --groups 64 --concurrency 32 --max-total-tokens 16384 --out benchmarks/results/router_cache_h200.md   # 4 workers, 1 GPU

Workloads (token ids sent to /v1/completions, greedy with ignore_eos, so every policy does the same work):
- shared-prefix: --groups system prompts x --prompts-per-group questions, in a seeded random order, with
  --concurrency requests in flight. Each worker's KV cache (--max-total-tokens) holds only part of all the
  system prompts: a worker that sees every group (round robin) keeps evicting them, one that sees only its
  own groups (cache aware) keeps them.
- multi-turn: --clients conversations of --rounds turns, all clients at once; each turn's prompt is the
  whole conversation so far (a --context-len opening of its own, previous turns and answers) and a new user
  turn. The router sees prompts only, never answers, so a turn follows the conversation to its worker when the
  previous prompt is more than --cache-threshold of it: the opening context makes that so from the second turn.

Per run: a fresh router per policy; every worker's cache is flushed first, and the workers' own counters
(/get_server_info: prompt tokens looked up and found in the prefix cache) are read before and after, so
the hit rate is the workers' own. Throughput counts prompt + output tokens over the run's wall time. The
table gives the median of --runs runs (min-max) and the ratio cache_aware / round_robin per run.

With --device cuda several workers share one GPU: keep --max-total-tokens small enough that a worker holds
only part of all the prefixes (that is what routing is for) and the workers' KV caches fit together; with
--max-total-tokens 0 each sizes its KV cache as --kv-memory-fraction of the free memory it sees at start-up
(they start together, so give each at most 1 / --workers of what the weights leave).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import aiohttp
import torch

from workload import shared_prefix_prompts, tokens
from router import _answers, free_port, start_router, stop

from moeplex.models.make_model import write_checkpoint

POLICIES = ("round_robin", "cache_aware")
SGLANG_CLAIM = "SGLang's router announcement: 1.9x throughput, 3.8x cache hit rate (cache_aware / round_robin)"


def start_worker(folder: str, args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [
        sys.executable, "-m", "moeplex.cli", "serve", "--model", folder, "--port", str(port), "--log-level", "warning",
        "--device", args.device, "--dtype", args.dtype, "--max-running-requests", str(args.max_running),
        "--schedule-policy", args.schedule_policy,
    ]
    if args.max_total_tokens:
        command += ["--max-total-tokens", str(args.max_total_tokens)]
    if args.kv_memory_fraction is not None:
        command += ["--kv-memory-fraction", str(args.kv_memory_fraction)]
    env = dict(os.environ)
    if args.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"  # the workers share the cores: one thread each, no spinning against each other
    return subprocess.Popen(command, env=env), f"http://127.0.0.1:{port}"


def wait_healthy(procs: list[subprocess.Popen], urls: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for proc, url in zip(procs, urls):
        while not _answers(f"{url}/health"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the worker at {url} did not come up")
            time.sleep(0.5)


def http_json(url: str, data: dict | None = None) -> dict:
    body = None if data is None else json.dumps(data).encode()
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"} if body else {})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def counters(urls: list[str]) -> tuple[list[int], list[int]]:
    """Per worker: prompt tokens it looked up in its prefix cache, and found there."""
    infos = [http_json(f"{url}/get_server_info")["prefix_cache"] for url in urls]
    return [i["queried_tokens"] for i in infos], [i["hit_tokens"] for i in infos]


def flush(urls: list[str]) -> None:
    for url in urls:
        http_json(f"{url}/flush_cache", {})


async def complete(http: aiohttp.ClientSession, url: str, prompt: list[int], args) -> list[int]:
    body = {"prompt": prompt, "max_tokens": args.output_len, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    async with http.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        return (await response.json())["choices"][0]["token_ids"]


async def shared_prefix(http: aiohttp.ClientSession, url: str, args) -> int:
    prompts = shared_prefix_prompts(args.groups, args.prompts_per_group, args.system_len, args.question_len,
                                    random.Random(args.seed))
    queue = list(reversed(prompts))

    async def sender() -> int:
        done = 0
        while queue:
            prompt = queue.pop()
            done += len(prompt) + len(await complete(http, url, prompt, args))
        return done

    return sum(await asyncio.gather(*(sender() for _ in range(args.concurrency))))


async def multi_turn(http: aiohttp.ClientSession, url: str, args) -> int:
    rng = random.Random(args.seed)
    turns = [[[256] + tokens(rng, args.context_len - 1 + args.question_len)]
             + [tokens(rng, args.question_len) for _ in range(args.rounds - 1)] for _ in range(args.clients)]

    async def client(user_turns: list[list[int]]) -> int:
        conversation, done = [], 0
        for turn in user_turns:
            conversation += turn
            answer = await complete(http, url, conversation, args)
            done += len(conversation) + len(answer)
            conversation += answer
        return done

    return sum(await asyncio.gather(*(client(t) for t in turns)))


WORKLOADS = {"shared-prefix": shared_prefix, "multi-turn": multi_turn}


async def drive(workload, url: str, args) -> tuple[int, float]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=args.request_timeout)) as http:
        start = time.perf_counter()
        processed = await workload(http, url, args)
        return processed, time.perf_counter() - start


def one_run(name: str, policy: str, workers: list[str], args) -> tuple[float, float, str]:
    """(tokens/s, the workers' hit rate, each worker's share of the prompt tokens) of one run through a fresh router."""
    flush(workers)
    queried, hit = counters(workers)
    router, url = start_router(policy, workers, ["--cache-threshold", str(args.cache_threshold)])
    try:
        processed, seconds = asyncio.run(drive(WORKLOADS[name], url, args))
    finally:
        stop(router)
    queried_after, hit_after = counters(workers)
    queried = [a - b for a, b in zip(queried_after, queried)]
    hit = sum(hit_after) - sum(hit)
    shares = "/".join(f"{q / max(sum(queried), 1):.0%}" for q in queried)
    return processed / seconds, hit / max(sum(queried), 1), shares


def summary(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="`moeplex serve` workers (default: 2)")
    p.add_argument("--arch", default="qwen3_moe", help="architecture of the random checkpoint (default: qwen3_moe)")
    p.add_argument("--preset", default="tiny", help="tiny or small (default: tiny)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda: every worker on the one GPU (default: cpu)")
    p.add_argument("--dtype", default="fp32", help="worker dtype (default: fp32)")
    p.add_argument("--max-total-tokens", type=int, default=6144,
                   help="each worker's KV cache in tokens; 0: --kv-memory-fraction of free memory (default: 6144)")
    p.add_argument("--kv-memory-fraction", type=float, default=None,
                   help="each worker's share of free device memory for its KV cache, with --max-total-tokens 0")
    p.add_argument("--max-running", type=int, default=16, help="requests each worker decodes at once (default: 16)")
    p.add_argument("--schedule-policy", default="fcfs", choices=("fcfs", "lpm"), help="the workers' (default: fcfs)")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--runs", type=int, default=3, help="runs per policy; median (min-max) (default: 3)")
    p.add_argument("--groups", type=int, default=16, help="shared-prefix: system prompts (default: 16)")
    p.add_argument("--prompts-per-group", type=int, default=6, help="shared-prefix: questions per system prompt (default: 6)")
    p.add_argument("--system-len", type=int, default=512, help="shared-prefix: system prompt tokens (default: 512)")
    p.add_argument("--question-len", type=int, default=32, help="question / user turn tokens (default: 32)")
    p.add_argument("--output-len", type=int, default=16, help="tokens generated per request (default: 16)")
    p.add_argument("--concurrency", type=int, default=8, help="shared-prefix: requests in flight (default: 8)")
    p.add_argument("--clients", type=int, default=8, help="multi-turn: conversations at once (default: 8)")
    p.add_argument("--rounds", type=int, default=5, help="multi-turn: turns per conversation (default: 5)")
    p.add_argument("--context-len", type=int, default=256, help="multi-turn: each conversation's opening tokens (default: 256)")
    p.add_argument("--cache-threshold", type=float, default=0.5, help="the router's --cache-threshold (default: 0.5)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take (default: 600)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="also write the table to this file")
    args = p.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: this machine has no CUDA device (torch.cuda.is_available() is False); use --device cpu")
    folder = write_checkpoint(os.path.join(tempfile.mkdtemp(prefix="moeplex-router-cache-"), args.preset), args.arch, args.preset)
    procs, workers = zip(*(start_worker(folder, args) for _ in range(args.workers)))
    rows = []
    try:
        wait_healthy(list(procs), list(workers), timeout=600)
        for name in args.workloads:
            speed = {policy: [] for policy in POLICIES}
            hits = {policy: [] for policy in POLICIES}
            split = {policy: [] for policy in POLICIES}
            one_run(name, "round_robin", list(workers), args)  # warm-up: connections, allocator, first shapes
            for _ in range(args.runs):  # alternate, so drift in the machine's load hits both alike
                for policy in POLICIES:
                    s, h, shares = one_run(name, policy, list(workers), args)
                    speed[policy].append(s)
                    hits[policy].append(h)
                    split[policy].append(shares)
                    print(f"{name} {policy}: {s:.0f} tok/s, hit rate {h:.1%}, prompt tokens per worker {shares}",
                          file=sys.stderr, flush=True)
            for policy in POLICIES:
                rows.append(f"| {name} | {policy} | {summary(speed[policy], '.0f')} | "
                            f"{summary([h * 100 for h in hits[policy]], '.1f')} | {', '.join(split[policy])} |")
            speed_ratio = [a / b for a, b in zip(speed["cache_aware"], speed["round_robin"])]
            rr_hits = statistics.median(hits["round_robin"])
            hit_ratio = f"{statistics.median(hits['cache_aware']) / rr_hits:.2f}x (of the medians)" if rr_hits else "n/a (round robin hit nothing)"
            rows.append(f"| {name} | **cache_aware / round_robin** | {summary(speed_ratio, '.2f')}x | {hit_ratio} | |")
    finally:
        for proc in procs:
            stop(proc)
    text = "\n".join([
        f"{args.workers} `moeplex serve` workers ({args.arch} {args.preset}, {args.dtype}, {args.device}, KV cache "
        f"{args.max_total_tokens or 'by memory fraction'} tokens each, --schedule-policy {args.schedule_policy}) behind "
        f"`moeplex router`; {args.runs} runs per policy, median (min-max); tokens/s = (prompt + output tokens) / wall time; "
        f"hit rate = the workers' cached prompt tokens / prompt tokens",
        "",
        "| workload | policy | tokens/s | worker hit rate % | prompt tokens per worker, each run |",
        "|---|---|---|---|---|",
        *rows,
        "",
        SGLANG_CLAIM,
    ])
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
