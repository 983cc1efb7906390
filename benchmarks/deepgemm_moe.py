"""A DeepSeek-V3-shaped MoE layer's experts on one GPU: `deepgemm` against `triton` and `torch`.

All 256 experts (H=7168, I=2048, top-8, uniform routing) sit on the one GPU. Decode-sized
token counts feed `deepgemm` the masked layout (DeepEP low-latency's), prefill-sized ones
the contiguous layout (DeepEP normal's), both made once outside the timing; `triton` takes
the standard layout and fp8 weights (w8a8, the same recipe), `torch` bf16 weights. Times
are medians of triton.testing.do_bench with the L2 flushed; `graph` is deepgemm replayed
from a CUDA graph (decode only: the contiguous layout's size is known on the host).
Roofline: the larger of the fp8 FLOPs at the fp8 matmul rate and the expert bytes at the
copy bandwidth, both measured in this run.

    python benchmarks/deepgemm_moe.py > benchmarks/results/deepgemm_moe_h200.md
"""

from __future__ import annotations

import argparse
import datetime

import torch
from fused_moe import SHAPES, ColdTimer, Shape, Work, make_layout, make_weights, measure_roofline

from moeplex.interfaces import FP8_BLOCK, ExpertWeights, MoEContext
from moeplex.moe.adapters import LayoutAdapter
from moeplex.plugins.moe_kernels.deepgemm import quantize_experts
from moeplex.registry import lookup

DECODE = [1, 8, 32, 64, 128]
PREFILL = [512, 4096, 16384]


def context(shape: Shape) -> MoEContext:
    return MoEContext(shape.hidden, shape.intermediate, shape.local_experts, shape.top_k, torch.bfloat16,
                      torch.device("cuda"))


def row(shape: Shape, tokens: int, roof, kernels: dict, decode: bool, timer: ColdTimer) -> str:
    layout = make_layout(shape, tokens, seed=tokens)
    work = Work.of(layout, shape, 1)  # fp8 weights
    (dg, dg_w), (tr, tr_w), (ref, ref_w) = kernels["deepgemm"], kernels["triton"], kernels["torch"]
    target = "masked" if decode else "contiguous"
    converted, _ = LayoutAdapter("standard", frozenset({target}), dg.caps.alignment)(layout)
    dg_ms = timer(lambda: dg.apply(converted, dg_w))
    dg_graph = timer.graph(lambda: dg.apply(converted, dg_w)) if decode else float("nan")
    tr_ms = min(timer(lambda: tr.apply(layout, tr_w)), timer.graph(lambda: tr.apply(layout, tr_w)) if decode else 1e9)
    ref_ms = timer(lambda: ref.apply(layout, ref_w)) if tokens <= 4096 else float("nan")
    best = min(dg_ms, dg_graph) if decode else dg_ms
    ideal_ms = work.ideal_ms(roof)
    graph = f"{dg_graph * 1e3:.0f}" if decode else "-"
    torch_cell = f"{ref_ms * 1e3:.0f}" if ref_ms == ref_ms else "-"
    return (
        f"| {tokens} | {target} | {work.experts_hit} | {dg_ms * 1e3:.0f} | {graph} | {tr_ms * 1e3:.0f} | {torch_cell} | "
        f"{tr_ms / best:.2f} | {work.flops / best / 1e9:.0f} | {work.bytes / best / 1e6:.0f} | "
        f"{100 * ideal_ms / best:.0f}% |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--decode", type=int, nargs="*", default=DECODE, help="decode token counts (masked layout)")
    parser.add_argument("--prefill", type=int, nargs="*", default=PREFILL, help="prefill token counts (contiguous)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="deepseek-v3",
                        help="expert shapes (default: all 256 DeepSeek-V3 experts on one GPU)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("this benchmark times GPU kernels and no CUDA device is visible")
    shape = SHAPES[args.shape]
    bf16 = make_weights(shape, fp8=False)
    q = quantize_experts(bf16)  # expert by expert: quantizing all at once needs several times the memory
    fp8_weights = ExpertWeights(q.w13, q.w2, FP8_BLOCK, q.w13_scale, q.w2_scale)
    kernels = {}
    for name in ("deepgemm", "triton"):
        kernel = lookup("moe_kernel", name)(context(shape))
        kernels[name] = (kernel, kernel.prepare_weights(fp8_weights))
    reference = lookup("moe_kernel", "torch")(context(shape))
    kernels["torch"] = (reference, reference.prepare_weights(bf16))
    timer = ColdTimer()
    roof = measure_roofline(True, timer)
    print(f"## DeepSeek-V3 MoE experts: `deepgemm` vs `triton` (fp8) vs `torch` (bf16), {args.shape}\n")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {datetime.date.today()}. "
          f"{shape.local_experts} experts on this GPU, H={shape.hidden}, I={shape.intermediate}, "
          f"top-{shape.top_k} uniform routing; fp8 = 128x128 weight blocks, 1x128 activation groups.")
    print(f"Measured peaks: fp8 matmul {roof.matmul_tflops:.0f} TFLOP/s, device copy {roof.copy_gbps:.0f} GB/s.\n")
    print("| tokens | deepgemm layout | experts hit | deepgemm µs | deepgemm graph µs | triton µs | torch µs | "
          "deepgemm speed-up over triton | TFLOP/s | GB/s moved | roofline |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for tokens in args.decode:
        print(row(shape, tokens, roof, kernels, True, timer), flush=True)
    for tokens in args.prefill:
        print(row(shape, tokens, roof, kernels, False, timer), flush=True)


if __name__ == "__main__":
    main()
