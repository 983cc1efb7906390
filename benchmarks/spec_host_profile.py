"""Host time of a decode step, split by phase, with and without speculation.

    .venv/bin/python benchmarks/spec_host_profile.py --runs 3                      CPU, tiny DeepSeek-V3
    python benchmarks/spec_host_profile.py --device cuda --runs 3                  H200, Qwen3-30B-A3B shapes (4 layers)

Each engine (none, ngram adaptive, ngram fixed, adversary adaptive) decodes a steady batch of 1, 8 and 32 requests on
the repetitive workload of benchmarks/speculative.py (a 24-token phrase said 4 times, greedy). The engine's phases are
timed with time.perf_counter by wrapping the methods that make them up, on the instances (the engine code is unchanged);
time spent inside a nested timed phase counts to the inner phase only:

- schedule: Scheduler.schedule (admission, page reservation, draft pages);
- policy: the adaptive/fixed policy's choice outside drafting (wants_drafts, drafts_in, may_draft);
- draft: SpeculativeDecoding.draft without the drafter's propose; propose: Drafter.propose;
- prepare: ModelRunner.prepare (the ForwardBatch built on the host, copied to the device); for a verify step under
  the overlap schedule, OverlapVerify.launch (its batch built and shifted, its acceptance launched);
- forward: ModelRunner.forward / verify_forward: on CPU the whole compute, on a GPU the launch (graph replay);
- sample: the plain sampler's draw (launched on a GPU); verify: acceptance (verify.verify, logits read back);
- wait: reading a step's tokens (InFlight.token_list, VerifyInFlight.read: on a GPU the wait for the device);
- append: the engine's _append per token (stops, detokenizing, finishing); observe: Drafter.observe;
- other: the rest of Engine.step (its own bookkeeping: _complete's loops, SpecCounts, the agreement).

"host" is the step minus forward minus wait: what the host does per step whatever the device. Every column is
milliseconds per decode step (median of --runs runs; min-max of the host column beside it).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

import speculative as spec_bench  # benchmarks/speculative.py: its engines, workload and test drafters
from report import emit, processor
from timing import sync

from moeplex.in_flight import InFlight
from moeplex.models.make_model import write_checkpoint
from moeplex.sampling import SamplingParams
from moeplex.speculation import step as spec_step
from moeplex.speculation.overlap import VerifyInFlight

PHASES = ["schedule", "policy", "draft", "propose", "prepare", "forward", "sample", "verify", "wait", "append",
          "observe", "other"]


class PhaseClock:
    """Exclusive perf_counter time per phase: a timed call inside another timed call is taken out of the outer."""

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[list[float]] = []  # per open call: [time spent in nested timed calls]

    def wrap(self, phase: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self._stack.append([0.0])
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.perf_counter() - start
                nested = self._stack.pop()[0]
                self.totals[phase] += took - nested
                if self._stack:
                    self._stack[-1][0] += took

        return timed

    def attach(self, obj, name: str, phase: str) -> None:
        if obj is not None and hasattr(obj, name):
            setattr(obj, name, self.wrap(phase, getattr(obj, name)))

    def reset(self) -> None:
        self.totals.clear()


def instrument(engine, clock: PhaseClock) -> None:
    """Wrap the engine's phases on its instances (module-level functions are wrapped by `patched`)."""
    engine.step = clock.wrap("other", engine.step)  # the step's own remainder
    clock.attach(engine.scheduler, "schedule", "schedule")
    clock.attach(engine.runner, "prepare", "prepare")
    clock.attach(engine.runner, "forward", "forward")
    clock.attach(engine.runner, "forward_with_hidden", "forward")  # a drafter that reads hidden states (nextn)
    clock.attach(engine.runner, "verify_forward", "forward")
    clock.attach(engine.sampler, "sample", "sample")
    clock.attach(engine, "_append", "append")
    spec = engine.speculation
    if spec is not None:
        clock.attach(spec, "wants_drafts", "policy")
        clock.attach(spec, "drafts_in", "policy")
        clock.attach(spec.policy, "may_draft", "policy")
        clock.attach(spec, "draft", "draft")
        clock.attach(spec.drafter, "propose", "propose")
        clock.attach(spec.drafter, "propose_on_device", "propose")
        clock.attach(spec.drafter, "observe", "observe")
    if getattr(engine, "overlap_verify", None) is not None:  # a verify step built and launched from device state
        clock.attach(engine.overlap_verify, "launch", "prepare")


