"""How full a steady batch stays under speculation when admissions join the run of verify steps, by the rows such a
step may hold (the largest decode graph on a GPU: OverlapVerify.admit_rows).

    .venv/bin/python benchmarks/spec_admit_rows.py --batches 32 64 --rows 256 384 512 768

A verify step under the overlap schedule admits waiting requests whose whole prompt fits beside its grid of verify
rows (requests x (steps + 1)); each takes its uncached prompt tokens plus one grid row. At 32 requests with 3 draft
steps the grid is 128 rows, so a largest graph of 256 leaves room for one 97-token prompt a step, while requests of
~64 tokens at ~2.9 tokens a step end at ~1.5 a step: the queue grows until fewer requests run. This counts it, on
CPU (the counts, not the times, are the point: which step admits whom is the same on any device): speculative.py's
steady workload (tiny DeepSeek-V3 with the synthetic MTP layer, nextn with the fixed policy drafting every step,
the overlap schedule on, the verify steps' admission rows forced to --rows), over the window in which prompts are
still waiting to be given, as speculative.py's steady rate is. Per row: the requests running (mean), the tokens a
step, the steps the window took and how many of them were not overlapped verify steps (admissions that ended the
run, where no prompt fits beside: synchronous mixed steps); the run's tokens are the same at every --rows
(checked). Where no prompt fits, a step's tokens are no measure of its cost: the old path's mixed steps admit every
waiting request at once, but each ends the run (a read, a synchronous step, a read: ~2x an overlapped verify
step's time in session 27 on an H100).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile

import torch

import speculative
from moeplex.models.make_model import write_checkpoint
from moeplex.sampling import SamplingParams
from moeplex.speculation.build import graph_rows
from report import emit, processor


def window(engine, prompts, params, batch: int) -> tuple[list[int], list[int], list[bool], list[list[int]]]:
    """(requests running, tokens made, whether it was an overlapped verify step) per step while prompts wait to be
    given, and every request's tokens: each request that finishes is replaced by the next prompt
    (speculative.steady_rate's workload)."""
    queue = list(zip(prompts, params))
    requests = [engine.add_request(*queue.pop(0)) for _ in range(batch)]
    running, made, verified, before = [], [], [], 0
    while engine.has_work:
        for _ in engine.step():
            if queue:
                requests.append(engine.add_request(*queue.pop(0)))
        after = sum(len(r.output_ids) for r in requests)
        if queue:
            running.append(len(engine.scheduler.running))
            made.append(after - before)
            verified.append(engine.step_log.last.kind == "verify_overlap")
        before = after
    return running, made, verified, [r.output_ids for r in requests]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 384, 512, 768],
                        help="the most rows of a verify step that admits (prompt rows + grid)")
    parser.add_argument("--output-len", type=int, default=64, help="mean tokens a request (spread 0.5-1.5x)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    bench = speculative.with_defaults(argparse.Namespace(batches=args.batches, output_len=args.output_len,
                                                         steps=args.steps, steady=True, copy=None))
    folder = write_checkpoint(tempfile.mkdtemp(), "deepseek_v3", "tiny", seed=0, mtp=1, mtp_acceptance=0.8)
    lines = [processor(), "",
             f"nextn (fixed policy, {args.steps} steps) on tiny DeepSeek-V3 + synthetic MTP (0.8), overlap schedule; "
             f"{bench.waves} prompts of {speculative.prompt_len(bench)} tokens per slot, {args.output_len} tokens a "
             "request (0.5-1.5x); the window: while prompts wait to be given", "",
             "| batch | admit rows | grid rows | prompts beside a full grid | running (mean) | tokens a step | "
             "a slot | steps | of them not overlapped verify steps | run ends (whole run) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for batch in args.batches:
        prompts = speculative.workload(batch * bench.waves, seed=batch)
        params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
                  for n in speculative.steady_lengths(len(prompts), args.output_len, seed=batch)]
        grid, reference = batch * (args.steps + 1), None
        for rows in args.rows:
            with contextlib.redirect_stdout(io.StringIO()):  # (its measured step costs)
                engine = speculative.engine_for(folder, bench, "nextn/no-backoff/overlap")
            own = graph_rows(engine.config, type(engine.speculation.drafter), overlap_schedule=True)
            engine.overlap_verify.admit_rows = rows
            running, made, verified, outputs = window(engine, prompts, params, batch)
            reference = reference or outputs
            if outputs != reference:
                raise AssertionError(f"the tokens changed with {rows} admit rows at batch {batch}")
            beside = max(rows - grid, 0) // (len(prompts[0]) - 1 + args.steps + 1)
            mark = " (the engine's)" if rows == own else ""
            lines.append(f"| {batch} | {rows}{mark} | {grid} | {beside} | {statistics.mean(running):.1f} | "
                         f"{statistics.mean(made):.1f} | {statistics.mean(made) / batch:.2f} | {len(made)} | "
                         f"{len(made) - sum(verified)} | {engine.step_log.breaks['verify_run_ended']} |")
    lines += ["", f"(the engine's: the rows its largest graph holds on a GPU at --max-running-requests {max(args.batches)} "
              "and --cuda-graph-max-bs 256, a full grid plus 256: speculation/build.graph_rows)"]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
