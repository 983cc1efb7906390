"""What a served engine's rank 0 does per round besides the engine step, in CPU time (immune to a shared machine's load).

    python benchmarks/leader_overhead.py [--arch deepseek_v3] [--layers N] [--requests 64] [--rounds 200] [--runs 3]

`requests` requests decode without end on one EngineGroup (the served engine's rank 0, ranks/group.py); each round
is what the leader (ranks/leader.py) does: the group's step (the engine step, then the per-request updates and the
group's bookkeeping), the leader's RoundReport built, pickled and written to a pipe that another process drains, as the
front end's reader thread does. Printed per run: the engine step's CPU ms and each other part's, and their share.
"""

from __future__ import annotations

import argparse
import multiprocessing
import pickle
import random
import statistics
import sys
import tempfile
import time


def drain(connection) -> None:
    try:
        while True:
            connection.recv_bytes()
    except EOFError:
        pass


def one_run(args, folder: str) -> dict[str, float]:
    from moeplex.config import EngineConfig
    from moeplex.engine import Engine
    from moeplex.ranks.group import EngineGroup
    from moeplex.ranks.leader import Leader
    from moeplex.sampling import SamplingParams

    context = multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    reader = context.Process(target=drain, args=(there,), daemon=True)
    reader.start()
    engine = Engine(EngineConfig(model=folder, show_progress=False, max_running_requests=args.requests))
    group = EngineGroup(engine)
    leader = Leader(group, here)
    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=1 << 30, temperature=0.0, ignore_eos=True)
    for i in range(args.requests):
        group.add_request([256] + [rng.randrange(256) for _ in range(100)], params, rid=f"{i:032x}-0")
    for _ in range(5):
        group.step()
    engine_step, spent = engine.step, {"engine step": 0.0}

    def timed_step():
        began = time.thread_time()
        try:
            return engine_step()
        finally:
            spent["engine step"] += time.thread_time() - began

    engine.step = timed_step
    parts = ("updates and bookkeeping", "report built", "pickled", "pipe write")
    spent.update({part: 0.0 for part in parts})
    for steps in range(1, args.rounds + 1):
        t0 = time.thread_time()
        reports = group.step()
        t1 = time.thread_time()
        report = leader.report(reports)
        t2 = time.thread_time()
        data = pickle.dumps(report)
        t3 = time.thread_time()
        here.send_bytes(data)
        t4 = time.thread_time()
        for part, seconds in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            spent[part] += seconds
    spent["updates and bookkeeping"] -= spent["engine step"]
    here.close()
    reader.join(10)
    return {part: 1e3 * seconds / args.rounds for part, seconds in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: a tiny random checkpoint of --arch written here)")
    parser.add_argument("--arch", default="deepseek_v3", choices=("deepseek_v3", "qwen3_moe", "mixtral"))
    parser.add_argument("--layers", type=int, help="num_hidden_layers of the written checkpoint")
    parser.add_argument("--requests", type=int, default=64, help="running requests (default: 64)")
    parser.add_argument("--rounds", type=int, default=200, help="rounds timed per run (default: 200)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1)")
    args = parser.parse_args()
    import torch

    from moeplex.models.make_model import write_checkpoint

    torch.set_num_threads(args.threads)
    folder = args.model or write_checkpoint(tempfile.mkdtemp(), args.arch, "tiny", seed=0,
                                            overrides={"num_hidden_layers": args.layers} if args.layers else None)
    runs = [one_run(args, folder) for _ in range(args.runs)]
    print(f"\n{args.requests} running requests, {args.rounds} rounds a run, CPU ms per round, median (min-max) of "
          f"{args.runs} runs\n")
    print("| part | CPU ms per round | share of the round |\n|---|---|---|")
    total = [sum(run.values()) for run in runs]
    for part in runs[0]:
        ms = [run[part] for run in runs]
        share = [100 * run[part] / t for run, t in zip(runs, total)]
        print(f"| {part} | {statistics.median(ms):.3f} ({min(ms):.3f}-{max(ms):.3f}) | {statistics.median(share):.1f}% |")


if __name__ == "__main__":
    sys.exit(main())