class patched:
    """verify.verify (called through step's module global) and InFlight.token_list timed while the engine runs."""

    def __init__(self, clock: PhaseClock):
        self.clock = clock

    def __enter__(self):
        self.verify, self.token_list, self.read = spec_step.verify, InFlight.token_list, VerifyInFlight.read
        spec_step.verify = self.clock.wrap("verify", self.verify)
        InFlight.token_list = self.clock.wrap("wait", self.token_list)
        VerifyInFlight.read = self.clock.wrap("wait", self.read)

    def __exit__(self, *exc):
        spec_step.verify, InFlight.token_list, VerifyInFlight.read = self.verify, self.token_list, self.read


def steady_steps(engine, prompts, params, batch: int, device: str, clock: PhaseClock) -> tuple[int, float]:
    """(decode steps, seconds) while `batch` requests run (finished ones replaced); the clock's totals cover exactly
    those steps."""
    queue = list(prompts)
    requests = [engine.add_request(queue.pop(0), params) for _ in range(batch)]
    steps, began = 0, None
    while engine.has_work:
        timing = began is not None and bool(queue)
        finished = engine.step()
        steps += timing
        for _ in finished:
            if queue:
                requests.append(engine.add_request(queue.pop(0), params))
        if began is None and all(r.output_ids for r in requests[:batch]):
            sync(device)
            clock.reset()
            began, steps = time.perf_counter(), 0
        if began is not None and not queue and timing:
            sync(device)
            elapsed = time.perf_counter() - began
            totals = dict(clock.totals)
            while engine.has_work:  # drain, untimed
                engine.step()
            clock.totals = defaultdict(float, totals)
            return steps, elapsed
    raise RuntimeError("the batch never filled")


def profile(folder: str, args, drafter: str) -> dict[int, list[dict[str, float]]]:
    """Per batch, per run: ms per step of every phase, plus 'step' and 'host'."""
    engine = spec_bench.engine_for(folder, args, drafter)
    clock = PhaseClock()
    instrument(engine, clock)
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    out: dict[int, list[dict[str, float]]] = {}
    with patched(clock):
        steady_steps(engine, spec_bench.workload(4, 99), params, 2, args.device, clock)  # warm-up
        for batch in args.batches:
            prompts = spec_bench.workload(batch * spec_bench.STEADY_WAVES, seed=batch)
            for _ in range(args.runs):
                steps, elapsed = steady_steps(engine, prompts, params, batch, args.device, clock)
                row = {phase: clock.totals.get(phase, 0.0) / steps * 1e3 for phase in PHASES}
                row["step"] = elapsed / steps * 1e3
                row["host"] = row["step"] - row["forward"] - row["wait"]
                out.setdefault(batch, []).append(row)
    return out


