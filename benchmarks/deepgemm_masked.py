"""Why DeepGEMM's masked MoE path is far from its roofline at 1-8 tokens per expert (issue #22, target 5).

`deepgemm_moe.py` times the plugin's whole masked path: 14% of the roofline at 1 token, 51% at 8. This
probe splits that time into its four launches (row quantization, GEMM 1, SiLU-and-mul + quantization,
GEMM 2) and times each GEMM alone with the `expected_m` hint the plugin passes (the dispatcher's mean rows
per expert) against the receive buffer's full row count (what DeepGEMM assumes without a hint), and
against DeepGEMM's contiguous kernel given only the hit experts (128 rows each: the same weights read,
no masked scheduling over the experts that got nothing).

DeepSeek-V3's experts (256, H 7168, I 2048, fp8 128x128 blocks), all on one GPU; top-8 uniform routing.
Roofline per GEMM: the hit experts' fp8 weight bytes at the measured copy bandwidth (at these sizes the
FLOPs are negligible). Every kernel shape compiles once (DG_JIT_CACHE_DIR keeps them between runs).

    python benchmarks/deepgemm_masked.py [--tokens 1 8 32] [--runs 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import statistics

import torch
from fused_moe import ColdTimer, measure_roofline

from moeplex.interfaces.kernels import quantize_blocks, quantize_rows, silu_mul_quantize
from report import emit

EXPERTS, HIDDEN, INTER, TOP_K, ROWS = 256, 7168, 2048, 8, 128  # ROWS: the masked buffer's rows per expert


def fp8_experts(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, n, k] fp8 weights with their 128x128 block scales (random; each expert quantized alone)."""
    pairs = [quantize_blocks(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02) for _ in range(EXPERTS)]
    return torch.stack([v for v, _ in pairs]).contiguous(), torch.stack([s for _, s in pairs]).float().contiguous()


def routed_counts(tokens: int, seed: int) -> torch.Tensor:
    """Rows per expert for `tokens` tokens with top-8 uniform routing."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
    return torch.bincount(ids.flatten(), minlength=EXPERTS).to(torch.int32).cuda()


def parts(dg, timer: ColdTimer, counts: torch.Tensor, w13, w2, expected: int) -> dict[str, float]:
    """Milliseconds of each launch of the plugin's masked path, with `expected` as DeepGEMM's hint."""
    hidden = torch.randn(EXPERTS, ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    a = quantize_rows(hidden, counts)
    gate_up = torch.empty(EXPERTS, ROWS, 2 * INTER, device="cuda", dtype=torch.bfloat16)
    act = silu_mul_quantize(gate_up, counts)
    out = torch.empty(EXPERTS, ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    return {
        "quantize": timer(lambda: quantize_rows(hidden, counts)),
        "gemm1": timer(lambda: dg.m_grouped_fp8_gemm_nt_masked(a, w13, gate_up, counts, expected)),
        "silu_quantize": timer(lambda: silu_mul_quantize(gate_up, counts)),
        "gemm2": timer(lambda: dg.m_grouped_fp8_gemm_nt_masked(act, w2, out, counts, expected)),
    }


def contiguous_gemms(dg, timer: ColdTimer, counts: torch.Tensor, w13, w2) -> dict[str, float]:
    """GEMM 1 and 2 through the contiguous kernel over the hit experts only, 128 rows each."""
    hit = torch.nonzero(counts).flatten()
    index = hit.repeat_interleave(ROWS).to(torch.int32)
    rows = index.numel()
    a = quantize_rows(torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16))
    gate_up = torch.empty(rows, 2 * INTER, device="cuda", dtype=torch.bfloat16)
    act = silu_mul_quantize(gate_up)
    out = torch.empty(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    return {
        "gemm1": timer(lambda: dg.m_grouped_fp8_gemm_nt_contiguous(a, w13, gate_up, index)),
        "gemm2": timer(lambda: dg.m_grouped_fp8_gemm_nt_contiguous(act, w2, out, index)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--runs", type=int, default=3, help="repeats of every timing (default: %(default)s)")
    parser.add_argument("--out", help="also write the tables to this file")
    args = parser.parse_args()
    import deep_gemm as dg

    timer = ColdTimer()
    roof = measure_roofline(True, timer)
    w13, w2 = fp8_experts(2 * INTER, HIDDEN), fp8_experts(HIDDEN, INTER)
    byte_per_expert = {"gemm1": 2 * INTER * HIDDEN, "gemm2": HIDDEN * INTER}  # fp8: one byte per weight
    lines = [
        f"## DeepGEMM masked at few rows per expert ({datetime.date.today()}, {torch.cuda.get_device_name()})",
        "",
        f"256 experts, H {HIDDEN}, I {INTER}, top-8 uniform; masked buffer {ROWS} rows per expert; copy rate "
        f"{roof.copy_gbps:.0f} GB/s. µs, median of {args.runs} timings (each the median of 50 cold runs); "
        "roofline = the hit experts' fp8 weights at the copy rate.",
        "",
        "| tokens | experts hit | hint (expected_m) | quantize | GEMM 1 | SiLU+quantize | GEMM 2 | total | GEMM 1 roofline "
        "| GEMM 2 roofline | contiguous GEMM 1 / GEMM 2 (hit experts only) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for tokens in args.tokens:
        counts = routed_counts(tokens, seed=tokens)
        hit = int((counts > 0).sum())
        mean = max(1, -(-tokens * TOP_K // hit))
        print(f"tokens {tokens}: compiling and timing", flush=True)
        contiguous = [contiguous_gemms(dg, timer, counts, w13, w2) for _ in range(args.runs)]
        cont = {k: statistics.median(run[k] for run in contiguous) for k in contiguous[0]}
        for label, expected in ((f"{mean} (rows per hit expert)", mean), (f"{ROWS} (buffer rows)", ROWS)):
            runs = [parts(dg, timer, counts, w13, w2, expected) for _ in range(args.runs)]
            med = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
            ideal = {g: hit * byte_per_expert[g] / (roof.copy_gbps * 1e9) * 1e3 for g in byte_per_expert}
            lines.append(
                f"| {tokens} | {hit} | {label} | {med['quantize'] * 1e3:.0f} | {med['gemm1'] * 1e3:.0f} | "
                f"{med['silu_quantize'] * 1e3:.0f} | {med['gemm2'] * 1e3:.0f} | {sum(med.values()) * 1e3:.0f} | "
                f"{100 * ideal['gemm1'] / med['gemm1']:.0f}% | {100 * ideal['gemm2'] / med['gemm2']:.0f}% | "
                f"{cont['gemm1'] * 1e3:.0f} / {cont['gemm2'] * 1e3:.0f} |"
            )
            print(lines[-1], flush=True)
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
