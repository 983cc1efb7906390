"""Where the host spends its time in steady decode, and which calls make it wait for the GPU.

    python benchmarks/host_profile.py [--batch 1 64] [--steps 30] [--out FILE]
    python benchmarks/host_profile.py --batch 16 --admit-every 4 --prompt-len 97     # prompts arriving meanwhile

A Qwen3-30B-A3B-shaped model cut to a few layers (random weights on the device) decodes with
CUDA graphs and the overlap schedule. Under torch.cuda.set_sync_debug_mode("warn") every call that
makes the host wait for the GPU is reported with the line that made it: in steady decode there
should be none but the read of the previous step's tokens (an event wait, which the mode does not
flag). cProfile then lists the host functions of the same steps by their cumulative time. With --admit-every K
a request of --prompt-len tokens arrives every K steps (as in serving, where prompt steps come between decode
steps), and the engine's steps are listed by kind with their mean host time (Engine.step_log).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import tempfile
import time
import traceback
import warnings

import torch

from report import emit  # benchmarks/report.py, beside this file

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.models.make_model import write_checkpoint
from moeplex.sampling import SamplingParams


def start(engine: Engine, batch: int, steps: int) -> list:
    """Admit `batch` requests and run until they all decode; the requests."""
    rng = random.Random(batch)
    params = SamplingParams(max_new_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    requests = [engine.add_request([rng.randrange(256) for _ in range(64)], params) for _ in range(batch)]
    for _ in range(4):
        engine.step()
    torch.cuda.synchronize()
    return requests


class Arrivals:
    """engine.step, with a request of `length` prompt tokens added every `every` steps (never, with every 0)."""

    def __init__(self, engine: Engine, every: int, length: int, requests: list):
        self.engine, self.every, self.length, self.count = engine, every, length, 0
        self.requests = requests  # every request of the run: their output tokens count the run's throughput
        self.rng = random.Random(1)
        self.params = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)

    def step(self) -> None:
        if self.every and self.count % self.every == 0:
            self.requests.append(self.engine.add_request([self.rng.randrange(256) for _ in range(self.length)],
                                                         self.params))
        self.count += 1
        self.engine.step()

    def tokens(self) -> int:
        return sum(len(r.output_ids) for r in self.requests)


def step_kinds(engine: Engine, arrivals: Arrivals, steps: int) -> list[str]:
    """The engine's steps over `steps` steps by what they launched: count and mean host ms (Engine.step_log); and
    the output tokens those steps gave, per second of wall time."""
    before = {k: (n, t) for k, n, t in engine.step_log.totals()}
    torch.cuda.synchronize()
    tokens, began = arrivals.tokens(), time.perf_counter()
    for _ in range(steps):
        arrivals.step()
    torch.cuda.synchronize()
    wall, tokens = time.perf_counter() - began, arrivals.tokens() - tokens
    lines = [f"{steps} steps in {1e3 * wall:.1f} ms: {tokens} output tokens, **{tokens / wall:.1f} tok/s**", "",
             "| kind | steps | mean host ms |", "|---|---:|---:|"]
    for kind, n, t in engine.step_log.totals():
        n, t = n - before[kind][0], t - before[kind][1]
        if n:
            lines.append(f"| {kind} | {n} | {1e3 * t / n:.3f} |")
    return lines


def syncs(engine: Engine, steps: int, step=None) -> list[str]:
    """The source lines (moeplex's own frame nearest the call) of every synchronizing call in `steps` steps."""
    seen: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "moeplex" in f.filename or "/core/" in f.filename]
        where = f"{frames[-1].filename}:{frames[-1].lineno} {frames[-1].line}" if frames else f"{filename}:{lineno}"
        seen[where] = seen.get(where, 0) + 1

    torch.cuda.set_sync_debug_mode("warn")
    old, warnings.showwarning = warnings.showwarning, record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            for _ in range(steps):
                (step or engine.step)()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = old
    return [f"- {count}x {where}" for where, count in sorted(seen.items(), key=lambda kv: -kv[1])]


def host_profile(engine: Engine, steps: int, step=None) -> str:
    profiler = cProfile.Profile()
    began = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        (step or engine.step)()
    profiler.disable()
    elapsed = (time.perf_counter() - began) / steps * 1e3
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(25)
    return f"{elapsed:.3f} ms per step under cProfile\n\n```\n{text.getvalue()}\n```"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--admit-every", type=int, default=0, help="a new request every K steps (default: none)")
    parser.add_argument("--prompt-len", type=int, default=97, help="prompt tokens of each new request")
    parser.add_argument("--disable-prompt-graphs", action="store_true", help="engine flag: prompt steps eagerly")
    parser.add_argument("--mixed-chunk", choices=("auto", "on", "off"), default="auto",
                        help="engine flag: whether prompt chunks and decodes share a step")
    parser.add_argument("--out")
    args = parser.parse_args()
    folder = write_checkpoint(tempfile.mkdtemp(), "qwen3_moe", "30b-a3b", config_only=True,
                              overrides={"num_hidden_layers": args.layers})
    config = EngineConfig(model=folder, device="cuda", dtype="bf16", moe_kernel="triton", load_format="dummy",
                          show_progress=False, max_running_requests=max(args.batch) + 3 * args.steps,
                          max_total_tokens=65536, disable_prompt_graphs=args.disable_prompt_graphs,
                          mixed_chunk={"auto": None, "on": True, "off": False}[args.mixed_chunk])
    engine = Engine(config)
    arriving = (f", a {args.prompt_len}-token request arriving every {args.admit_every} steps" if args.admit_every
                else "")
    lines = [f"## Host time in steady decode ({args.layers}-layer Qwen3-30B-A3B shapes, CUDA graphs, overlap "
             f"schedule{arriving}; prompt graphs {'off' if args.disable_prompt_graphs else 'on'}, "
             f"--mixed-chunk {args.mixed_chunk})", ""]
    for batch in args.batch:
        arrivals = Arrivals(engine, args.admit_every, args.prompt_len, start(engine, batch, 4 * args.steps))
        step = arrivals.step
        found = syncs(engine, args.steps, step)
        lines += [f"### batch {batch}", "", f"Synchronizing calls in {args.steps} steps:", ""]
        lines += found or ["- none"]
        lines += ["", "Steps by kind:", "", *step_kinds(engine, arrivals, args.steps)]
        lines += ["", host_profile(engine, args.steps, step), ""]
        while engine.has_work:
            engine.step()
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