def table(name: str, results: dict[str, dict[int, list[dict[str, float]]]], batches) -> list[str]:
    shown = [p for p in PHASES if any(run[p] > 5e-4 for res in results.values() for runs in res.values() for run in runs)]
    lines = [f"| model | batch | drafter | step | host | host min-max | host vs none | {' | '.join(shown)} |",
             "|---|---:|---|---:|---:|---:|---:|" + "---:|" * len(shown)]
    for batch in batches:
        for drafter, res in results.items():
            runs = res[batch]
            med = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
            host = [run["host"] for run in runs]
            base = statistics.median(run["host"] for run in results["none"][batch]) if "none" in results else med["host"]
            label = spec_bench.label_of(drafter)
            lines.append(f"| {name} | {batch} | {label} | {med['step']:.3f} | {med['host']:.3f} | "
                         f"{min(host):.3f}-{max(host):.3f} | {med['host'] / base:.2f}x | "
                         + " | ".join(f"{med[p]:.3f}" for p in shown) + " |")
            print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--drafters", nargs="+", default=["none", "ngram", "ngram" + spec_bench.FIXED, "test-adversary"],
                        help="default: %(default)s (none runs first: the adversary proposes against its output)")
    parser.add_argument("--steps", type=int, default=3, help="--speculative-num-steps (default: %(default)s)")
    parser.add_argument("--output-len", type=int, default=32, help="tokens per request (default: %(default)s)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4, help="GPU: Qwen3-30B-A3B decoder layers (default: %(default)s)")
    parser.add_argument("--model", choices=("qwen", "dsv3"), default="qwen",
                        help="GPU: Qwen3-30B-A3B shapes, or DeepSeek-V3 shapes (4 layers) with the synthetic MTP layer "
                             "(--mtp-acceptance) for nextn")
    parser.add_argument("--threads", type=int, default=1, help="CPU: torch threads (default: %(default)s)")
    parser.add_argument("--out", help="also write the table to this file")
    parser.add_argument("--json", help="also write every run's phases to this file (for --merge)")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="print one table from the runs of several --json files (processes run in turns), no run")
    args = spec_bench.with_defaults(parser.parse_args())
    if args.merge:
        merged: dict = {}
        for path in args.merge:
            data = json.loads(Path(path).read_text())
            name = data["name"]
            for drafter, res in data["results"].items():
                for batch, runs in res.items():
                    merged.setdefault(drafter, {}).setdefault(int(batch), []).extend(runs)
        batches = sorted(next(iter(merged.values())))
        lines = [f"{len(args.merge)} processes merged; ms per decode step, median of every run", "",
                 *table(name, merged, batches)]
        emit("\n".join(lines), args.out)
        return
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
        folder = write_checkpoint(tempfile.mkdtemp(), "deepseek_v3", "tiny", seed=0, mtp=1)
        name = "tiny DeepSeek-V3, fp32"
    elif args.model == "dsv3":
        folder = write_checkpoint(tempfile.mkdtemp(), "deepseek_v3", "v3", overrides={"num_hidden_layers": 4},
                                  config_only=True, mtp=1, mtp_acceptance=args.mtp_acceptance)
        name = f"DeepSeek-V3 shapes (4 layers) + synthetic MTP ({args.mtp_acceptance}), bf16"
    else:
        folder = write_checkpoint(tempfile.mkdtemp(), "qwen3_moe", "30b-a3b", config_only=True,
                                  overrides={"num_hidden_layers": args.layers})
        name = f"Qwen3-30B-A3B shapes ({args.layers} layers), bf16"
    spec_bench.register_script_drafters()
    drafters = ["none"] + [d for d in args.drafters if d != "none"]
    reference: dict[int, list[list[int]]] = {}
    results = {}
    for drafter in drafters:
        if spec_bench.drafter_name(drafter) in ("test-oracle", "test-oracle-device", "test-adversary"):
            spec_bench.script_drafters.set_script(reference_script(folder, args, reference))
        results[drafter] = profile(folder, args, drafter)
        gc.collect()  # the engine, before the next one is built (two real-shaped engines may not fit a GPU)
        if args.device != "cpu":
            torch.cuda.empty_cache()
    lines = [f"{processor()}; steps {args.steps}, {args.output_len} tokens per request, steady batches "
             f"({spec_bench.STEADY_WAVES} prompts per slot); ms per decode step, median of {args.runs} runs", "",
             *table(name, results, args.batches)]
    emit("\n".join(lines), args.out)
    if args.json:
        Path(args.json).write_text(json.dumps({"name": name, "results": results}))


def reference_script(folder: str, args, reference: dict) -> list[list[int]]:
    """The plain engine's prompt + output for every prompt of every batch: what the adversary proposes against
    (its drafts are the script's token + 1, always wrong)."""
    if not reference:
        engine = spec_bench.engine_for(folder, args, "none")
        params = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        for batch in args.batches:
            prompts = spec_bench.workload(batch * spec_bench.STEADY_WAVES, seed=batch)
            done = engine.generate(prompts, params, progress=False)
            reference[batch] = [p + r.output_ids for p, r in zip(prompts, done)]
    return [ids for batch in args.batches for ids in reference[batch]]


if __name__ == "__main__":
    main()
