"""The one-launch router (moeplex.kernels.router_gemv) at each token block and warp count, on a GPU.

    python3 benchmarks/router_warps.py --out results/router_warps_{card}.md

Per model shape (Qwen3-30B-A3B: 128 experts, hidden 2048, softmax top-8; DeepSeek-V3: 256 experts, hidden 7168,
sigmoid with 8 groups, top-4 groups, top-8 and the correction bias), per token count and warps per program: one
CUDA graph of LAUNCHES launches, each on its own copy of the gate weight (the copies together several times the
L2 cache, as a decode step meets the gate weight: cold, after the previous layer's experts), replayed ROUNDS times;
µs per launch, the median of the rounds (min-max). 'default' marks what router_gemv.warps_for takes.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from moeplex.kernels import router_gemv
from moeplex.kernels.topk import RouterSpec

SHAPES = {
    "Qwen3-30B-A3B": (RouterSpec(num_experts=128, top_k=8), 2048),
    "DeepSeek-V3": (RouterSpec(num_experts=256, top_k=8, scoring="sigmoid", num_groups=8, topk_groups=4,
                               scaling_factor=2.5, correction_bias=True), 7168),
}
TOKENS = (1, 2, 3, 4, 6, 8, 12, 16)
WARPS = (1, 2, 4, 8)
LAUNCHES = 48
ROUNDS = 7


def time_launches(spec: RouterSpec, hidden: int, tokens: int, warps: int) -> list[float]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    weight_bytes = spec.num_experts * hidden * 2
    copies = max(2, min(LAUNCHES, -(-4 * l2 // weight_bytes)))
    weights = [torch.randn(spec.num_experts, hidden, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
               for _ in range(copies)]
    bias = torch.randn(spec.num_experts, generator=gen, device="cuda") * 0.1 if spec.correction_bias else None
    x = torch.randn(tokens, hidden, generator=gen, device="cuda", dtype=torch.bfloat16)
    counter = router_gemv.new_counter("cuda")
    router_gemv.NUM_WARPS = warps
    try:
        for w in weights[:2]:  # compiles outside the capture
            router_gemv.route_small_batch(x, w, spec, counter, bias)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(LAUNCHES):
                router_gemv.route_small_batch(x, weights[i % copies], spec, counter, bias)
    finally:
        router_gemv.NUM_WARPS = None
    graph.replay()
    times = []
    for _ in range(ROUNDS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / LAUNCHES)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out")
    args = parser.parse_args()
    card = torch.cuda.get_device_name(0)
    lines = [f"## The one-launch router's warps per program ({card})", "",
             f"µs per launch, median (min-max) of {ROUNDS} replays of a graph of {LAUNCHES} launches, each on its own "
             "cold copy of the gate weight; **bold**: the fastest; (default): what warps_for takes.", "",
             "| model | tokens | " + " | ".join(f"{w} warp{'s' * (w > 1)}" for w in WARPS) + " |",
             "|---|---:|" + "---:|" * len(WARPS)]
    for name, (spec, hidden) in SHAPES.items():
        for tokens in TOKENS:
            block_t = 1 << (tokens - 1).bit_length()
            medians, cells = [], []
            for warps in WARPS:
                times = time_launches(spec, hidden, tokens, warps)
                medians.append(statistics.median(times))
                cells.append(f"{medians[-1]:.2f} ({min(times):.2f}-{max(times):.2f})"
                             + (" (default)" if warps == router_gemv.warps_for(block_t) else ""))
            best = min(range(len(WARPS)), key=medians.__getitem__)
            cells[best] = f"**{cells[best]}**"
            lines.append(f"| {name} | {tokens} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
