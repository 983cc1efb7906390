"""Time `eplb` (per-layer reference) against `eplb-vec` (vectorized) on DeepSeek-V3 shapes.

Prints one row per cluster shape: the time of each balancer (best of --repeats), the speed-up of
eplb-vec over eplb measured in the same run, whether both chose the same placement, and the mean
balancedness (mean GPU load / max GPU load) of static and of eplb on a Zipf-skewed expert load.

    python benchmarks/eplb_scaling.py [--layers 61] [--repeats 5] [--skew 1.0] [--threads 1]

A rebalance is pure CPU integer bookkeeping, so there is no hardware roofline to compare with;
the reference for the speed-up is eplb itself.
"""

from __future__ import annotations

import argparse
import time

import torch

from moeplex.registry import discover

NUM_EXPERTS, NUM_GROUPS = 256, 8  # DeepSeek-V3: 256 routed experts in 8 groups
# (label, physical slots, nodes, GPUs); 288 slots need a GPU count dividing 288, hence 32 GPUs.
SHAPES = [
    ("prefill 4x8 GPUs", 288, 4, 32),
    ("8 nodes x 8 GPUs", 320, 8, 64),
    ("32 nodes x 8 GPUs (global)", 512, 32, 256),
    ("decode 40x8, 1 slot/GPU", 320, 40, 320),
]


def zipf_load(num_layers: int, skew: float, seed: int, tokens: int = 1 << 20) -> torch.Tensor:
    """[L, E] token counts from a Zipf law, hot experts at random positions per layer."""
    gen = torch.Generator().manual_seed(seed)
    probs = 1.0 / torch.arange(1, NUM_EXPERTS + 1, dtype=torch.float64) ** skew
    layers = []
    for _ in range(num_layers):
        routed = torch.multinomial(probs, tokens, replacement=True, generator=gen)
        counts = torch.bincount(routed, minlength=NUM_EXPERTS)
        layers.append(counts[torch.randperm(NUM_EXPERTS, generator=gen)])
    return torch.stack(layers)


def best_time(balancer, load, shape, repeats: int):
    """(fastest wall time in seconds, placement) over `repeats` calls."""
    best, placement = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        placement = balancer.rebalance(load, *shape)
        best = min(best, time.perf_counter() - start)
    return best, placement


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=61, help="MoE layers in the load matrix")
    parser.add_argument("--repeats", type=int, default=5, help="calls per balancer; the fastest is reported")
    parser.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of the expert load")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic load")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads; the tensors are small, and one thread avoids pool stalls")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    balancers = {name: discover("balancer")[name].load()() for name in ("static", "eplb", "eplb-vec")}
    load = zipf_load(args.layers, args.skew, args.seed)
    print(f"{args.layers} layers x {NUM_EXPERTS} experts, {NUM_GROUPS} groups, Zipf skew {args.skew}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    header = (
        f"{'cluster':<28} {'slots':>5} {'GPUs':>4} {'eplb ms':>8} {'vec ms':>8} {'speed-up':>8} {'same':>5} "
        f"{'bal static':>10} {'bal eplb':>8} {'bal vec':>8}"
    )
    print(header)
    print("-" * len(header))
    for label, num_physical, num_nodes, num_gpus in SHAPES:
        shape = (num_physical, NUM_GROUPS, num_nodes, num_gpus)
        ref_time, ref = best_time(balancers["eplb"], load, shape, args.repeats)
        vec_time, vec = best_time(balancers["eplb-vec"], load, shape, args.repeats)
        static = balancers["static"].rebalance(load, *shape)
        same = "yes" if torch.equal(ref.phy2log, vec.phy2log) else "NO"
        balance = [p.balancedness(load, num_gpus).mean().item() for p in (static, ref, vec)]
        print(f"{label:<28} {num_physical:>5} {num_gpus:>4} {ref_time * 1e3:>8.1f} {vec_time * 1e3:>8.1f} "
              f"{ref_time / vec_time:>7.1f}x {same:>5} {balance[0]:>10.3f} {balance[1]:>8.3f} {balance[2]:>8.3f}")


if __name__ == "__main__":
    main()
