"""Host time per step of the offline engine against the served one, by phase, on the same workload and model.

    python benchmarks/offline_host_profile.py [--arch deepseek_v3] [--num-requests 256] [--runs 3] [--out FILE]
    python benchmarks/offline_host_profile.py --device cuda --dtype bf16      # one GPU: CUDA graphs, warmed up as serve

Offline is `Engine.generate` (what `moeplex generate` runs): every request handed over at once. Served is rank 0 of
`moeplex serve` as its leader runs it (ranks/leader.py: the front end's commands taken, EngineGroup.step, the
RoundReport built, pickled and written to a pipe), fed by a process that plays the clients: --concurrency requests
at first, then a new one (the next of the workload) for each that a report says finished. Both engines get the same
flags; by default the schedule of a CUDA engine (--schedule gpu: the overlap schedule on, prompts and decodes in
separate steps, as where decode steps replay CUDA graphs), so that the CPU shows the host work an H200 would see.

Each phase is CPU time of the thread that runs the steps (immune to a shared machine's other processes), summed
over the run and divided by the steps: the scheduler, the batch build, the model forward (on a CPU the compute
itself; on a GPU the launches), sampling, reading a step's tokens into its requests (detokenizing, stop checks,
freeing finished ones), the rest of Engine.step, and what the loop around the steps does (offline: generate's own
loop; served: the leader's commands, reports, pickling and pipe writes). Printed: the median and min-max over
--runs runs of each (alternating which side goes first), the wall ms per step (on a shared machine mostly the
neighbours; served, also the clients' turn), one forward's ms by mode (on a GPU prompt steps run eagerly, decode
steps replay graphs) and the steps of each kind, and whether both sides produced the same token ids.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import pickle
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from report import emit, processor  # noqa: E402
from serving import model_folder  # noqa: E402
from workload import mixed_workload  # noqa: E402

PHASES = ("schedule", "batch build", "forward", "sample", "read tokens", "rest of the step", "around the steps")


def params(n: int):
    from moeplex.sampling import SamplingParams

    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


class PhaseClock:
    """Wraps the engine's parts on the instance so each call's thread CPU time lands in its phase."""

    def __init__(self, engine):
        self.spent = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self.modes = {"extend": [0.0, 0], "decode": [0.0, 0]}  # forward seconds and calls: eager prompts, decode graphs
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.runner, "prepare", "batch build")
        self._wrap_forward(engine.runner)
        self._wrap(engine.sampler, "sample", "sample")
        self._wrap(engine, "_complete", "read tokens")
        self._wrap(engine, "step", "rest of the step", inclusive=True)

    def _wrap(self, owner, name: str, phase: str, inclusive: bool = False) -> None:
        inner, spent = getattr(owner, name), self.spent

        def timed(*args, **kwargs):
            others = sum(spent.values())
            began = time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                took = time.thread_time() - began
                if inclusive:  # the step: what its timed parts did not take
                    self.steps += 1
                    spent[phase] += took - (sum(spent.values()) - others)
                else:
                    spent[phase] += took

        setattr(owner, name, timed)

    def _wrap_forward(self, runner) -> None:
        inner = runner.forward

        def timed(batch, *args, **kwargs):
            began = time.thread_time()
            try:
                return inner(batch, *args, **kwargs)
            finally:
                took = time.thread_time() - began
                self.spent["forward"] += took
                mode = self.modes["extend" if batch.mode.is_extend else "decode"]
                mode[0] += took
                mode[1] += 1

        runner.forward = timed

    def by_mode(self) -> dict[str, float]:
        """ms of one forward of each mode, and how many prompt (extend) steps there were."""
        return {"forward, one extend step": 1e3 * self.modes["extend"][0] / max(self.modes["extend"][1], 1),
                "forward, one decode step": 1e3 * self.modes["decode"][0] / max(self.modes["decode"][1], 1),
                "extend steps": self.modes["extend"][1]}

    def around(self, total: float) -> dict[str, float]:
        """ms per step of each phase, `total` being the loop's CPU seconds."""
        self.spent["around the steps"] = total - sum(v for k, v in self.spent.items() if k != "around the steps")
        return {phase: 1e3 * seconds / max(self.steps, 1) for phase, seconds in self.spent.items()}


