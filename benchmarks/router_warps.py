"""The one-launch router (moeplex.kernels.router_gemv) at each token block and warp count, on a GPU.

    python3 benchmarks/router_warps.py --out results/router_warps_{card}.md
    TRITON_INTERPRET=1 python3 benchmarks/router_warps.py --device cpu --quick   # the script itself, on a CPU

Per model shape (Qwen3-30B-A3B: 128 experts, hidden 2048, softmax top-8; DeepSeek-V3: 256 experts, hidden 7168,
sigmoid with 8 groups, top-4 groups, top-8 and the correction bias), per token count and warps per program: one
CUDA graph of LAUNCHES launches, each on its own copy of the gate weight (the copies together several times the
L2 cache, as a decode step meets the gate weight: cold, after the previous layer's experts), replayed ROUNDS times;
µs per launch, the median of the rounds (min-max). 'default' marks what router_gemv.warps_for takes.
On a CPU (--device cpu, under Triton's interpreter) the launches run one by one, eagerly, and the times mean nothing;
--quick takes tiny shapes and few cases (what the tests run).
"""

from __future__ import annotations

import argparse
import statistics
import time

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


def time_launches(spec: RouterSpec, hidden: int, tokens: int, warps: int, device: str) -> list[float]:
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter's bf16 arithmetic is wrong
    l2 = torch.cuda.get_device_properties(0).L2_cache_size if device == "cuda" else 0
    copies = max(2, min(LAUNCHES, -(-4 * l2 // (spec.num_experts * hidden * 2))))
    weights = [torch.randn(spec.num_experts, hidden, generator=gen, device=device).to(dtype) * 0.02
               for _ in range(copies)]
    bias = torch.randn(spec.num_experts, generator=gen, device=device) * 0.1 if spec.correction_bias else None
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)
    counter = router_gemv.new_counter(device)

    def launches(count: int) -> None:
        for i in range(count):
            router_gemv.route_small_batch(x, weights[i % copies], spec, counter, bias)

    router_gemv.NUM_WARPS = warps
    try:
        launches(2)  # compiles outside the capture
        if device != "cuda":
            start = time.perf_counter()
            launches(LAUNCHES)
            return [(time.perf_counter() - start) * 1e6 / LAUNCHES]
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launches(LAUNCHES)
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
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 1 and 2 tokens, 1 and 4 warps, 2 launches")
    args = parser.parse_args()
    global LAUNCHES, TOKENS, WARPS, SHAPES
    if args.quick:
        LAUNCHES, TOKENS, WARPS = 2, (1, 2), (1, 4)
        SHAPES = {name: (spec, 64) for name, (spec, _) in SHAPES.items()}
        router_gemv.TARGET_PROGRAMS = 8  # the interpreter runs programs one after another
    card = torch.cuda.get_device_name(0) if args.device == "cuda" else f"{args.device} (Triton's interpreter)"
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
                times = time_launches(spec, hidden, tokens, warps, args.device)
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
