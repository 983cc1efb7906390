"""`moeplex serve` profiled: its front end's event loop sampled, rank 0's process under cProfile.

    python benchmarks/profiled_serve.py DIR serve --model M ...     (benchmarks/serving.py --profile DIR runs it)

The front end is sampled rather than traced: cProfile charges a coroutine's waits to whatever resumes it, and
traces every call of the per-token path at several times its cost. A thread reads the event loop thread's stack
every SAMPLE_S; DIR/frontend.txt lists the functions by the share of samples they were running in (own and
inclusive) and DIR/frontend_stacks.txt the collapsed stacks (py-spy's raw format). Rank 0 runs one engine round
at a time in plain calls: DIR/rank0.prof is its cProfile, DIR/rank0.txt the top functions by own and cumulative
time. Both are written when the server stops. The reader thread of the front end (it only receives) is not sampled.
"""

from __future__ import annotations

import collections
import cProfile
import functools
import io
import os
import pstats
import sys
import threading
import time

from moeplex.cli import main
from moeplex.server import processes

SERVE_ON_RANK = processes.serve_on_rank
TOP = 45
SAMPLE_S = 0.001


def write_profile(profiler: cProfile.Profile, folder: str, name: str) -> None:
    os.makedirs(folder, exist_ok=True)
    profiler.dump_stats(os.path.join(folder, f"{name}.prof"))
    text = io.StringIO()
    for order in ("tottime", "cumulative"):
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(TOP)
    with open(os.path.join(folder, f"{name}.txt"), "w") as f:
        f.write(text.getvalue())


def profiled_serve_on_rank(folder: str, rank: int, *args) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        SERVE_ON_RANK(rank, *args)
    finally:
        profiler.disable()
        write_profile(profiler, folder, f"rank{rank}")


class StackSampler:
    """Collapsed stacks of one thread, read every SAMPLE_S from another (idle waits in the selector included)."""

    def __init__(self, thread_id: int):
        self.thread_id = thread_id
        self.stacks: collections.Counter[str] = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            frame = sys._current_frames().get(self.thread_id)
            names = []
            while frame is not None:
                code = frame.f_code
                names.append(f"{code.co_name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})")
                frame = frame.f_back
            self.stacks[";".join(reversed(names))] += 1

    def write(self, folder: str, name: str) -> None:
        self._stop.set()
        self._thread.join()
        os.makedirs(folder, exist_ok=True)
        total = sum(self.stacks.values()) or 1
        own: collections.Counter[str] = collections.Counter()
        inclusive: collections.Counter[str] = collections.Counter()
        for stack, count in self.stacks.items():
            frames = [f.rsplit(":", 1)[0] for f in stack.split(";")]  # by function, not line
            own[frames[-1]] += count
            for frame in set(frames):
                inclusive[frame] += count
        lines = [f"{total} samples, one every {SAMPLE_S * 1e3:g} ms", "", "own %  function"]
        lines += [f"{100 * n / total:5.1f}  {f}" for f, n in own.most_common(TOP)]
        lines += ["", "inclusive %  function"] + [f"{100 * n / total:5.1f}  {f}" for f, n in inclusive.most_common(TOP)]
        with open(os.path.join(folder, f"{name}.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.join(folder, f"{name}_stacks.txt"), "w") as f:
            f.writelines(f"{stack} {count}\n" for stack, count in self.stacks.most_common())


def run(folder: str, argv: list[str]) -> int:
    processes.serve_on_rank = functools.partial(profiled_serve_on_rank, folder)  # pickled by reference to the ranks
    sampler = StackSampler(threading.get_ident())
    started = time.monotonic()
    try:
        return main(argv)
    finally:
        sampler.write(folder, "frontend")
        print(f"profiled_serve: front end sampled for {time.monotonic() - started:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(run(os.path.abspath(sys.argv[1]), sys.argv[2:]))
