"""Where a shared-prefix run's time goes, with the cache (each --policies policy) and without: what limits the ratio.

    .venv/bin/python benchmarks/prefix_cache_profile.py --threads 1                  CPU, qwen3_moe tiny
    .venv/bin/python benchmarks/prefix_cache_profile.py --threads 1 --output-len 8   fewer decode steps
    .venv/bin/python benchmarks/prefix_cache_profile.py --threads 1 --host-sizes h200

Takes benchmarks/prefix_cache.py's flags and sizes (CPU only: the forward is timed on the host).
1. One warmed engine per setting runs the shared-prefix workload once more from a cold cache; its wall time is
   split into extend (prefill) forwards, decode forwards, and the rest: the host's scheduling, batch building,
   sampling and bookkeeping. The cache shrinks only the extend part.
2. The scheduler alone, no model, at the same sizes (--host-sizes h200: prefix_cache.py's GPU defaults): the host CPU time
   (process time, so other work on the machine does not count) of every step's scheduling and the cache's
   match / insert / lock, best of --runs; the difference to `none` is what the cache adds.
"""

from __future__ import annotations

import argparse
import collections
import random
import time

import torch

import prefix_cache as bench
from workload import shared_prefix_prompts

from moeplex.kv_cache import KVPool
from moeplex.prefix_cache import PrefixCache
from moeplex.request import FinishReason, Request
from moeplex.scheduler import Scheduler


def split(folder: str, args, setting: str) -> str:
    engine = bench.engine_for(folder, args, setting, dummy=False)
    bench.measure(engine, bench.shared_prefix, args, seed=args.seed + 1)
    seconds, steps = collections.Counter(), collections.Counter()
    forward = engine.runner.forward

    def timed(batch, *rest, **named):
        start = time.perf_counter()
        try:
            return forward(batch, *rest, **named)
        finally:
            mode = "extend" if batch.mode.is_extend else "decode"
            seconds[mode] += time.perf_counter() - start
            steps[mode] += 1

    engine.runner.forward = timed
    run = bench.measure(engine, bench.shared_prefix, args, args.seed)
    rest = run.seconds - seconds["extend"] - seconds["decode"]
    return (f"| {setting} | {run.seconds:.2f} | {seconds['extend']:.2f} ({steps['extend']}) | {seconds['decode']:.2f} "
            f"({steps['decode']}) | {rest:.2f} | {run.hit_rate:.0%} |")


def scheduler_only(args, setting: str) -> tuple[float, int]:
    """(host CPU seconds, steps) of scheduling the workload with no model: every request's next token is 7."""
    prompts = shared_prefix_prompts(args.groups, args.prompts_per_group, args.system_len, args.question_len,
                                    random.Random(args.seed))
    kv = KVPool(-(-args.kv_tokens // 16), 16, [[(1,)]], torch.float32, torch.device("cpu"))
    cache = None if setting == bench.NO_CACHE else PrefixCache(kv)
    scheduler = Scheduler(kv, args.max_running, args.step_tokens, args.chunk, False, cache,
                          "fcfs" if cache is None else setting)
    params = bench.params(args)
    for i, prompt in enumerate(prompts):
        scheduler.add(Request(str(i), prompt, params))
    start, steps = time.process_time(), 0
    while scheduler.has_work:  # the engine's bookkeeping around a step (engine.py _launch and _append)
        steps += 1
        for item in scheduler.schedule():
            request = item.request
            request.num_cached += item.num_tokens
            if request.num_cached <= len(request.prompt_ids):
                scheduler.cache_progress(request)
            if request.num_uncached == 0:
                request.output_ids.append(7)
                if len(request.output_ids) >= args.output_len:
                    request.finish(FinishReason.LENGTH)
                    scheduler.finish(request)
    return time.process_time() - start, steps


def main() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--host-sizes", choices=("same", "h200"), default="same",
                        help="the scheduler-alone part: these sizes, or prefix_cache.py's --device cuda defaults")
    ours, argv = parser.parse_known_args()
    args = bench.parse_args(argv)
    if args.device != "cpu":
        raise SystemExit("prefix_cache_profile.py times forwards on the host: --device cpu only")
    if args.threads:
        torch.set_num_threads(args.threads)
    folder, model, _ = bench.checkpoint(args, args.presets[0])
    settings = [*args.policies, bench.NO_CACHE]
    print(f"{model}, {torch.get_num_threads()} torch threads: shared-prefix {args.groups} x {args.prompts_per_group} prompts of "
          f"{args.system_len} + {args.question_len} tokens, {args.output_len} output tokens, one run from a cold cache\n")
    print("| setting | wall s | extend forwards s (steps) | decode forwards s (steps) | rest (host) s | hit rate |")
    print("|---|---|---|---|---|---|")
    for setting in settings:
        print(split(folder, args, setting), flush=True)
    host = args if ours.host_sizes == "same" else gpu_sizes()
    print(f"\nthe scheduler alone (no model): shared-prefix {host.groups} x {host.prompts_per_group} prompts of "
          f"{host.system_len} + {host.question_len} tokens, {host.output_len} output tokens, up to {host.max_running} "
          f"running, {host.step_tokens}-token steps; host CPU time, best of {args.runs}\n")
    print("| setting | host ms | steps | ms / step | added by the cache ms |")
    print("|---|---|---|---|---|")
    best = {s: min(scheduler_only(host, s) for _ in range(args.runs)) for s in settings}
    for setting in settings:
        seconds, steps = best[setting]
        added = "-" if setting == bench.NO_CACHE else f"{(seconds - best[bench.NO_CACHE][0]) * 1e3:+.0f}"
        print(f"| {setting} | {seconds * 1e3:.0f} | {steps} | {seconds / steps * 1e3:.2f} | {added} |")


def gpu_sizes():
    """prefix_cache.py's --device cuda defaults, parsed where no GPU is (the scheduler alone needs none)."""
    available = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    try:
        return bench.parse_args(["--device", "cuda"])
    finally:
        torch.cuda.is_available = available


if __name__ == "__main__":
    main()
