"""The dense projections of a decode step at 1, 2 and 4 rows: cuBLAS (F.linear) against the Triton GEMV
(moeplex.kernels.gemv) with each candidate tiling, against the weight's copy time.

    python3 benchmarks/gemv_small_m.py --out $OUT/gemv.md
    TRITON_INTERPRET=1 python3 benchmarks/gemv_small_m.py --device cpu --quick     # the script itself, on CPU

Weights are cold, as in a decode step that streams every layer: each timed CUDA graph holds CALLS calls, each on its
own copy of the weight (together past the L2 cache). Bytes per call: the weight, the rows in and out. Every
candidate's output is checked against F.linear in fp32 first. Median of --runs runs (min-max), each the mean of
the graph's replays (moe_small_m.Timer).
"""

from __future__ import annotations

import argparse
import os
import sys

import attrs
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from moe_small_m import CALLS, Timer, copy_rate  # noqa: E402
from report import emit  # noqa: E402

from moeplex.kernels.gemv import GemvTiles, gemv  # noqa: E402


@attrs.frozen
class Projection:
    model: str
    name: str
    n: int  # output features (rows of the weight)
    k: int  # input features


PROJECTIONS = [
    Projection("Qwen3-30B-A3B", "q/k/v", 5120, 2048),
    Projection("Qwen3-30B-A3B", "o_proj", 2048, 4096),
    Projection("DeepSeek-V3", "q_a + kv_a", 2112, 7168),
    Projection("DeepSeek-V3", "q_b", 24576, 1536),
    Projection("DeepSeek-V3", "o_proj", 7168, 16384),
    Projection("DeepSeek-V3", "shared expert gate/up", 4096, 7168),
    Projection("DeepSeek-V3", "shared expert down", 7168, 2048),
    Projection("DeepSeek-V3", "dense gate/up", 36864, 7168),
    Projection("DeepSeek-V3", "dense down", 7168, 18432),
]
CANDIDATES = [GemvTiles(n, k, w, s) for n, k, w, s in (
    (8, 512, 4, 3), (4, 1024, 4, 3), (8, 1024, 4, 3), (16, 256, 4, 4), (16, 512, 4, 3), (32, 256, 4, 3), (8, 256, 2, 4),
)]


def weight_copies(p: Projection, dtype, device, l2_bytes: int) -> list[torch.Tensor]:
    """Enough copies of a random weight that CALLS calls cycling through them never find theirs in L2."""
    one = torch.randn(p.n, p.k, device=device).div_(p.k ** 0.5).to(dtype)
    count = min(CALLS, max(2, -(-3 * l2_bytes // (one.numel() * one.element_size()))))
    return [one] + [one.clone() for _ in range(count - 1)]


def measure(p: Projection, rows: int, tilings: list[GemvTiles], dtype, device, timer: Timer, l2: int) -> list[dict]:
    weights = weight_copies(p, dtype, device, l2)
    x = torch.randn(rows, p.k, device=device).to(dtype)
    reference = F.linear(x.float(), weights[0].float())
    nbytes = weights[0].numel() * weights[0].element_size() + (x.numel() + rows * p.n) * x.element_size()
    results = []
    ways = {"cuBLAS": None, **{str(t): t for t in tilings}}
    for name, tiles in ways.items():
        def one(w, tiles=tiles):
            return F.linear(x, w) if tiles is None else gemv(x, w, None, tiles)

        error = ((one(weights[0]).float() - reference).norm() / reference.norm()).item()
        if error > 2e-2:
            raise AssertionError(f"{p.model} {p.name} at {rows} rows, {name}: relative error {error:.3g}")

        def calls():
            for call in range(CALLS):
                one(weights[call % len(weights)])

        median, low, high = timer(calls, CALLS)
        results.append({"way": name, "us": median * 1e6, "low": low * 1e6, "high": high * 1e6, "bytes": nbytes})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small shapes, one tiling (checks the script on CPU)")
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    projections, tilings = PROJECTIONS, CANDIDATES
    if args.quick:
        projections = [Projection("tiny", "q/k/v", 96, 64), Projection("tiny", "o_proj", 64, 128)]
        tilings = CANDIDATES[:1]
    timer = Timer(device, args.runs)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 1 << 20
    rate = copy_rate(timer, 64 << 20, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [f"## Decode-size projections: cuBLAS against the Triton GEMV ({name}, {dtype})", "",
             f"Cold weights ({CALLS} calls a graph, each on its own copy); µs per call, median (min-max) of {args.runs} "
             f"runs; a plain device copy moves {rate / 1e9:.0f} GB/s here (read + write), the roofline the weight's "
             "bytes at that rate. 'best GEMV' is the fastest tiling of the candidates.", "",
             "| model | projection | N x K | rows | cuBLAS µs | x roofline | best GEMV | µs | x roofline | GEMV / cuBLAS |",
             "|---|---|---|---:|---:|---:|---|---:|---:|---:|"]
    for p in projections:
        for rows in args.rows:
            results = measure(p, rows, tilings, dtype, device, timer, l2)
            roof = results[0]["bytes"] / rate * 1e6
            blas = results[0]
            best = min(results[1:], key=lambda r: r["us"])
            lines.append(f"| {p.model} | {p.name} | {p.n} x {p.k} | {rows} | {blas['us']:.1f} ({blas['low']:.1f}-"
                         f"{blas['high']:.1f}) | {blas['us'] / roof:.2f} | {best['way']} | {best['us']:.1f} "
                         f"({best['low']:.1f}-{best['high']:.1f}) | {best['us'] / roof:.2f} | "
                         f"{best['us'] / blas['us']:.2f} |")
            print(lines[-1], flush=True)
            print("   " + ", ".join(f"{r['way']} {r['us']:.1f}" for r in results[1:]), flush=True)
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
