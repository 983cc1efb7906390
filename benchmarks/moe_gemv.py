"""The triton MoE kernel's decode path at 1-4 tokens: the two GEMVs (triton_moe/gemv.py) at several tilings against
the grouped GEMMs with the direct alignment and the top-k sum (what ran before), on a GPU.

    python3 benchmarks/moe_gemv.py --out results/moe_gemv_{card}.md

Per shape and token count: one CUDA graph of CALLS calls, each with its own routing (uniform top-k, so the experts
read are mostly cold, as in a decode step), replayed ROUNDS times; µs per call, median (min-max). The roofline is
the distinct routed experts' weight bytes at the device copy rate measured here. 'error' is the GEMVs' relative
difference from the GEMMs' output.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from moeplex.interfaces import ExpertWeights, MoEContext, StandardLayout
from moeplex.plugins.moe_kernels.triton_moe.gemv import MoEGemvTiles, moe_gemv
from moeplex.plugins.moe_kernels.triton_moe.plugin import TritonMoEKernel

SHAPES = {  # experts, hidden, intermediate, top-k
    "Qwen3-30B-A3B": (128, 2048, 768, 8),
    "DeepSeek-V3 (EP8 rank)": (32, 7168, 2048, 8),
}
TILINGS = [MoEGemvTiles(8, 512, 4, 3), MoEGemvTiles(16, 512, 4, 3), MoEGemvTiles(4, 1024, 4, 3),
           MoEGemvTiles(8, 256, 4, 4), MoEGemvTiles(16, 256, 8, 3), MoEGemvTiles(32, 256, 8, 3)]
CALLS = 16
ROUNDS = 5


def copy_rate() -> float:
    """Bytes per second of a plain device copy (read + write), best of a few."""
    src = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / best


def timed(calls) -> list[float]:
    for call in calls[:2]:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(ROUNDS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return times


def cell(times: list[float]) -> str:
    return f"{statistics.median(times):.1f} ({min(times):.1f}-{max(times):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    rate = copy_rate()
    card = torch.cuda.get_device_name(0)
    lines = [f"## The MoE at 1-4 tokens: two GEMVs against the grouped GEMMs ({card}, bf16)", "",
             f"µs per call, median (min-max) of {ROUNDS} replays of {CALLS} calls with their own routing; the device "
             f"copy rate here {rate / 1e9:.0f} GB/s (read + write); roofline: the distinct experts' bytes at it.", "",
             "| shape | tokens | roofline µs | GEMMs + sum µs | x roofline | " + " | ".join(
                 f"GEMV n{t.block_n}k{t.block_k}w{t.num_warps}s{t.num_stages}" for t in TILINGS)
             + " | best / GEMMs | error |",
             "|---|---:|---:|---:|---:|" + "---:|" * len(TILINGS) + "---:|---:|"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (experts, hidden, inter, top_k) in SHAPES.items():
        weights = ExpertWeights(
            (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5).bfloat16(),
            (torch.randn(experts, hidden, inter, device="cuda", generator=gen) / inter**0.5).bfloat16())
        kernel = TritonMoEKernel(MoEContext(hidden, inter, experts, top_k, torch.bfloat16, torch.device("cuda")))
        prepared = kernel.prepare_weights(weights)
        expert_bytes = 3 * hidden * inter * 2
        for tokens in args.tokens:
            layouts = []
            for _ in range(CALLS):
                ids = torch.rand(tokens, experts, device="cuda", generator=gen).argsort(1)[:, :top_k].int()
                layouts.append(StandardLayout(torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16(),
                                              ids, torch.rand(tokens, top_k, device="cuda", generator=gen), experts))
            distinct = statistics.mean(len(set(l.topk_ids.flatten().tolist())) for l in layouts)
            roof_us = distinct * expert_bytes / (rate / 2) * 1e6
            kernel.gemv_max_tokens = 0
            gemms = timed([lambda l=l: kernel.apply(l, prepared) for l in layouts])
            want = kernel.apply(layouts[0], prepared).hidden.float()
            kernel.gemv_max_tokens = 4
            cells, medians, error = [], [], 0.0
            for t in TILINGS:
                got = moe_gemv(layouts[0].hidden, layouts[0].topk_ids, layouts[0].topk_weights, prepared.w13,
                               prepared.w2, t).float()
                error = max(error, ((got - want).norm() / want.norm()).item())
                times = timed([lambda l=l, t=t: moe_gemv(l.hidden, l.topk_ids, l.topk_weights, prepared.w13,
                                                         prepared.w2, t) for l in layouts])
                cells.append(cell(times))
                medians.append(statistics.median(times))
            best = min(range(len(TILINGS)), key=medians.__getitem__)
            cells[best] = f"**{cells[best]}**"
            lines.append(f"| {name} | {tokens} | {roof_us:.1f} | {cell(gemms)} | {statistics.median(gemms) / roof_us:.2f} | "
                         + " | ".join(cells) + f" | {medians[best] / statistics.median(gemms):.2f} | {error:.1e} |")
            print(lines[-1], flush=True)
        del weights, prepared
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
