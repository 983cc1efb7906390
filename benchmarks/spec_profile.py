"""Where a speculative step's time goes: host time per engine step, device time per step, and the host's ops.

    python benchmarks/spec_profile.py --device cuda --out DIR                 H200, Qwen3-30B-A3B shapes (12 layers)
    .venv/bin/python benchmarks/spec_profile.py --out DIR                     CPU, tiny DeepSeek-V3

For each engine (plain decoding, then each --drafters entry, named as in speculative.py) a steady batch runs once
to warm up and once under torch.profiler. Per engine it writes DIR/<name>.txt: the steps' host time (wall time of
engine.step(), median and p90), the device's busy time per step (the sum of its kernels' durations over the
profiled steps), tokens per step, the calls that make the host wait for the device (stream / event / device
synchronizations, device-to-host copies), and the profiler's table of host ops by self time. The summary table
(one row per engine) goes to stdout and DIR/summary.md.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

import speculative as sp
from moeplex.models.make_model import write_checkpoint
from moeplex.sampling import SamplingParams
from report import emit
from timing import sync

WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "aten::_local_scalar_dense",
         "aten::item", "Memcpy DtoH")


def count_calls(engine) -> dict[str, int]:
    """Wrap the engine's step paths so each call is counted: which way each step went (the overlapped verify step
    from graphs or eagerly, the synchronous verify step, a forward that replayed a decode graph or ran eagerly)."""
    counts: dict[str, int] = {}

    def wrap(owner, name: str, label, kind: str = ""):
        real = getattr(owner, name, None)
        if real is None:
            return

        def counted(*a, **k):
            out = real(*a, **k)
            key = label(out, *a) if callable(label) else label
            counts[key] = counts.get(key, 0) + 1
            return out

        setattr(owner, name, counted)

    verify = engine.overlap_verify
    if verify is not None:
        wrap(verify, "start", lambda out, *a: "overlap start: " + ("launched" if out is not None else "declined"))
        wrap(verify, "follow", lambda out, *a: "overlap follow: " + ("launched" if out is not None else "declined"))
        wrap(verify, "_launch_graphed", "overlap step from graphs")
        wrap(verify, "launch", "overlap step launched (graphs or eager)")
    wrap(engine, "_speculative_step", "synchronous verify step")
    runner = engine.runner
    graphs = runner.graphs
    wrap(runner, "forward", lambda out, batch, *a: "forward: " + (
        "graph" if graphs is not None and graphs.can_run(batch) else f"eager ({batch.mode.name.lower()})"))
    wrap(runner, "verify_forward", lambda out, batch, *a: "verify forward: " + (
        "graph" if graphs is not None and graphs.can_run(batch) else f"eager ({batch.mode.name.lower()})"))
    return counts


def profiled_run(engine, prompts, batch: int, args, paths: dict | None = None) -> tuple[list[float], int, object]:
    """(host seconds of each engine.step() while the batch is full, tokens emitted in them, the profile); `paths`
    (count_calls' counts, with the step log's kinds and overlap breaks added) is cleared as the clock starts and
    frozen as it stops."""
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    queue = list(prompts)
    requests = [engine.add_request(queue.pop(0), params) for _ in range(batch)]
    while any(not r.output_ids for r in requests):
        engine.step()
    sync(args.device)
    times, before = [], sum(len(r.output_ids) for r in requests)
    if paths is not None:
        paths.clear()
    log = engine.step_log
    kinds_before, breaks_before = dict(log.steps), dict(log.breaks)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device != "cpu" else [])
    with profile(activities=activities) as prof:
        while engine.has_work and queue:
            start = time.perf_counter()
            for _ in engine.step():
                if queue:
                    requests.append(engine.add_request(queue.pop(0), params))
            times.append(time.perf_counter() - start)
        sync(args.device)
    tokens = sum(len(r.output_ids) for r in requests) - before
    if paths is not None:
        frozen = dict(paths)
        frozen.update({f"kind {k}": v - kinds_before[k] for k, v in log.steps.items() if v > kinds_before[k]})
        frozen.update({f"break {k}": v - breaks_before[k] for k, v in log.breaks.items() if v > breaks_before[k]})
    while engine.has_work:
        engine.step()
    if paths is not None:
        paths.clear()
        paths.update(frozen)
    return times, tokens, prof


def device_busy(prof) -> float:
    """Seconds the device spent in kernels and copies over the profile."""
    total = 0.0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
    return total / 1e6


def report(name: str, times: list[float], tokens: int, prof, args, paths: dict[str, int]) -> tuple[str, str]:
    steps = len(times)
    host = sorted(times)
    busy = device_busy(prof) if args.device != "cpu" else 0.0
    counts = {}
    for avg in prof.key_averages():
        if any(avg.key.startswith(w) for w in WAITS):
            counts[avg.key] = avg.count
    waits = ", ".join(f"{k} {v / steps:.1f}" for k, v in sorted(counts.items())) or "none"
    summary = (f"| {name} | {steps} | {tokens / steps:.2f} | {statistics.median(host) * 1e3:.3f} | "
               f"{host[int(0.9 * (steps - 1))] * 1e3:.3f} | {busy / steps * 1e3:.3f} | "
               f"{sum(times) / tokens * 1e3:.3f} | {waits} |")
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=60, max_name_column_width=70)
    if args.device != "cpu":  # the device's side as well: which kernels fill (or do not fill) its busy time
        table += "\n" + prof.key_averages().table(sort_by="self_device_time_total", row_limit=40,
                                                   max_name_column_width=70)
    text = (f"# {name}: {steps} steps, {tokens} tokens\n\nhost ms per step: median {statistics.median(host) * 1e3:.3f}, "
            f"p90 {host[int(0.9 * (steps - 1))] * 1e3:.3f}\ndevice busy ms per step: {busy / steps * 1e3:.3f}\n"
            f"waits per step: {waits}\n\n{table}\n")
    text += "\nstep paths per step:\n" + "".join(f"  {k}: {v / steps:.2f}\n" for k, v in sorted(paths.items()))
    summary = summary[:-1] + " " + "; ".join(f"{k} {v / steps:.2f}" for k, v in sorted(paths.items())) + " |"
    return summary, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--drafters", nargs="+", default=["ngram/fixed/overlap", "ngram/fixed/sync"],
                        help="engines besides plain decoding, named as in speculative.py (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--qwen-layers", type=int, default=12)
    parser.add_argument("--model", choices=("qwen", "dsv3"), default="qwen",
                        help="GPU: Qwen3-30B-A3B shapes, or DeepSeek-V3 shapes (--dsv3-layers) with the synthetic MTP layer "
                             "(--mtp-acceptance) for nextn")
    parser.add_argument("--dsv3-layers", type=int, default=4, help="GPU, --model dsv3: decoder layers (default: 4)")
    parser.add_argument("--dsv3-experts", type=int, default=None, help="GPU, --model dsv3: routed experts (default: 256)")
    parser.add_argument("--mixed-chunk", choices=("auto", "on", "off"), default="auto",
                        help="the engines' --mixed-chunk, as in speculative.py (on: a speculating engine's steps with a "
                             "prompt in them verify drafts too, synchronously)")
    parser.add_argument("--out", required=True)
    args = sp.with_defaults(parser.parse_args())
    args.batches, args.steady = [args.batch], True
    sp.register_script_drafters()
    if args.device == "cpu":
        torch.set_num_threads(1)
        folder = write_checkpoint(tempfile.mkdtemp(), "deepseek_v3", "tiny", seed=0, mtp=1)
    else:
        folder = write_checkpoint(tempfile.mkdtemp(), "qwen3_moe", "30b-a3b", config_only=True,
                                  overrides={"num_hidden_layers": args.qwen_layers})
    if args.device != "cpu" and args.model == "dsv3":
        shape = {"num_hidden_layers": args.dsv3_layers}
        if args.dsv3_experts:
            shape["n_routed_experts"] = args.dsv3_experts
        folder = write_checkpoint(tempfile.mkdtemp(), "deepseek_v3", "v3", overrides=shape,
                                  config_only=True, mtp=1, mtp_acceptance=args.mtp_acceptance)
    os.makedirs(args.out, exist_ok=True)
    prompts = sp.workload(args.batch * 2, seed=args.batch)
    reference: dict[int, list] = {}
    lines = [f"batch {args.batch}, steps {args.steps}, device {args.device}", "",
             "| engine | steps | tokens/step | host ms/step (median) | p90 | device busy ms/step | host ms/token | "
             "host waits per step | step paths per step |", "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for drafter in ["none", *args.drafters]:
        engine = sp.warmed_engine(folder, args, drafter)
        if drafter == "none":  # the reference the oracle proposes
            sp.measure(engine, "none", args.batch, prompts, args, reference)
        if drafter.startswith(("test-oracle", "test-adversary")):
            sp.script_drafters.set_script([p + out for p, out in zip(prompts, reference[args.batch])])
        with sp.forced_acceptance(sp.forced(drafter, args)):
            profiled_run(engine, prompts, args.batch, args)  # warm
            paths = count_calls(engine)
            times, tokens, prof = profiled_run(engine, prompts, args.batch, args, paths)
        summary, text = report(drafter, times, tokens, prof, args, paths)
        lines.append(summary)
        print(summary, flush=True)
        with open(os.path.join(args.out, drafter.replace("/", "_") + ".txt"), "w") as f:
            f.write(text)
        del engine, prof
        gc.collect()  # the counting wrappers hold the engine in cycles: freed before the next engine is built
        if args.device != "cpu":  # (two engines of DeepSeek-V3 shapes do not fit an 80 GB GPU)
            torch.cuda.empty_cache()
    emit("\n".join(lines), os.path.join(args.out, "summary.md"))


if __name__ == "__main__":
    main()
