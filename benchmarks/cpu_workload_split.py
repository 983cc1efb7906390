"""Where the offline workload's CPU time goes: prefill steps against decode steps (issue 22, target 6).

Runs the requests of `mixed_workload(N)` (as `offline_throughput.py --num-requests N` does: greedy, each
asking for its own length, the same scheduler limits) to the end with one torch thread and reports the
calling thread's CPU time (time descheduled by other jobs on a shared machine is not counted) for the
whole run and inside the model forward, split by step kind (prefill/extend steps, decode steps).

    python benchmarks/cpu_workload_split.py --model DIR --dtype bf16
    PYTHONPATH=<an older build's export> python benchmarks/cpu_workload_split.py --model DIR ...   # before/after
"""

from __future__ import annotations

import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import mixed_workload  # noqa: E402

from cpu_engine import one_thread_engine, parser  # noqa: E402

from moeplex.sampling import SamplingParams  # noqa: E402


def main() -> None:
    p = parser(__doc__, 48, "requests of mixed_workload(N)")
    args = p.parse_args()
    engine = one_thread_engine(args.model, args.dtype)
    work = mixed_workload(args.num_requests)
    for prompt, new_tokens in work:
        engine.add_request(prompt, SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    cpu, steps = collections.defaultdict(float), collections.Counter()
    forward = engine.runner.forward

    def timed(batch):
        start = time.thread_time()
        out = forward(batch)
        kind = batch.mode.name.lower()
        cpu[kind] += time.thread_time() - start
        steps[kind] += 1
        return out

    engine.runner.forward = timed
    start, wall = time.thread_time(), time.perf_counter()
    while engine.has_work:
        engine.step()
    total, wall = time.thread_time() - start, time.perf_counter() - wall
    tokens = sum(n for _, n in work)
    name = os.path.basename(os.path.normpath(args.model))
    parts = ", ".join(f"{kind} forward {cpu[kind]:.2f} s in {steps[kind]} steps" for kind in sorted(cpu))
    print(f"{name} {args.dtype}, {args.num_requests} requests, {tokens} tokens: {total:.2f} CPU s "
          f"({tokens / total:.0f} tok per CPU s), {wall:.2f} wall s; {parts}")


if __name__ == "__main__":
    main()
