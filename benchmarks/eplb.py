"""EPLB placements against DeepSeek's published algorithm, on the same Zipf loads in the same run.

For each cluster shape and policy (hierarchical: 8 expert groups packed onto nodes, replicas stay on
their expert's node; global: one node, one group) it prints the best-of-N wall time and the mean
balancedness (mean GPU load / max GPU load over 61 layers) of:
  naive      experts laid out contiguously, redundant slots repeating experts 0, 1, ...;
  eplb       the per-layer heap implementation;  eplb-vec  the vectorized one;
  deepseek   rebalance_experts from github.com/deepseek-ai/EPLB (eplb.py), imported from
             --reference-dir when given (fetch it yourself; it is never committed here);
  per-expert eplb-vec with every expert its own group: experts, not whole groups, are packed
             onto nodes, so node loads balance; each expert and all its replicas still sit on
             one node (hierarchical rows only; DeepSeek's code given the same input as well).

    git clone https://github.com/deepseek-ai/EPLB third_party/EPLB   # optional, git-ignored
    python benchmarks/eplb.py [--reference-dir third_party/EPLB] [--repeats 3] [--skew 1.0]

Physical slots must divide over the GPUs: 288 does for 32 GPUs; for 64 GPUs it becomes 320 and for
128 GPUs 384 (the next multiple of the GPU count above 288), as benchmarks/eplb_scaling.py does.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import time

import torch

from moeplex.interfaces import Placement
from moeplex.plugins.balancers.replicate_first import ReplicateFirstBalancer
from moeplex.registry import discover

NUM_EXPERTS, NUM_GROUPS = 256, 8  # DeepSeek-V3: 256 routed experts in 8 groups
# (label, physical slots, nodes, GPUs in all)
SHAPES = [
    ("4 nodes x 8 GPUs", 288, 4, 32),
    ("8 nodes x 8 GPUs", 320, 8, 64),
    ("4 nodes x 32 GPUs", 384, 4, 128),
]
NOT_GIVEN = "not given"


def zipf_load(num_layers: int, skew: float, seed: int, tokens: int = 1 << 20) -> torch.Tensor:
    """[L, E] token counts from a Zipf law, hot experts at random positions per layer."""
    gen = torch.Generator().manual_seed(seed)
    probs = 1.0 / torch.arange(1, NUM_EXPERTS + 1, dtype=torch.float64) ** skew
    layers = []
    for _ in range(num_layers):
        counts = torch.bincount(torch.multinomial(probs, tokens, replacement=True, generator=gen), minlength=NUM_EXPERTS)
        layers.append(counts[torch.randperm(NUM_EXPERTS, generator=gen)])
    return torch.stack(layers)


def load_reference(directory: str | None):
    """DeepSeek's `rebalance_experts` from DIR/eplb.py, or None."""
    if directory is None:
        return None
    path = pathlib.Path(directory) / "eplb.py"
    if not path.is_file():
        raise SystemExit(f"--reference-dir {directory} holds no eplb.py (git clone https://github.com/deepseek-ai/EPLB)")
    spec = importlib.util.spec_from_file_location("deepseek_eplb", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.rebalance_experts


def ours(balancer):
    return lambda load, *shape: balancer.rebalance(load, *shape).phy2log


def timed(place, load, shape, repeats: int) -> tuple[float, torch.Tensor]:
    """(fastest wall time in ms, phy2log) over `repeats` calls."""
    best, phy2log = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        phy2log = place(load, *shape)
        best = min(best, time.perf_counter() - start)
    return best * 1e3, phy2log


def balancedness(phy2log: torch.Tensor, load: torch.Tensor, num_gpus: int) -> float:
    placement = Placement.from_phy2log(phy2log, NUM_EXPERTS)
    placement.check(num_gpus)
    return float(placement.balancedness(load, num_gpus).mean())


def measure(places: dict, load: torch.Tensor, shape: tuple, repeats: int) -> dict:
    """name -> (ms, balancedness, phy2log), or None for a missing reference."""
    results = {}
    for name, place in places.items():
        if place is None:
            results[name] = None
            continue
        ms, phy2log = timed(place, load, shape, repeats)
        results[name] = (ms, balancedness(phy2log, load, shape[-1]), phy2log)
    return results


def cell(result, what: str) -> str:
    if result is None:
        return NOT_GIVEN
    return f"{result[0]:.1f}" if what == "ms" else f"{result[1]:.4f}"


def ratio(slow, fast) -> str:
    return NOT_GIVEN if slow is None or fast is None else f"{slow[0] / fast[0]:.1f}x"


def rows(load, places, repeats):
    """One table row per (shape, policy); the per-expert variant only for the hierarchical policy."""
    for label, num_physical, num_nodes, num_gpus in SHAPES:
        for policy, groups, nodes in (("hierarchical", NUM_GROUPS, num_nodes), ("global", 1, 1)):
            shape = (num_physical, groups, nodes, num_gpus)
            result = measure(places, load, shape, repeats)
            if policy == "hierarchical":
                per_expert = (num_physical, NUM_EXPERTS, num_nodes, num_gpus)
                variant = measure({"vec": places["eplb-vec"], "ref": places["deepseek"]}, load, per_expert, repeats)
                variant |= measure({"first": ours(ReplicateFirstBalancer())}, load, shape, repeats)
            else:
                variant = {"vec": None, "ref": None, "first": None}
            first = f"{variant['first'][1]:.4f} ({variant['first'][0]:.0f} ms)" if variant["first"] else "-"
            same = "yes" if torch.equal(result["eplb"][2], result["eplb-vec"][2]) else "NO"
            yield (
                f"| {label} | {num_physical} | {policy} | {cell(result['naive'], 'bal')} "
                f"| {cell(result['eplb'], 'ms')} | {cell(result['eplb-vec'], 'ms')} | {cell(result['deepseek'], 'ms')} "
                f"| {ratio(result['eplb'], result['eplb-vec'])} | {ratio(result['deepseek'], result['eplb-vec'])} | {same} "
                f"| {cell(result['eplb'], 'bal')} | {cell(result['eplb-vec'], 'bal')} | {cell(result['deepseek'], 'bal')} "
                f"| {cell(variant['vec'], 'bal') if variant['vec'] else '-'} "
                f"| {cell(variant['ref'], 'bal') if policy == 'hierarchical' else '-'} | {first} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reference-dir", help="folder holding DeepSeek's eplb.py (default: its columns say 'not given')")
    parser.add_argument("--layers", type=int, default=61, help="MoE layers in the load matrix")
    parser.add_argument("--repeats", type=int, default=3, help="calls per placement; the fastest is reported")
    parser.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of the expert load")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic load")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (all implementations)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    balancers = {name: discover("balancer")[name].load()() for name in ("static", "eplb", "eplb-vec")}
    places = {
        "naive": ours(balancers["static"]),
        "eplb": ours(balancers["eplb"]),
        "eplb-vec": ours(balancers["eplb-vec"]),
        "deepseek": load_reference(args.reference_dir),
    }
    if places["deepseek"] is not None:
        reference = places["deepseek"]
        places["deepseek"] = lambda load, *shape: reference(load, *shape)[0]
    load = zipf_load(args.layers, args.skew, args.seed)
    print(f"{args.layers} layers x {NUM_EXPERTS} experts, {NUM_GROUPS} groups, Zipf skew {args.skew}, seed {args.seed}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), best of {args.repeats}; times in ms\n")
    print("| cluster | slots | policy | bal naive | eplb ms | vec ms | deepseek ms | vec vs eplb | vec vs deepseek "
          "| same | bal eplb | bal vec | bal deepseek | bal per-expert vec | bal per-expert deepseek | bal replicate-first |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for row in rows(load, places, args.repeats):
        print(row, flush=True)


if __name__ == "__main__":
    main()
