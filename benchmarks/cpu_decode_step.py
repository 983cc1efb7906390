"""CPU time of one decode step on CPU, a figure that other jobs on a shared machine barely move.

Starts N requests of `mixed_workload(N)` (each asking for --new-tokens, so none finishes early), runs
--warm-steps engine steps (prefill and first decodes), then times --steps decode steps with one torch
thread: the calling thread's CPU time (the ops run on it; time spent descheduled is not counted) and
the wall time, both per step.

    python benchmarks/cpu_decode_step.py --model DIR --dtype bf16 --num-requests 32
    PYTHONPATH=<an older build's export> python benchmarks/cpu_decode_step.py --model DIR ...   # before/after
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import mixed_workload  # noqa: E402

from cpu_engine import one_thread_engine, parser  # noqa: E402

from moeplex.sampling import SamplingParams  # noqa: E402


def main() -> None:
    p = parser(__doc__, 32, "requests decoding together")
    p.add_argument("--new-tokens", type=int, default=400, help="tokens each request asks for")
    p.add_argument("--warm-steps", type=int, default=4, help="untimed steps first (prefill, first decodes)")
    p.add_argument("--steps", type=int, default=30, help="timed decode steps")
    args = p.parse_args()
    engine = one_thread_engine(args.model, args.dtype)
    for prompt, _ in mixed_workload(args.num_requests):
        engine.add_request(prompt, SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True))
    for _ in range(args.warm_steps):
        engine.step()
    cpu, wall = time.thread_time(), time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    cpu, wall = (time.thread_time() - cpu) / args.steps, (time.perf_counter() - wall) / args.steps
    print(f"{os.path.basename(os.path.normpath(args.model))} {args.dtype}, {args.num_requests} requests: "
          f"{1e3 * cpu:.1f} CPU ms / decode step, {1e3 * wall:.1f} wall ms")


if __name__ == "__main__":
    main()