def make_engine(args, folder: str):
    from moeplex.config import EngineConfig
    from moeplex.engine import Engine
    from moeplex.ranks.group import EngineGroup
    from moeplex.ranks.warmup import warm_up

    gpu = args.schedule == "gpu"
    device = {name: getattr(args, name) for name in ("device", "dtype", "load_format", "max_total_tokens") if getattr(args, name)}
    engine = Engine(EngineConfig(
        model=folder, show_progress=False, max_running_requests=args.concurrency, max_batched_tokens=args.max_batched_tokens,
        chunked_prefill_size=args.chunked_prefill_size, overlap_schedule=True if gpu else None,
        mixed_chunk=False if gpu else None, **device,
    ))
    if engine.device.type == "cuda":
        warm_up(EngineGroup(engine))  # as `moeplex serve` does
    engine.generate([p for p, _ in args.work[:8]], [params(4)] * 8)  # warm-up: first calls of every path
    return engine


def synchronize(engine) -> None:
    if engine.device.type == "cuda":
        import torch

        torch.cuda.synchronize()


def offline(args, folder: str) -> tuple[dict, list[list[int]]]:
    engine = make_engine(args, folder)
    clock = PhaseClock(engine)
    began, wall = time.thread_time(), time.perf_counter()
    requests = engine.generate([p for p, _ in args.work], [params(n) for _, n in args.work])
    synchronize(engine)
    wall = time.perf_counter() - wall
    ms = clock.around(time.thread_time() - began)
    return {**ms, **clock.by_mode(), "steps": clock.steps, "wall": 1e3 * wall / clock.steps}, [list(r.output_ids) for r in requests]


def clients(connection, work, concurrency: int) -> None:
    """The load generator and front end in one: Admits as clients would send them, one new request per finished one;
    the output ids of every request back at the end."""
    from moeplex.messages import Admit, Round

    sent, outputs = 0, {}

    def admit(count: int) -> Round:
        nonlocal sent
        admits = tuple(Admit(str(i), tuple(work[i][0]), params(work[i][1])) for i in range(sent, min(sent + count, len(work))))
        sent += len(admits)
        return Round(admits)

    connection.send(admit(concurrency))
    done = 0
    while done < len(work):
        report = pickle.loads(connection.recv_bytes())
        finished = 0
        for updates in report.updates:
            for rid, ids in updates.new_ids():
                outputs.setdefault(rid, []).extend(ids)
            finished += len(updates.finished())
        done += finished
        if finished and sent < len(work):
            connection.send(admit(finished))
    connection.send([outputs[str(i)] for i in range(len(work))])


