"""Decode-size fused MoE (1-32 tokens) against the bytes roofline, for the table's tiles and a few candidates.

    python3 benchmarks/moe_small_m.py --out $OUT/moe.md [--write-configs $OUT/configs]
    TRITON_INTERPRET=1 python3 benchmarks/moe_small_m.py --device cpu --quick     # the script itself, on CPU

At one token Qwen3-30B-A3B's gate-up GEMM is 8 experts x 6 column tiles: 48 programs on 132 SMs, so the
weights stream at a fraction of the memory's rate (issue #31 target 1). For each shape and M this times the
plugin's whole fused MoE (`TritonMoEKernel.apply`: align, gate-up, down, top-k sum) with the tiles its table
picks ("table") and with each candidate of CANDIDATES: narrower and deeper column tiles, more warps, the copy
engine. (Split-K of the gate-up GEMM was tried on 2026-12-05 and lost at every M, 1.1-4.9x slower than the table:
results/fused_moe_h200_qwen3-30b-a3b_bf16.md; it was taken out again.)

Weights are cold, as in a decode step that streams 48 layers: each timed CUDA graph holds CALLS calls on fresh
random top-k routings, and at a few tokens consecutive calls draw from disjoint halves of the experts, so no
call finds its experts in L2 (the tuner's do_bench_cudagraph replays one routing, whose 8 experts of Qwen3,
50 MB, mostly stay in L2). Bytes per call: the weights of the experts it hits, its tokens in and out. The
roofline is those bytes at 4.8 TB/s (nominal) and at the rate of a plain device copy measured here (2 x bytes
moved / time). Median of --runs runs, each the mean over REPLAYS replays; every candidate's output is checked
against the `torch` kernel first. --write-configs writes the plugin's tables with each M's winner where it
beats the table's own tiles by more than --min-gain, for the lead to commit into configs/.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from pathlib import Path

import attrs
import torch

from moeplex.interfaces import BF16, ExpertWeights, MoEContext, StandardLayout
from moeplex.plugins.moe_kernels.torch_ref import TorchMoEKernel
from moeplex.plugins.moe_kernels.triton_moe.configs import (
    CONFIG_DIR,
    MoETiles,
    TileConfig,
    default_tiles,
    device_name,
    dtype_name,
    read_table,
    table_file,
    write_table,
)
from moeplex.plugins.moe_kernels.triton_moe.plugin import INTERPRETED, TritonMoEKernel

NOMINAL_TBS = 4.8  # H200 HBM3e
CALLS = 16  # MoE calls in one timed graph, each on its own routing
REPLAYS = 5


@attrs.frozen
class Shape:
    name: str
    experts: int
    hidden: int
    intermediate: int
    top_k: int = 8

    @property
    def expert_bytes(self) -> int:  # bf16 / fp16 w13 and w2 of one expert
        return 3 * self.hidden * self.intermediate * 2


SHAPES = {
    "qwen3-30b-a3b": Shape("qwen3-30b-a3b", 128, 2048, 768),
    "deepseek-v3": Shape("deepseek-v3", 256, 7168, 2048),
    "tiny": Shape("tiny", 16, 64, 32),  # the interpreter's (--device cpu)
}
TOKENS = (1, 2, 4, 8, 16, 32)
# Rows per expert of a new device's table outside the measured sizes: the ladder the committed tables use.
DEFAULT_ROWS = tuple(2.0**k for k in range(-5, 10))


def tile(block_n, block_k, warps=4, stages=3, tma=False) -> TileConfig:
    return TileConfig(16, block_n, block_k, 1, warps, stages, tma, 0)


# (gate-up, down) pairs for BLOCK_M = 16, the decode row tile. Programs at one token on Qwen3 (gate-up, down):
# the table's 128-wide tiles make 48 and 128.
CANDIDATES = {
    "n32": (tile(32, 256, stages=4), tile(64, 256)),  # 192 + 256 programs
    "n16": (tile(16, 256, stages=4), tile(32, 256, stages=4)),  # 384 + 512
    "n64": (tile(64, 128), tile(64, 128)),  # 96 + 256
    "n64.w8": (tile(64, 256, warps=8), tile(128, 128, warps=8)),  # 96 + 128
    "n32.tma": (tile(32, 256, stages=4, tma=True), tile(64, 256, tma=True)),  # the copy engine
    "n16.tma": (tile(16, 256, stages=4, tma=True), tile(32, 256, stages=4, tma=True)),  # 384 + 512, the copy engine
}
QUICK = ("n32", "n64")


class FixedTiles:
    """Stands in for the plugin's TileTables: every lookup gets one pair of tiles."""

    def __init__(self, tiles: MoETiles):
        self.tiles = tiles

    def pick(self, rows_per_expert: float, **_) -> MoETiles:
        return self.tiles


