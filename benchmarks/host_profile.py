"""Where the host spends its time in steady decode, and which calls make it wait for the GPU.

    python benchmarks/host_profile.py [--batch 1 64] [--steps 30] [--out FILE]

A Qwen3-30B-A3B-shaped model cut to a few layers (random weights on the device) decodes with
CUDA graphs and the overlap schedule. Under torch.cuda.set_sync_debug_mode("warn") every call that
makes the host wait for the GPU is reported with the line that made it: in steady decode there
should be none but the read of the previous step's tokens (an event wait, which the mode does not
flag). cProfile then lists the host functions of the same steps by their cumulative time.
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


def start(engine: Engine, batch: int, steps: int) -> None:
    """Admit `batch` requests and run until they all decode."""
    rng = random.Random(batch)
    params = SamplingParams(max_new_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(256) for _ in range(64)], params)
    for _ in range(4):
        engine.step()
    torch.cuda.synchronize()


def syncs(engine: Engine, steps: int) -> list[str]:
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
                engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = old
    return [f"- {count}x {where}" for where, count in sorted(seen.items(), key=lambda kv: -kv[1])]


def host_profile(engine: Engine, steps: int) -> str:
    profiler = cProfile.Profile()
    began = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        engine.step()
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
    parser.add_argument("--out")
    args = parser.parse_args()
    folder = write_checkpoint(tempfile.mkdtemp(), "qwen3_moe", "30b-a3b", config_only=True,
                              overrides={"num_hidden_layers": args.layers})
    config = EngineConfig(model=folder, device="cuda", dtype="bf16", moe_kernel="triton", load_format="dummy",
                          show_progress=False, max_running_requests=max(args.batch), max_total_tokens=65536)
    engine = Engine(config)
    lines = [f"## Host time in steady decode ({args.layers}-layer Qwen3-30B-A3B shapes, CUDA graphs, overlap schedule)", ""]
    for batch in args.batch:
        start(engine, batch, 2 * args.steps)
        found = syncs(engine, args.steps)
        lines += [f"### batch {batch}", "", f"Synchronizing calls in {args.steps} steps:", ""]
        lines += found or ["- none"]
        lines += ["", host_profile(engine, args.steps), ""]
        while engine.has_work:
            engine.step()
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