def served(args, folder: str) -> tuple[dict, list[list[int]]]:
    from moeplex.ranks.group import EngineGroup
    from moeplex.ranks.leader import Leader

    engine = make_engine(args, folder)
    context = multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    front = context.Process(target=clients, args=(there, args.work, args.concurrency), daemon=True)
    front.start()
    group = EngineGroup(engine)
    leader = Leader(group, here)
    here.poll(None)  # the clients' first requests: their process has started
    clock = PhaseClock(engine)
    began, wall = time.thread_time(), time.perf_counter()
    while group.admitted[0] < len(args.work) or group.needs_round:  # Leader.run's loop, until all were answered
        leader._take_commands(block=not group.needs_round)
        if group.needs_round:
            leader._round()
    synchronize(engine)
    wall = time.perf_counter() - wall
    ms = clock.around(time.thread_time() - began)
    outputs = here.recv()
    front.join(10)
    return {**ms, **clock.by_mode(), "steps": clock.steps, "wall": 1e3 * wall / clock.steps}, outputs


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def row(name: str, offline: list[float], served: list[float]) -> str:
    return f"| {name} | {spread(offline)} | {spread(served)} | {statistics.median(offline) - statistics.median(served):+.3f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: a checkpoint of --arch/--preset written here)")
    parser.add_argument("--arch", default="deepseek_v3", choices=("deepseek_v3", "qwen3_moe", "mixtral"))
    parser.add_argument("--preset", default="tiny", help="tiny, small, or a released shape (needs --load-format dummy)")
    parser.add_argument("--layers", type=int, help="without --model: num_hidden_layers of the written config")
    parser.add_argument("--device", help="engine flag (default: cpu)")
    parser.add_argument("--dtype", help="engine flag (default: the config's, fp32)")
    parser.add_argument("--load-format", help="engine flag: dummy for --model folders written without weights")
    parser.add_argument("--max-total-tokens", type=int, help="engine flag (KV cache tokens)")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64, help="served clients, and both engines' "
                        "--max-running-requests (default: 64)")
    parser.add_argument("--max-batched-tokens", type=int, default=4096, help="as benchmarks/serving.py (default: 4096)")
    parser.add_argument("--chunked-prefill-size", type=int, default=1024, help="as benchmarks/serving.py (default: 1024)")
    parser.add_argument("--schedule", choices=("gpu", "cpu"), default="gpu", help="gpu: a CUDA engine's schedule (overlap "
                        "on, prompts in steps of their own); cpu: this device's defaults (default: gpu)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: 1 on a CPU device; on a GPU, "
                        "torch's own choice, as a served rank's)")
    parser.add_argument("--out", metavar="FILE", help="also write the Markdown to FILE")
    args = parser.parse_args()
    import torch

    if args.threads or not (args.device or "cpu").startswith("cuda"):
        torch.set_num_threads(args.threads or 1)
    folder = model_folder(args)
    args.work = mixed_workload(args.num_requests)
    runs = {"offline": [], "served": []}
    same = True
    for run in range(args.runs):
        order = ("offline", "served") if run % 2 == 0 else ("served", "offline")
        ids = {}
        for side in order:
            ms, ids[side] = (offline if side == "offline" else served)(args, folder)
            runs[side].append(ms)
            gc.collect()  # the side's engine (its KV pool and graphs) goes before the next is built
        same = same and ids["offline"] == ids["served"]
    lines = [f"{args.num_requests} requests (benchmarks/workload.py), concurrency {args.concurrency}, {args.schedule} "
             f"schedule, {args.model or f'{args.arch} {args.preset}'}{f', {args.layers} layers' if args.layers else ''}, "
             f"{processor()}; CPU ms per step of the stepping thread, median (min-max) of {args.runs} runs", "",
             "| phase | offline | served | offline - served |", "|---|---|---|---|"]
    for phase in PHASES:
        lines.append(row(phase, [r[phase] for r in runs["offline"]], [r[phase] for r in runs["served"]]))
    host = {side: [sum(r[p] for p in PHASES if p != "forward") for r in rs] for side, rs in runs.items()}
    lines.append(f"| **host, all but the forward** | **{spread(host['offline'])}** | **{spread(host['served'])}** | "
                 f"**{statistics.median(host['offline']) - statistics.median(host['served']):+.3f}** |")
    lines.append(row("wall ms per step", [r["wall"] for r in runs["offline"]], [r["wall"] for r in runs["served"]]))
    for name in ("forward, one extend step", "forward, one decode step"):
        lines.append(row(name, [r[name] for r in runs["offline"]], [r[name] for r in runs["served"]]))
    for name in ("steps", "extend steps"):
        counts = [statistics.median(r[name] for r in runs[side]) for side in ("offline", "served")]
        lines.append(f"| {name} | {counts[0]:.0f} | {counts[1]:.0f} | {counts[0] - counts[1]:+.0f} |")
    lines += ["", f"token ids of every request identical offline and served: {'yes' if same else 'NO'}"]
    emit("\n".join(lines), args.out)
    if not same:
        raise SystemExit("offline and served token ids differ")


if __name__ == "__main__":
    main()
