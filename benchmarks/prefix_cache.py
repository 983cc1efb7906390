"""Prefix cache on CPU: the same workloads with the cache and with --disable-prefix-cache, in one process.

    .venv/bin/python benchmarks/prefix_cache.py --arch qwen3_moe --preset tiny --runs 3 --policies fcfs lpm

Workloads (sizes scaled to a 2-core CPU; every output greedy with ignore_eos, so both runs do the same work):
- shared-prefix: like SGLang's generated-shared-prefix: groups x prompts per group, each prompt a long
  system prompt of its group and a short question, all submitted at once;
- multi-turn: clients x rounds, each round's prompt the whole conversation so far plus a new user turn
  (the clients of one round run as one batch, rounds one after another);
- no-reuse: random prompts that share nothing: the cost of the cache when it never hits.

For each it prints tokens per second (prompt + output tokens processed, over wall time) with the cache under
each --policies schedule policy (fcfs, lpm) and without the cache, the median of --runs runs with min-max,
the ratio to the run without, and the hit rate (cached prompt tokens / prompt tokens).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

import torch

from workload import multi_turn_openings, no_reuse_prompts, shared_prefix_prompts, tokens

from moeplex.config import SCHEDULE_POLICIES, EngineConfig
from moeplex.engine import Engine
from moeplex.models.make_model import write_checkpoint
from moeplex.sampling import SamplingParams


def shared_prefix(engine: Engine, args, rng: random.Random) -> tuple[int, int, int]:
    prompts = shared_prefix_prompts(args.groups, args.prompts_per_group, args.system_len, args.question_len, rng)
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    done = engine.generate(prompts, params, progress=False)
    return sum(map(len, prompts)), sum(len(r.output_ids) for r in done), sum(r.cached_tokens for r in done)


def multi_turn(engine: Engine, args, rng: random.Random) -> tuple[int, int, int]:
    conversations = multi_turn_openings(args.clients, args.question_len + 1, rng)
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    prompt_tokens = output_tokens = cached = 0
    for _ in range(args.rounds):
        done = engine.generate(conversations, params, progress=False)
        prompt_tokens += sum(map(len, conversations))
        output_tokens += sum(len(r.output_ids) for r in done)
        cached += sum(r.cached_tokens for r in done)
        conversations = [c + r.output_ids + tokens(rng, args.question_len) for c, r in zip(conversations, done)]
    return prompt_tokens, output_tokens, cached


def no_reuse(engine: Engine, args, rng: random.Random) -> tuple[int, int, int]:
    prompts = no_reuse_prompts(args.groups * args.prompts_per_group, args.system_len + args.question_len, rng)
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    done = engine.generate(prompts, params, progress=False)
    return sum(map(len, prompts)), sum(len(r.output_ids) for r in done), sum(r.cached_tokens for r in done)


WORKLOADS = {"shared-prefix": shared_prefix, "multi-turn": multi_turn, "no-reuse": no_reuse}


def measure(folder: str, workload, args, policy: str | None) -> tuple[float, float]:
    """(tokens/s, hit rate) of one run on a fresh engine; policy None: without the cache."""
    engine = Engine(EngineConfig(
        model=folder, dtype="fp32", show_progress=False, max_total_tokens=args.kv_tokens, page_size=16,
        max_running_requests=args.max_running, max_batched_tokens=2048, disable_prefix_cache=policy is None,
        schedule_policy=policy or "fcfs",
    ))
    start = time.perf_counter()
    prompt_tokens, output_tokens, cached = workload(engine, args, random.Random(args.seed))
    seconds = time.perf_counter() - start
    return (prompt_tokens + output_tokens) / seconds, cached / prompt_tokens


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="qwen3_moe", help="architecture of the random checkpoint (default: qwen3_moe)")
    parser.add_argument("--preset", default="tiny", help="tiny or small (default: tiny)")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--runs", type=int, default=3, help="runs per setting; the table gives median (min-max)")
    parser.add_argument("--groups", type=int, default=4, help="shared-prefix: system prompts (default: 4)")
    parser.add_argument("--prompts-per-group", type=int, default=8, help="shared-prefix: prompts per system prompt (default: 8)")
    parser.add_argument("--system-len", type=int, default=1024, help="shared-prefix: system prompt tokens (default: 1024)")
    parser.add_argument("--question-len", type=int, default=32, help="question / user turn tokens (default: 32)")
    parser.add_argument("--output-len", type=int, default=32, help="tokens generated per request (default: 32)")
    parser.add_argument("--clients", type=int, default=8, help="multi-turn: conversations (default: 8)")
    parser.add_argument("--rounds", type=int, default=6, help="multi-turn: rounds per conversation (default: 6)")
    parser.add_argument("--max-running", type=int, default=16, help="requests decoding at once (default: 16)")
    parser.add_argument("--kv-tokens", type=int, default=65536, help="KV cache size in tokens (default: 65536)")
    parser.add_argument("--policies", nargs="+", default=["fcfs", "lpm"], choices=SCHEDULE_POLICIES,
                        help="schedule policies to run with the cache (default: fcfs lpm)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's own); 1 is steadier on cores shared with other work")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = write_checkpoint(os.path.join(tempfile.mkdtemp(prefix="moeplex-prefix-"), args.preset), args.arch, args.preset)
    print(f"{args.arch} {args.preset}, fp32, {os.cpu_count()} CPU cores, {torch.get_num_threads()} torch threads, {args.runs} runs each; tokens/s = (prompt + output "
          "tokens) / wall time, median (min-max)\n")
    print("| workload | policy | with cache tok/s | without tok/s | ratio | hit rate |")
    print("|---|---|---|---|---|---|")
    for name in args.workloads:
        workload = WORKLOADS[name]
        measure(folder, workload, args, policy=args.policies[0])  # warm the process (allocator, kernels) before timing
        on = {policy: [] for policy in args.policies}
        hits = {policy: [] for policy in args.policies}
        off = []
        for _ in range(args.runs):  # alternate, so drift in the machine's load hits every setting alike
            for policy in args.policies:
                speed, hit = measure(folder, workload, args, policy)
                on[policy].append(speed)
                hits[policy].append(hit)
            off.append(measure(folder, workload, args, None)[0])
        for policy in args.policies:
            ratios = sorted(a / b for a, b in zip(on[policy], off))
            print(f"| {name} | {policy} | {summary(on[policy])} | {summary(off)} | {statistics.median(ratios):.2f}x "
                  f"({ratios[0]:.2f}-{ratios[-1]:.2f}) | {statistics.median(hits[policy]):.0%} |", flush=True)

if __name__ == "__main__":
    sys.exit(main())
