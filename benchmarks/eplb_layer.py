"""One MoE layer under a Zipf-skewed router, with and without EPLB and redundant experts, on simulated EP ranks.

The router picks each token's top-k experts from a Zipf law (hot experts at random positions). A
calibration batch is recorded with the engine's LoadRecorder, the balancer places the experts, and
the engine's ReplicaSelector maps an evaluation batch (another seed) to physical slots. Each
simulated rank then computes its local experts on the tokens it received (SiLU-gated MLPs in torch,
one thread); the layer takes as long as its slowest rank. Reported per placement:

  max-rank tokens   (token, expert) pairs on the busiest rank
  balancedness      mean rank tokens / max rank tokens (1.0 is perfect)
  layer time        max over ranks of the local expert compute (best of --repeats)
  vs static         static placement's layer time / this layer time (the reference, same run)
  vs balanced       the perfectly balanced time (mean over ranks of the compute) / this layer time

    python benchmarks/eplb_layer.py [--experts 64] [--ranks 8] [--redundant 16] [--tokens 2048] [--out FILE]
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

import torch
import torch.nn.functional as F

from moeplex.interfaces import Placement
from moeplex.config import STAT
from moeplex.moe.recorder import LoadRecorder
from moeplex.config import SPREAD, STATIC
from moeplex.moe.replicas import ReplicaSelector
from moeplex.registry import lookup


NOTE = (
    "Times are the best of --repeats per simulated rank on a shared CPU; token counts and balancedness are exact. "
    "The placement comes from a calibration batch recorded with the engine's LoadRecorder and is measured on "
    "another batch from the same Zipf law."
)


def zipf_router(num_tokens: int, num_experts: int, top_k: int, skew: float, hot_order: torch.Tensor, seed: int):
    """[T, K] distinct expert ids per token, drawn from a Zipf law over the experts ranked by `hot_order`."""
    gen = torch.Generator().manual_seed(seed)
    probs = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** skew
    ranked = torch.multinomial(probs.expand(num_tokens, -1), top_k, replacement=False, generator=gen)
    return hot_order[ranked]


def calibrated_load(args, skew: float, hot_order: torch.Tensor) -> torch.Tensor:
    """[1, E] load recorded from a calibration batch, as the engine records it."""
    recorder = LoadRecorder(1, args.experts, torch.device("cpu"))
    recorder.start(STAT)
    recorder.record(0, zipf_router(args.tokens * 4, args.experts, args.top_k, skew, hot_order, seed=1))
    recorder.end_step()
    return recorder.total()


class SimulatedLayer:
    """Per logical expert weights, and the slot-by-slot compute of one rank."""

    def __init__(self, args):
        gen = torch.Generator().manual_seed(0)
        hidden, inter = args.hidden, args.intermediate
        self.w13 = torch.randn(args.experts, 2 * inter, hidden, generator=gen) / hidden**0.5
        self.w2 = torch.randn(args.experts, hidden, inter, generator=gen) / inter**0.5
        self.x = torch.randn(args.tokens, hidden, generator=gen)

    def rank_time(self, slots: list[tuple[int, torch.Tensor]], repeats: int) -> float:
        """Best wall time of one rank computing its slots: (logical expert, token rows) each."""
        times = []
        for _ in range(repeats + 1):
            out = torch.zeros_like(self.x)
            start = time.perf_counter()
            for expert, rows in slots:
                if rows.numel():
                    gate, up = F.linear(self.x[rows], self.w13[expert]).chunk(2, dim=-1)
                    out.index_add_(0, rows, F.linear(F.silu(gate) * up, self.w2[expert]))
            times.append(time.perf_counter() - start)
        return min(times[1:])  # the first run warms up


def measure(layer: SimulatedLayer, placement: Placement, algorithm: str, logical_ids: torch.Tensor, args) -> dict:
    physical = ReplicaSelector(placement, torch.device("cpu"), algorithm)(0, logical_ids)
    per_rank = placement.num_physical // args.ranks
    tokens = torch.arange(logical_ids.shape[0]).unsqueeze(1).expand_as(physical)
    rank_tokens, rank_times = [], []
    for rank in range(args.ranks):
        slots = []
        for slot in range(rank * per_rank, (rank + 1) * per_rank):
            slots.append((int(placement.phy2log[0, slot]), tokens[physical == slot]))
        rank_tokens.append(sum(rows.numel() for _, rows in slots))
        rank_times.append(layer.rank_time(slots, args.repeats))
    return {
        "max_tokens": max(rank_tokens),
        "balancedness": sum(rank_tokens) / len(rank_tokens) / max(rank_tokens),
        "time": max(rank_times),
        "balanced_time": sum(rank_times) / len(rank_times),
    }


def placements(args, load: torch.Tensor) -> list[tuple[str, Placement, str]]:
    """(label, placement, dispatch algorithm) of every row; static without redundancy is the reference."""
    plan = lambda name, slots: lookup("balancer", name)().rebalance(load, slots, args.groups, 1, args.ranks)  # noqa: E731
    with_redundant = args.experts + args.redundant
    return [
        ("static, no redundant", plan("static", args.experts), STATIC),
        ("eplb, no redundant", plan("eplb", args.experts), STATIC),
        (f"eplb, {args.redundant} redundant, static dispatch", plan("eplb", with_redundant), STATIC),
        (f"eplb, {args.redundant} redundant, spread dispatch", plan("eplb", with_redundant), SPREAD),
        (f"eplb-vec, {args.redundant} redundant, spread dispatch", plan("eplb-vec", with_redundant), SPREAD),
    ]


def table(args) -> str:
    layer = SimulatedLayer(args)
    lines = [
        f"MoE layer: {args.experts} experts, top-{args.top_k}, hidden {args.hidden}, intermediate {args.intermediate}, "
        f"{args.tokens} tokens, {args.ranks} simulated EP ranks (CPU, {torch.get_num_threads()} thread)",
        "",
        "| Zipf skew | placement | max-rank tokens | balancedness | layer time (ms) | vs static | vs balanced |",
        "|---|---|---|---|---|---|---|",
    ]
    for skew in args.skews:
        hot_order = torch.randperm(args.experts, generator=torch.Generator().manual_seed(2))
        load = calibrated_load(args, skew, hot_order)
        logical_ids = zipf_router(args.tokens, args.experts, args.top_k, skew, hot_order, seed=3)
        reference = None
        for label, placement, algorithm in placements(args, load):
            row = measure(layer, placement, algorithm, logical_ids, args)
            reference = reference or row["time"]
            lines.append(
                f"| {skew} | {label} | {row['max_tokens']} | {row['balancedness']:.3f} | {row['time'] * 1e3:.1f} | "
                f"{reference / row['time']:.2f}x | {row['balanced_time'] / row['time']:.2f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=64, help="logical experts (default: 64)")
    parser.add_argument("--groups", type=int, default=8, help="expert groups for hierarchical EPLB (default: 8)")
    parser.add_argument("--top-k", type=int, default=8, help="experts per token (default: 8)")
    parser.add_argument("--ranks", type=int, default=8, help="simulated EP ranks (default: 8)")
    parser.add_argument("--redundant", type=int, default=16, help="redundant slots when on (default: 16)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens in the measured batch (default: 2048)")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size (default: 512)")
    parser.add_argument("--intermediate", type=int, default=256, help="expert intermediate size (default: 256)")
    parser.add_argument("--skews", type=float, nargs="+", default=[0.8, 1.2], help="Zipf exponents (default: 0.8 1.2)")
    parser.add_argument("--repeats", type=int, default=3, help="timings per rank; the fastest counts (default: 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads, as one GPU per rank (default: 1)")
    parser.add_argument("--out", help="also write the table to this Markdown file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    text = table(args)
    print(text)
    if args.out:
        command = shlex.join(["python", "benchmarks/eplb_layer.py", *sys.argv[1:]])
        with open(args.out, "w") as f:
            f.write(f"# One MoE layer under EPLB, redundant experts on and off\n\n`{command}`\n\n{NOTE}\n\n{text}\n")


if __name__ == "__main__":
    main()
