"""How often speculative runs break the overlap schedule, counted on CPU under a given (GPU) step-cost table.

    .venv/bin/python benchmarks/overlap_breaks.py --requests 32 --max-running 1 --output-len 64
    .venv/bin/python benchmarks/overlap_breaks.py --requests 64 --max-running 8 --plain-ms 3.4 --verify-ms 3.5 3.7 3.9 4.1

A tiny qwen3_moe checkpoint decodes the repetitive workload of benchmarks/spec_serving.py (random phrases said four
times, greedy, eos ignored) with ngram, the adaptive policy and verify steps under the overlap schedule (forced on:
a CPU runs them synchronously by default). The policy decides from the cost table given here instead of measuring
this CPU's steps, so it chooses as it would on the GPU whose numbers these are; the defaults are the 12-layer
Qwen3-30B-A3B-shaped model at batch 1 on an H200 (issue #32: a plain step 1.46 ms, a 4-row verify step 1.72 ms;
the rows between interpolated) and a break of 0.8 ms (about the host part of a step there).

Printed, per way of ending a run: the engine's steps by kind and the overlap breaks by reason (core/step_log.py),
and the time the cost table gives those steps (steps x their cost + breaks x the break cost) with its tokens per
second. That time is a model, not a measurement: it says how the counts move, which the GPU then has to confirm.
Ways: `keeps_run` (the adaptive policy's rule: a run goes on through steps of no drafts while they cost less than
two breaks) and `ends_at_once` (every step of no drafts ends the run, the rule until session 9).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import moeplex.speculation.build  # noqa: E402
from moeplex.config import EngineConfig  # noqa: E402
from moeplex.engine import Engine  # noqa: E402
from moeplex.models.make_model import write_checkpoint  # noqa: E402
from moeplex.sampling import SamplingParams  # noqa: E402
from moeplex.speculation.costs import StepCosts, grid_sizes  # noqa: E402
from report import emit  # noqa: E402
from spec_serving import repetitive_workload  # noqa: E402

WAYS = ("ends_at_once", "keeps_run")


def count(folder: str, way: str, args) -> dict:
    """One engine's steps, breaks and modelled seconds for the workload, ending runs `way`."""
    plain, verify, broken = args.plain_ms * 1e-3, [v * 1e-3 for v in args.verify_ms], args.break_ms * 1e-3
    sizes = grid_sizes(args.max_running)
    # every batch size is priced as the table says (per request beyond one: the same step, as a graph pads to it)
    table = StepCosts(sizes, lambda n: [plain] + verify, lambda n: broken)
    measure = moeplex.speculation.build.measure_step_costs
    moeplex.speculation.build.measure_step_costs = lambda *a, **k: table
    try:
        engine = Engine(EngineConfig(model=folder, dtype="fp32", show_progress=False, overlap_schedule=True,
                                     speculative_algorithm="ngram", speculative_num_steps=len(verify) - 1,
                                     max_running_requests=args.max_running, max_total_tokens=args.max_total_tokens,
                                     speculative_cost_calibration=False))  # (the table is given, not this CPU's)
    finally:
        moeplex.speculation.build.measure_step_costs = measure
    if engine.overlap_verify is None:
        raise SystemExit("verify steps do not run under the overlap schedule in this engine")
    if way == "ends_at_once":
        engine.speculation.policy.keeps_run = lambda n, idle: False
    work = repetitive_workload(args.requests, 24, 4, args.output_len)
    done = engine.generate([p for p, _ in work],
                           [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for _, n in work])
    log = engine.step_log
    steps = {kind: n for kind, n in log.steps.items() if n}
    # plain steps of any kind at the plain cost; verify steps at the full width (an upper bound), idle ones at one row
    seconds = (sum(n for kind, n in steps.items() if kind in ("prompt", "decode", "mixed")) * plain
               + steps.get("verify_overlap", 0) * verify[-1] + steps.get("verify_idle", 0) * verify[0]
               + sum(log.breaks.values()) * broken)
    tokens = sum(len(r.output_ids) for r in done)
    return dict(steps=steps, breaks=dict(log.breaks), tokens=tokens, seconds=seconds,
                accepted=sum(r.spec_accepted_tokens for r in done))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32, help="requests, all submitted at once (default: %(default)s)")
    parser.add_argument("--max-running", type=int, default=1, help="--max-running-requests (default: %(default)s)")
    parser.add_argument("--output-len", type=int, default=64, help="new tokens per request (default: %(default)s)")
    parser.add_argument("--plain-ms", type=float, default=1.46, help="a plain step's ms (default: %(default)s)")
    parser.add_argument("--verify-ms", type=float, nargs="+", default=[1.50, 1.57, 1.64, 1.72],
                        help="a verify step's ms at 1, 2, ... rows per request (its length - 1: the draft steps; "
                             "default: %(default)s)")
    parser.add_argument("--break-ms", type=float, default=0.8, help="one break of the overlap schedule, ms "
                        "(default: %(default)s)")
    parser.add_argument("--max-total-tokens", type=int, default=8192,
                        help="the KV pool (default: %(default)s); one that the requests' prompts and outputs overflow "
                             "leaves the prefix cache holding every page no request uses, as in a server after a while")
    parser.add_argument("--out", help="also write the table to this Markdown file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_checkpoint(tmp, "qwen3_moe", "tiny", seed=0)
        rows = [(way, count(folder, way, args)) for way in WAYS]
    lines = [f"{args.requests} requests (max running {args.max_running}, KV pool {args.max_total_tokens} tokens), "
             f"{args.output_len} new tokens each; cost "
             f"table: plain {args.plain_ms} ms, verify {args.verify_ms} ms, break {args.break_ms} ms", "",
             "| runs | steps by kind | breaks: drafts wanted | breaks: verify run ended | accepted drafts | "
             "modelled s | modelled tok/s |", "|---|---|---:|---:|---:|---:|---:|"]
    for way, row in rows:
        steps = ", ".join(f"{kind} {n}" for kind, n in row["steps"].items())
        lines.append(f"| {way} | {steps} | {row['breaks']['drafts_wanted']} | {row['breaks']['verify_run_ended']} | "
                     f"{row['accepted']} | {row['seconds']:.3f} | {row['tokens'] / row['seconds']:.0f} |")
    emit("\n".join(lines), args.out)

if __name__ == "__main__":
    main()
