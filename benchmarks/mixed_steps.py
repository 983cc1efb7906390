"""The steps the scheduler alone takes for the serving benchmark's workload under a GPU engine's mixed steps.

Where decode steps replay CUDA graphs, a step mixing prompt tokens with decodes holds at most the largest graph's
rows (`Scheduler.mixed_rows`). This drives the scheduler as the engine does (every scheduled prompt piece cached,
a token for each request whose prompt is done, requests finishing at their length) over benchmarks/serving.py's
256 requests at concurrency 64: offline (all queued at once) and served (a finished request's successor arrives
some steps later). Printed: steps by kind (decode only, mixed, prompt only) and output tokens per step. No model
runs; on the GPU a prompt-only step runs eagerly where its rows exceed a graph, so the kinds say where time goes.

    python benchmarks/mixed_steps.py [--mixed-rows 256] [--delays 1 2] [--out FILE]
"""

from __future__ import annotations

import argparse

from report import emit
from workload import mixed_workload

from moeplex.kv_cache import KVPool
from moeplex.request import FinishReason, Request
from moeplex.sampling import SamplingParams
from moeplex.scheduler import Scheduler


def steps(args, delay: int | None) -> tuple[dict[str, int], int]:
    """Steps of each kind and output tokens; `delay` None: every request queued at the start (offline)."""
    scheduler = Scheduler(KVPool(8192, 16, [[(1,)]], dtype=None, device="cpu"), max_running=args.concurrency,
                          token_budget=4096, chunk_size=1024, mixed=True, mixed_rows=args.mixed_rows)
    waiting = [Request(str(i), prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))
               for i, (prompt, n) in enumerate(mixed_workload(args.num_requests))]
    first = len(waiting) if delay is None else args.concurrency
    for request in waiting[:first]:
        scheduler.add(request)
    waiting, arriving = waiting[first:], []
    kinds, tokens, step = {"decode": 0, "mixed": 0, "prompt": 0}, 0, 0
    while scheduler.has_work or arriving:
        for request in [r for at, r in arriving if at <= step]:
            scheduler.add(request)
        arriving = [(at, r) for at, r in arriving if at > step]
        work, step = scheduler.schedule(), step + 1
        if not work:
            continue
        decodes = sum(1 for w in work if w.request.num_uncached == 1 and w.request.output_ids)
        kinds["decode" if decodes == len(work) else "mixed" if decodes else "prompt"] += 1
        for w in work:
            request = w.request
            request.num_cached += w.num_tokens
            if request.num_uncached:
                continue
            request.output_ids.append(1)
            tokens += 1
            if len(request.output_ids) >= request.params.max_new_tokens:
                request.finish(FinishReason.LENGTH)
                scheduler.finish(request)
                if waiting:
                    arriving.append((step + delay, waiting.pop(0)))
    return kinds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mixed-rows", type=int, default=256, help="the largest captured graph (--cuda-graph-max-bs)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--delays", type=int, nargs="*", default=[1, 2], help="steps before a successor arrives")
    parser.add_argument("--out", metavar="FILE", help="also write the table to FILE")
    args = parser.parse_args()
    lines = ["| side | steps | decode only | mixed | prompt only | output tokens |", "|---|---:|---:|---:|---:|---:|"]
    for delay in [None, *args.delays]:
        kinds, tokens = steps(args, delay)
        side = "offline" if delay is None else f"served, successor {delay} step{'s' if delay > 1 else ''} later"
        lines.append(f"| {side} | {sum(kinds.values())} | {kinds['decode']} | {kinds['mixed']} | {kinds['prompt']} | {tokens} |")
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