def routings(shape: Shape, tokens: int, calls: int, device, gen) -> list[torch.Tensor]:
    """Top-k ids per call; at a few pairs per call, consecutive calls hit disjoint halves of the experts."""
    out = []
    for call in range(calls):
        disjoint = tokens * shape.top_k * 4 <= shape.experts
        if disjoint and call % 2 == 0:
            perm = torch.randperm(shape.experts, generator=gen)
        pool = perm[(call % 2) * (shape.experts // 2):][: shape.experts // 2] if disjoint else torch.arange(shape.experts)
        pick = torch.rand(tokens, pool.numel(), generator=gen).argsort(1)[:, : shape.top_k]
        out.append(pool[pick].to(device, torch.int32))
    return out


@attrs.define
class Case:
    """One (shape, M): its calls' layouts, the bytes they must move, and the reference outputs of call 0."""

    shape: Shape
    tokens: int
    layouts: list[StandardLayout]
    bytes_per_call: float
    reference: torch.Tensor

    @classmethod
    def build(cls, shape, tokens, calls, weights, dtype, device, seed) -> Case:
        gen = torch.Generator().manual_seed(seed)
        layouts = []
        touched = 0
        for ids in routings(shape, tokens, calls, device, gen):
            hidden = torch.randn(tokens, shape.hidden, generator=gen).to(device, dtype)
            topk_weights = torch.rand(tokens, shape.top_k, generator=gen).to(device)
            layouts.append(StandardLayout(hidden, ids, topk_weights, shape.experts, routed_pairs=ids.numel()))
            touched += ids.unique().numel() * shape.expert_bytes + 2 * hidden.numel() * hidden.element_size()
        ctx = MoEContext(shape.hidden, shape.intermediate, shape.experts, shape.top_k, dtype, device)
        ref_kernel = TorchMoEKernel(ctx)
        reference = ref_kernel.apply(layouts[0], ref_kernel.prepare_weights(weights)).hidden.float()
        return cls(shape, tokens, layouts, touched / calls, reference)


class Timer:
    """Seconds per call of `calls` MoE calls: CUDA-graph replays on the GPU, plain calls on the CPU."""

    def __init__(self, device: torch.device, runs: int):
        self.device, self.runs = device, runs

    def __call__(self, fn, calls: int) -> tuple[float, float, float]:
        if self.device.type != "cuda":
            times = []
            for _ in range(self.runs):
                started = time.perf_counter()
                fn()
                times.append((time.perf_counter() - started) / calls)
            return statistics.median(times), min(times), max(times)
        fn()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        times = []
        for _ in range(self.runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(REPLAYS):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / REPLAYS / calls)
        return statistics.median(times), min(times), max(times)


def copy_rate(timer: Timer, nbytes: float, device) -> float:
    """Bytes per second a plain device copy of `nbytes` (at most 1 GiB) moves, read plus write, cold."""
    size = int(min(nbytes, 1 << 30)) // 16 * 16 or 16
    pool = torch.empty(min(4 << 30, size * CALLS) if device.type == "cuda" else size * 2, dtype=torch.uint8,
                       device=device)
    slices = max(1, pool.numel() // size)
    dst = torch.empty(size, dtype=torch.uint8, device=device)

    def copies():
        for call in range(CALLS):
            offset = (call % slices) * size
            dst.copy_(pool[offset: offset + size])

    seconds = timer(copies, CALLS)[0]
    del pool, dst
    return 2 * size / seconds


def run_case(case: Case, variants: dict[str, MoETiles | None], ctx, prepared, timer: Timer) -> list[dict]:
    rows = []
    for name, tiles in variants.items():
        kernel = TritonMoEKernel(ctx, FixedTiles(tiles) if tiles else None)
        chosen = tiles or kernel.tiles(case.tokens * case.shape.top_k / case.shape.experts, ctx.dtype, prepared)
        try:
            error = ((kernel.apply(case.layouts[0], prepared).hidden.float() - case.reference).norm()
                     / case.reference.norm().clamp_min(1e-30)).item()
            if not error <= 2e-2:
                print(f"  {name}: WRONG (relative error {error:.3g}); not timed", flush=True)
                continue

            def calls():
                for layout in case.layouts:
                    kernel.apply(layout, prepared)

            seconds, low, high = timer(calls, len(case.layouts))
        except Exception as exc:  # out of shared memory or registers on this GPU: not a candidate
            print(f"  {name}: skipped ({type(exc).__name__}: {str(exc)[:100]})", flush=True)
            continue
        rows.append(dict(name=name, tiles=chosen, seconds=seconds, low=low, high=high))
        print(f"  {case.shape.name} M={case.tokens} {name}: {seconds * 1e6:.1f} us", flush=True)
    return rows


def _compile_some(job) -> int:
    """Pool worker: run each (tiles, tokens) once on 8 experts of the shape, which leaves the kernels it launches in
    Triton's disk cache (the experts' count is no part of a kernel's specialization)."""
    shape_name, items = job
    small = attrs.evolve(SHAPES[shape_name], experts=SHAPES[shape_name].top_k)
    device = torch.device("cuda")
    ctx = MoEContext(small.hidden, small.intermediate, small.experts, small.top_k, torch.bfloat16, device)
    w13 = torch.randn(small.experts, 2 * small.intermediate, small.hidden, device=device, dtype=torch.bfloat16)
    w2 = torch.randn(small.experts, small.hidden, small.intermediate, device=device, dtype=torch.bfloat16)
    prepared = TritonMoEKernel(ctx).prepare_weights(ExpertWeights(w13, w2, BF16))
    for tiles, tokens in items:
        ids = torch.arange(small.experts, device=device, dtype=torch.int32).repeat(tokens, 1)
        layout = StandardLayout(torch.randn(tokens, small.hidden, device=device, dtype=torch.bfloat16), ids,
                                torch.rand(tokens, small.top_k, device=device), small.experts, routed_pairs=ids.numel())
        try:
            TritonMoEKernel(ctx, FixedTiles(tiles)).apply(layout, prepared)
        except Exception:  # out of resources: the timing skips it too
            pass
    torch.cuda.synchronize()
    return len(items)


def precompile(shape: Shape, jobs: list[tuple[MoETiles, int]], workers: int) -> None:
    """Compile every variant the timing will launch, in parallel processes (compiling dominates this script)."""
    started = time.monotonic()
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        done = sum(pool.map(_compile_some, [(shape.name, jobs[i::workers]) for i in range(workers)]))
    print(f"{shape.name}: compiled {done} variants in {time.monotonic() - started:.0f}s on {workers} processes",
          flush=True)


def describe(tiles: MoETiles) -> str:
    def one(t: TileConfig) -> str:
        extra = "/tma" if t.tma else ""
        return f"{t.block_n}x{t.block_k}/w{t.num_warps}/st{t.num_stages}{extra}"
    return f"gu {one(tiles.gate_up)}, dn {one(tiles.down)}"


def report(shape: Shape, results: dict[int, list[dict]], cases: dict[int, Case], rates: dict[int, float]) -> list[str]:
    lines = [f"### {shape.name}: E={shape.experts}, top-{shape.top_k}, hidden {shape.hidden}, "
             f"moe_intermediate {shape.intermediate}", "",
             "| M | config | tiles (N x K / warps / stages) | us (min-max) | GB/s | x nominal roofline "
             "| x copy roofline |", "|---:|---|---|---:|---:|---:|---:|"]
    best_lines = ["", "| M | MB per call | copy GB/s | table, us | best | best, us | gain |", "|---:|---:|---:|---:|---|---:|---:|"]
    for m, rows in results.items():
        nbytes = cases[m].bytes_per_call
        for row in rows:
            s = row["seconds"]
            lines.append(f"| {m} | {row['name']} | {describe(row['tiles'])} | {s * 1e6:.1f} ({row['low'] * 1e6:.1f}-"
                         f"{row['high'] * 1e6:.1f}) | {nbytes / s / 1e9:.0f} | {s / (nbytes / (NOMINAL_TBS * 1e12)):.2f} "
                         f"| {s / (nbytes / rates[m]):.2f} |")
        if rows:
            table = next((r for r in rows if r["name"] == "table"), None)
            best = min(rows, key=lambda r: r["seconds"])
            table_us = f"{table['seconds'] * 1e6:.1f}" if table else "-"
            gain = f"{table['seconds'] / best['seconds']:.2f}x" if table else "-"
            best_lines.append(f"| {m} | {nbytes / 1e6:.1f} | {rates[m] / 1e9:.0f} | {table_us} | {best['name']} | "
                              f"{best['seconds'] * 1e6:.1f} | {gain} |")
    return lines + best_lines + [""]


def winners(shape: Shape, results: dict[int, list[dict]], min_gain: float) -> dict[float, MoETiles]:
    """Rows per expert (the tables' key) -> the tiles that beat the table's own by more than min_gain."""
    chosen = {}
    for m, rows in results.items():
        table = next((r for r in rows if r["name"] == "table"), None)
        best = min(rows, key=lambda r: r["seconds"], default=None)
        if table and best and best["seconds"] * (1 + min_gain) < table["seconds"]:
            chosen[float(f"{m * shape.top_k / shape.experts:.4g}")] = best["tiles"]
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, or cpu under TRITON_INTERPRET=1 (tiny shapes)")
    parser.add_argument("--quick", action="store_true", help="two candidates at M=1 and 8 (checks the script)")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), help="default: Qwen3 and DeepSeek-V3 on "
                        "cuda, tiny on cpu")
    parser.add_argument("--tokens", type=int, nargs="+", help=f"token counts M (default {' '.join(map(str, TOKENS))})")
    parser.add_argument("--candidates", nargs="+", choices=sorted(CANDIDATES), help="default: all")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per variant; the median is reported")
    parser.add_argument("--out", help="write the Markdown report here too")
    parser.add_argument("--write-configs", metavar="DIR", help="write the plugin's tables, each M's measured "
                        "winner in, to DIR (copy them into plugins/moe_kernels/triton_moe/configs/ to apply)")
    parser.add_argument("--workers", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)),
                        help="processes that compile the variants first (GPU only)")
    parser.add_argument("--min-gain", type=float, default=0.03, help="a winner must beat the table's tiles by this")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and INTERPRETED:
        parser.error("TRITON_INTERPRET=1 is set: run the interpreter with --device cpu")
    if device.type == "cpu" and not INTERPRETED:
        parser.error("the CPU runs the kernels only under TRITON_INTERPRET=1")
    started = time.monotonic()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16  # the interpreter's bf16 is wrong
    shapes = [SHAPES[s] for s in (args.shapes or (["qwen3-30b-a3b", "deepseek-v3"] if device.type == "cuda"
                                                    else ["tiny"]))]
    tokens = args.tokens or ((1, 8) if args.quick else TOKENS)
    names = args.candidates or (QUICK if args.quick else sorted(CANDIDATES))
    calls = CALLS if device.type == "cuda" else 2
    timer = Timer(device, args.runs if device.type == "cuda" else min(args.runs, 2))
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    lines = [f"## Fused MoE at decode sizes on {gpu} (benchmarks/moe_small_m.py; torch {torch.__version__})", "",
             f"{str(dtype).removeprefix('torch.')} weights, cold (consecutive calls hit other experts); {calls} calls "
             f"per timed batch (a CUDA graph on the GPU), median of {timer.runs} runs"
             f"{f' of {REPLAYS} replays' if device.type == 'cuda' else ''}. 'table': the tiles the plugin picks today. "
             f"Roofline: the bytes at {NOMINAL_TBS} TB/s, and at a plain copy's rate measured here.", ""]
    tables_dir = Path(args.write_configs) if args.write_configs else None
    for shape in shapes:
        gen = torch.Generator(device=device).manual_seed(0)
        w13 = torch.randn(shape.experts, 2 * shape.intermediate, shape.hidden, device=device, dtype=dtype,
                          generator=gen) / shape.hidden**0.5
        w2 = torch.randn(shape.experts, shape.hidden, shape.intermediate, device=device, dtype=dtype,
                         generator=gen) / shape.intermediate**0.5
        weights = ExpertWeights(w13, w2, BF16)
        ctx = MoEContext(shape.hidden, shape.intermediate, shape.experts, shape.top_k, dtype, device)
        prepared = TritonMoEKernel(ctx).prepare_weights(weights)
        variants = {"table": None, **{n: MoETiles(*CANDIDATES[n]) for n in names}}
        if device.type == "cuda":  # each variant direct (M <= 4 at top-8) and sorted, the table's own tiles too
            table_kernel = TritonMoEKernel(ctx)
            jobs = {(table_kernel.tiles(m * shape.top_k / shape.experts, dtype, prepared), min(m, 8)) for m in tokens}
            jobs |= {(tiles, min(m, 8)) for tiles in list(variants.values())[1:] for m in tokens}
            precompile(shape, sorted(jobs, key=repr), args.workers)
        results, cases, rates = {}, {}, {}
        for m in tokens:
            cases[m] = Case.build(shape, m, calls, weights, dtype, device, seed=m)
            rates[m] = copy_rate(timer, cases[m].bytes_per_call, device)
            results[m] = run_case(cases[m], variants, ctx, prepared, timer)
            print(f"[{time.monotonic() - started:.0f}s]", flush=True)
        lines += report(shape, results, cases, rates)
        if tables_dir:
            name = table_file(device_name(device, INTERPRETED), dtype_name(dtype, False), shape.experts,
                              shape.intermediate, shape.hidden)
            # A device without a table of its own gets the defaults at every committed size, so that the sizes this
            # sweep does not measure (prefill) keep the tiles they run with today rather than the nearest decode tiles.
            table = read_table(CONFIG_DIR / name) or {
                rows: default_tiles(rows, dtype_name(dtype, False), INTERPRETED) for rows in DEFAULT_ROWS}
            chosen = winners(shape, results, args.min_gain)
            write_table(tables_dir / name, {**table, **chosen})
            lines.append(f"Wrote {tables_dir / name}: {len(chosen)} entries measured here "
                         f"({', '.join(f'{k:g}' for k in sorted(chosen)) or 'none'}), the rest as committed.\n")
        del w13, w2, weights, prepared, cases
        if device.type == "cuda":
            torch.cuda.empty_cache()
    lines.append(f"Total {time.monotonic() - started:.0f} s.")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
