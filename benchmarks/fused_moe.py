"""Time the `triton` fused MoE kernel against the `torch` reference kernel, and against the hardware roofline.

One Markdown table per shape: for each token count M on one EP rank, the time of each kernel
(median over CUDA events, L2 emptied before each run: see ColdTimer), triton's time when replayed in a
CUDA graph (how decode runs), the speed-up over torch, and triton's best time against each
ceiling measured in this run: TFLOP/s of the routed pairs over the bf16 (or fp8) matmul peak, TB/s
of the fewest bytes that must move (the hit experts' weights once, the tokens in and out) over the
device-to-device copy rate, and the roofline, the larger of the two ideal times over the time taken.

    python benchmarks/fused_moe.py --shape deepseek-v3 --dtype bf16 > benchmarks/results/fused_moe_h200_deepseek-v3_bf16.md
    python benchmarks/fused_moe.py --shape deepseek-v3-ep8 --dtype fp8
"""

from __future__ import annotations

import argparse
import datetime
import statistics

import attrs
import torch
import triton

from moeplex.interfaces import BF16, FP8_BLOCK, ExpertWeights, MoEContext, StandardLayout
from moeplex.quant import quantize_blocks
from moeplex.registry import lookup


@attrs.frozen
class Shape:
    experts: int  # routed experts of the model
    ep_size: int  # EP ranks; this rank holds experts / ep_size of them
    hidden: int
    intermediate: int  # moe_intermediate_size: w13 has 2x this many rows
    top_k: int

    @property
    def local_experts(self) -> int:
        return self.experts // self.ep_size


SHAPES = {
    "deepseek-v3": Shape(experts=256, ep_size=1, hidden=7168, intermediate=2048, top_k=8),
    "deepseek-v3-ep8": Shape(experts=256, ep_size=8, hidden=7168, intermediate=2048, top_k=8),
    "deepseek-v3-ep16": Shape(experts=256, ep_size=16, hidden=7168, intermediate=2048, top_k=8),
    "qwen3-30b-a3b": Shape(experts=128, ep_size=1, hidden=2048, intermediate=768, top_k=8),
}
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def make_weights(shape: Shape, fp8: bool, seed: int = 0) -> ExpertWeights:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    e, h, i = shape.local_experts, shape.hidden, shape.intermediate
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16, generator=gen) / h**0.5
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16, generator=gen) / i**0.5
    if not fp8:
        return ExpertWeights(w13, w2, BF16)
    (q13, s13), (q2, s2) = quantize_blocks(w13), quantize_blocks(w2)
    return ExpertWeights(q13, q2, FP8_BLOCK, s13, s2)


ROUTINGS = ("global", "local")


