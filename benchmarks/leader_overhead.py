"""What a served engine's rank 0 does per round besides the engine step, in CPU time (immune to a shared machine's load).

    python benchmarks/leader_overhead.py [--arch deepseek_v3] [--layers N] [--requests 64] [--rounds 200] [--runs 3]
                                         [--max-new-tokens N]

`requests` requests decode on one EngineGroup (the served engine's rank 0, ranks/group.py); each round is what the
leader (ranks/leader.py) does: the front end's commands taken, the group's step (the engine step, then the
per-request updates and the group's bookkeeping), the leader's RoundReport built, pickled and written to a pipe that
another process reads, as the front end's reader thread does. Without --max-new-tokens no request finishes; with it,
that process answers each finished request with a new one (an Admit), as a served run's clients do. Printed per run: the engine step's CPU ms and each other part's, and their share.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import pickle
import random
import statistics
import sys
import tempfile
import time


def prompt(rng: random.Random) -> tuple[int, ...]:
    return (256,) + tuple(rng.randrange(256) for _ in range(100))


def front_end(connection, max_new_tokens: int | None) -> None:
    """Reads every report as the front end's reader thread does; with `max_new_tokens`, answers each request that
    finished with a new one (an Admit in a Round), as the clients of a served run do."""
    from moeplex.messages import Admit, Round
    from moeplex.sampling import SamplingParams

    rng, count = random.Random(1), itertools.count()
    params = SamplingParams(max_new_tokens=max_new_tokens or 1 << 30, temperature=0.0, ignore_eos=True)
    try:
        while True:
            report = pickle.loads(connection.recv_bytes())
            if max_new_tokens is None:
                continue
            # (a RequestUpdate each on a core from before the Updates message: this benchmark measures both)
            finished = sum(len(u.ends) if hasattr(u, "ends") else u.finish_reason is not None for u in report.updates)
            if finished:
                admits = tuple(Admit(f"new-{next(count):028x}", prompt(rng), params) for _ in range(finished))
                connection.send(Round(admits))
    except EOFError:
        pass


def round_report(leader, group, reports, steps: int):
    """The leader's report of a round (built inline, as the leader did, on a core from before Leader.report)."""
    if hasattr(leader, "report"):
        return leader.report(reports)
    from moeplex.messages import LoopStats, RoundReport

    return RoundReport(tuple(u for r in reports for u in r.updates), (), (),
                       LoopStats(tuple(group.stats), tuple(group.admitted), steps, 0))


def one_run(args, folder: str) -> dict[str, float]:
    from moeplex.config import EngineConfig
    from moeplex.engine import Engine
    from moeplex.ranks.group import EngineGroup
    from moeplex.ranks.leader import Leader
    from moeplex.sampling import SamplingParams

    context = multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    reader = context.Process(target=front_end, args=(there, args.max_new_tokens), daemon=True)
    reader.start()
    engine = Engine(EngineConfig(model=folder, show_progress=False, max_running_requests=args.requests))
    group = EngineGroup(engine)
    leader = Leader(group, here)
    rng = random.Random(0)
    for i in range(args.requests):  # staggered, so that with --max-new-tokens some finish in every few rounds
        limit = args.max_new_tokens + i * args.max_new_tokens // args.requests if args.max_new_tokens else 1 << 30
        params = SamplingParams(max_new_tokens=limit, temperature=0.0, ignore_eos=True)
        group.add_request(prompt(rng), params, rid=f"{i:032x}-0")
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
    parts = ("commands taken", "updates and bookkeeping", "report built", "pickled", "pipe write")
    spent.update({part: 0.0 for part in parts})
    for steps in range(1, args.rounds + 1):
        t0 = time.thread_time()
        leader._take_commands(block=False)
        t1 = time.thread_time()
        reports = group.step()
        t2 = time.thread_time()
        report = round_report(leader, group, reports, steps)
        t3 = time.thread_time()
        data = pickle.dumps(report, pickle.HIGHEST_PROTOCOL)
        t4 = time.thread_time()
        here.send_bytes(data)
        t5 = time.thread_time()
        for part, seconds in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
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
    parser.add_argument("--max-new-tokens", type=int, help="requests finish after this many tokens (staggered, up to "
                        "twice as many) and a new one is admitted for each (default: none finish)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1)")
    args = parser.parse_args()
    import torch

    from moeplex.models.make_model import write_checkpoint

    torch.set_num_threads(args.threads)
    folder = args.model or write_checkpoint(tempfile.mkdtemp(), args.arch, "tiny", seed=0,
                                            overrides={"num_hidden_layers": args.layers} if args.layers else None)
    runs = [one_run(args, folder) for _ in range(args.runs)]
    churn = f", each finishing after {args.max_new_tokens}-{2 * args.max_new_tokens} tokens" if args.max_new_tokens else ""
    print(f"\n{args.requests} running requests{churn}, {args.rounds} rounds a run, CPU ms per round, median (min-max) of "
          f"{args.runs} runs\n")
    print("| part | CPU ms per round | share of the round |\n|---|---|---|")
    total = [sum(run.values()) for run in runs]
    for part in runs[0]:
        ms = [run[part] for run in runs]
        share = [100 * run[part] / t for run, t in zip(runs, total)]
        print(f"| {part} | {statistics.median(ms):.3f} ({min(ms):.3f}-{max(ms):.3f}) | {statistics.median(share):.1f}% |")


if __name__ == "__main__":
    sys.exit(main())
