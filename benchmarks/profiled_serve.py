"""`moeplex serve` under cProfile: its front end's main thread (the event loop) and rank 0's process.

    python benchmarks/profiled_serve.py DIR serve --model M ...     (benchmarks/serving.py --cprofile DIR runs it)

When the server stops, DIR/frontend.prof and DIR/rank0.prof hold the raw profiles and DIR/frontend.txt and
DIR/rank0.txt the top functions by own time and by cumulative time. Other threads of the front end (the one
that receives the leader's reports) are not profiled: compare the process's CPU time with the profile's total.
"""

from __future__ import annotations

import cProfile
import functools
import io
import os
import pstats
import sys

from moeplex.cli import main
from moeplex.server import processes

SERVE_ON_RANK = processes.serve_on_rank
TOP = 45


def write(profiler: cProfile.Profile, folder: str, name: str) -> None:
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
        write(profiler, folder, f"rank{rank}")


def run(folder: str, argv: list[str]) -> int:
    processes.serve_on_rank = functools.partial(profiled_serve_on_rank, folder)  # pickled by reference to the ranks
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        return main(argv)
    finally:
        profiler.disable()
        write(profiler, folder, "frontend")


if __name__ == "__main__":
    sys.exit(run(os.path.abspath(sys.argv[1]), sys.argv[2:]))