def make_layout(shape: Shape, tokens: int, seed: int = 0, routing: str = "global", device: str = "cuda",
                dtype: torch.dtype = torch.bfloat16) -> StandardLayout:
    """Uniform top-k routing of `tokens` rows, as rank 0 sees it.

    global: over all experts; ids of experts on other ranks become -1 (top_k / ep_size pairs per row).
    local: over the rank's own experts only (top_k pairs per row: rows a dispatcher sent here because
    all their experts live here) — same M, ep_size times the rows per expert.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    experts = shape.experts if routing == "global" else shape.local_experts
    ids = torch.rand(tokens, experts, device=device, generator=gen).argsort(1)[:, : shape.top_k]
    ids = torch.where(ids < shape.local_experts, ids, -1).to(torch.int32)
    weights = torch.rand(tokens, shape.top_k, device=device, generator=gen)
    hidden = torch.randn(tokens, shape.hidden, device=device, generator=gen).to(dtype)
    pairs = int((ids >= 0).sum())  # a dispatcher that knows its counts on the host hands them over like this
    return StandardLayout(hidden, ids, weights, shape.local_experts, routed_pairs=pairs)


def context(shape: Shape) -> MoEContext:
    return MoEContext(shape.hidden, shape.intermediate, shape.local_experts, shape.top_k, torch.bfloat16,
                      torch.device("cuda"))


class ColdTimer:
    """Median milliseconds of `fn` over CUDA events, each run after reading a buffer ten times L2's size.

    Every run starts with nothing of its own in L2, and with nothing dirty there either.
    triton.testing.do_bench empties L2 by writing a buffer instead, and its ~50 MB of dirty lines
    must go back to memory while the timed kernel streams its weights in: about 12 µs of the copy
    rate, which is a sixth of a decode step on one EP8 rank. A kernel after attention finds L2
    holding little it has written, which is what reading the buffer leaves.
    """

    def __init__(self, runs: int = 50, warmup: int = 5):
        self.runs, self.warmup = runs, warmup
        self.flush = torch.ones(512 << 20, dtype=torch.uint8, device="cuda")

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(self.runs)]
        for start, end in events:
            self.flush.sum()  # reads it all; writes one number
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events)

    def graph(self, fn) -> float:
        """Median time of `fn` replayed from a CUDA graph: launch overhead out, as decode serves it."""
        fn()  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return self(graph.replay)


@attrs.frozen
class Roofline:
    matmul_tflops: float
    copy_gbps: float


def measure_roofline(fp8: bool, timer: ColdTimer) -> Roofline:
    """Peak dense-matmul TFLOP/s (bf16, or fp8 through torch._scaled_mm) and device-to-device copy GB/s."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    if fp8:
        a8, b8, one = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t(), torch.ones((), device="cuda")
        ms = timer(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    else:
        ms = timer(lambda: a @ b)
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = timer(lambda: dst.copy_(src))
    return Roofline(matmul_tflops=2 * n**3 / ms / 1e9, copy_gbps=2 * src.numel() / copy_ms / 1e6)


@attrs.frozen
class Work:
    """What one batch asks of the experts of one rank."""

    pairs: int  # routed (token, expert) pairs here
    experts_hit: int
    flops: float  # 2 x (H x 2I + I x H) per pair
    bytes: float  # the fewest that must move: the hit experts' weights, the tokens in and out, each once

    @classmethod
    def of(cls, layout: StandardLayout, shape: Shape, bytes_per_weight: int) -> Work:
        routed = layout.topk_ids[layout.topk_ids >= 0]
        pairs, hit = routed.numel(), torch.unique(routed).numel()
        weights = hit * 3 * shape.hidden * shape.intermediate * bytes_per_weight
        tokens = 2 * layout.num_rows * shape.hidden * layout.hidden.element_size()
        return cls(pairs, hit, 6 * pairs * shape.hidden * shape.intermediate, weights + tokens)

    def compute_ms(self, roof: Roofline) -> float:
        return self.flops / roof.matmul_tflops / 1e9

    def memory_ms(self, roof: Roofline) -> float:
        return self.bytes / roof.copy_gbps / 1e6

    def ideal_ms(self, roof: Roofline) -> float:
        """The roofline: the larger of the compute time at the matmul peak and the memory time at the copy rate."""
        return max(self.compute_ms(roof), self.memory_ms(roof))


HEADER = ("| routing | M | pairs here | experts hit | triton µs | triton graph µs | fused kernel only µs "
          "| CUTLASS GEMM 1 µs | torch µs | speed-up | bare grouped_mm GEMMs µs | triton / bare grouped_mm | TFLOP/s "
          "| of matmul peak | TB/s | of copy peak | of roofline |\n" + "|---" * 17 + "|")


def grouped_mm_gemms(layout: StandardLayout, weights: ExpertWeights):
    """The two expert GEMMs alone through torch._grouped_mm (CUTLASS), on rows already sorted by expert.

    The library baseline for the GEMMs: no routing, permutation or weighting is timed (bf16 only)."""
    ids = layout.topk_ids.flatten()
    order = torch.argsort(ids[ids >= 0].long(), stable=True)
    rows = layout.hidden.repeat_interleave(layout.topk_ids.shape[1], 0)[ids >= 0][order].contiguous()
    counts = torch.bincount(ids[ids >= 0].long(), minlength=layout.num_local_experts)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    w13, w2 = weights.w13.transpose(1, 2), weights.w2.transpose(1, 2)  # [E, K, N] views of [E, N, K]

    def run():
        gate_up = torch._grouped_mm(rows, w13, offs=offs)
        gate, up = gate_up.chunk(2, dim=-1)
        return torch._grouped_mm(torch.nn.functional.silu(gate) * up, w2, offs=offs)

    return run


def row(shape: Shape, tokens: int, routing: str, fp8: bool, roof: Roofline, kernels, raw_weights: ExpertWeights,
        timer: ColdTimer) -> str:
    """One M: times, and the best of them against each ceiling and against the larger of the two (the roofline)."""
    layout = make_layout(shape, tokens, seed=tokens, routing=routing)
    work = Work.of(layout, shape, 1 if fp8 else 2)
    (triton_kernel, triton_weights), (torch_kernel, torch_weights) = kernels
    triton_eager = timer(lambda: triton_kernel.apply(layout, triton_weights))
    grouped = timer(grouped_mm_gemms(layout, raw_weights)) if not fp8 and hasattr(torch, "_grouped_mm") else float("nan")
    library_from, triton_kernel.grouped_mm_min_rows = triton_kernel.grouped_mm_min_rows, float("inf")
    fused_only = timer(lambda: triton_kernel.apply(layout, triton_weights))  # the Triton kernel at every size
    triton_kernel.grouped_mm_min_rows = library_from
    gated_rows, triton_kernel.gated_gemm1_rows = triton_kernel.gated_gemm1_rows, (0, 0)
    cutlass_gemm1 = timer(lambda: triton_kernel.apply(layout, triton_weights))  # the library path's GEMM 1 never fused
    triton_kernel.gated_gemm1_rows = gated_rows
    triton_graph = timer.graph(lambda: triton_kernel.apply(layout, triton_weights))
    torch_ms = timer(lambda: torch_kernel.apply(layout, torch_weights))
    best = min(triton_eager, triton_graph)
    return (
        f"| {routing} | {tokens} | {work.pairs} | {work.experts_hit} | {triton_eager * 1e3:.1f} | "
        f"{triton_graph * 1e3:.1f} | {fused_only * 1e3:.1f} | {cutlass_gemm1 * 1e3:.1f} | "
        f"{torch_ms * 1e3:.1f} | {torch_ms / best:.2f} | {grouped * 1e3:.1f} | {best / grouped:.2f} | {work.flops / best / 1e9:.1f} | "
        f"{100 * work.compute_ms(roof) / best:.0f}% | {work.bytes / best / 1e9:.2f} | "
        f"{100 * work.memory_ms(roof) / best:.0f}% | {100 * work.ideal_ms(roof) / best:.0f}% |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="deepseek-v3-ep8", help="expert shapes of one EP rank")
    parser.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16",
                        help="bf16 weights, or fp8 weights in 128x128 blocks with 1x128 activation scales (w8a8)")
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS, help="token counts M received by the rank")
    parser.add_argument("--routing", choices=ROUTINGS, nargs="+", default=["global"],
                        help="global: top-k over all experts (rank 0 keeps its share); local: top-k over the rank's "
                             "own experts (ep_size times the rows per expert at the same M)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("this benchmark times GPU kernels and no CUDA device is visible")
    shape, fp8 = SHAPES[args.shape], args.dtype == "fp8"
    weights = make_weights(shape, fp8)
    kernels = []
    for name in ("triton", "torch"):
        kernel = lookup("moe_kernel", name)(context(shape))
        kernels.append((kernel, kernel.prepare_weights(weights)))
    timer = ColdTimer()
    roof = measure_roofline(fp8, timer)
    print(f"## fused MoE: `triton` vs `torch`, {args.shape}, {args.dtype}\n")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{datetime.date.today()}. Rank 0 of {shape.ep_size}: {shape.local_experts} experts, "
          f"H={shape.hidden}, I={shape.intermediate}, top-{shape.top_k} uniform routing ({', '.join(args.routing)}).")
    print(f"Measured peaks: {'fp8' if fp8 else 'bf16'} matmul {roof.matmul_tflops:.0f} TFLOP/s, "
          f"device copy {roof.copy_gbps:.0f} GB/s.\n")
    print(HEADER)
    for routing in args.routing:
        for tokens in args.tokens:
            print(row(shape, tokens, routing, fp8, roof, kernels, weights, timer), flush=True)


if __name__ == "__main__":
    main()
