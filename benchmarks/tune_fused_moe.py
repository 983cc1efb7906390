"""Search tile configurations of the `triton` fused MoE kernel on this GPU and write its JSON table.

    python benchmarks/tune_fused_moe.py --shape deepseek-v3-ep8 --dtype bf16
    python benchmarks/tune_fused_moe.py --shape deepseek-v3 --tokens 1 64 4096 --log tune.csv

The two GEMMs are tuned apart: GEMM 1 (gate and up, N=2I, K=H) and GEMM 2 (down, N=H, K=I) have
transposed shapes and want different tiles, but they tile one alignment, so they share BLOCK_M and
TAIL_M. For each token count M (routing of benchmarks/fused_moe.py) and each (BLOCK_M, TAIL_M) that
suits its rows per expert, every candidate of each GEMM is timed alone as a CUDA-graph replay
(triton.testing.do_bench_cudagraph: decode replays graphs, and eager timing at small M measures the
host). The best pair per (BLOCK_M, TAIL_M), the table's incumbent and the default then run the whole path
(align, both GEMMs, finish), and the fastest wins. Candidates compile first in a pool of processes
that fill Triton's on-disk cache, so the search pays for compiling once, in parallel. --budget-s
stops the search early with what it has. Winners are checked against the torch reference before
the table (configs/E=..,N=..,K=..,device=..,dtype=...json in the plugin package) is written;
--log writes every timing as CSV.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import multiprocessing
import os
import time
from pathlib import Path

import attrs
import torch
from triton.testing import do_bench_cudagraph

from fused_moe import SHAPES, TOKENS, Shape, context, make_layout, make_weights  # benchmarks/, beside this file

from moeplex.kernels.fp8 import quantize_rows
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
from moeplex.plugins.moe_kernels.triton_moe.align import Alignment, can_align_direct
from moeplex.plugins.moe_kernels.triton_moe.fused import (
    Activations,
    PreparedWeights,
    activations,
    align_standard,
    moe_standard,
)
from moeplex.plugins.moe_kernels.triton_moe.kernel import grouped_gemm
from moeplex.registry import lookup

GEMMS = ("gate_up", "down")
SHARED_MEMORY = 220 * 1024  # bytes a Hopper SM gives one program, less a margin


def row_tiles(rows_per_expert: float) -> tuple[tuple[int, int], ...]:
    """(BLOCK_M, TAIL_M) worth trying: tall enough to reuse each weight tile, short enough not to pad much;
    with a tail, one tile takes the experts whose rows just pass BLOCK_M."""
    if rows_per_expert < 8:
        return ((16, 0),)
    if rows_per_expert < 32:
        return ((16, 0), (32, 0))
    if rows_per_expert < 96:
        return ((32, 0), (64, 0), (64, 32))
    if rows_per_expert < 160:
        return ((64, 0), (128, 0), (128, 32), (128, 64))
    return ((128, 0), (128, 32), (128, 64), (128, 128))


def gemm_space(gemm: str, block_m: int, tail_m: int, fp8: bool) -> list[TileConfig]:
    gated = gemm == "gate_up"
    if block_m <= 32:  # streaming weights: many programs, deep pipelines
        block_ns = (16, 32, 64, 128) if gated else (32, 64, 128, 256)
        space = itertools.product(block_ns, (64, 128, 256), (1,), (4,), (3, 4, 5), (False, True))
    else:  # reusing them: wide tiles on the tensor cores
        block_ns = (64, 128) if gated else (64, 128, 256)
        space = itertools.product(block_ns, (64, 128), (8,), (4, 8), (3, 4), (False, True))
    configs = []
    rows = block_m + tail_m  # both parts of a tile are in flight at once
    for bn, bk, group, warps, stages, tma in space:
        if fp8 and 128 % bk:
            continue  # a K tile must sit inside one 128-wide scale group
        operand_bytes = (rows * bk + bk * bn * (2 if gated else 1)) * (1 if fp8 else 2)
        accumulators = rows * bn * (2 if gated else 1)
        if operand_bytes * stages > SHARED_MEMORY or accumulators > 160 * warps * 32:  # spills past 160 regs
            continue
        configs.append(TileConfig(block_m, bn, bk, group, warps, stages, tma, tail_m))
    return configs


@attrs.frozen
class Case:
    """One token count's operands for timing each GEMM alone over one alignment."""

    shape: Shape
    acts: Activations
    align: Alignment
    inter: torch.Tensor
    inter_scales: torch.Tensor | None
    pair_rows: torch.Tensor
    routed: torch.Tensor

    @classmethod
    def build(cls, shape: Shape, layout, prepared: PreparedWeights, block_m: int, tail_m: int) -> Case:
        acts = activations(layout.hidden, None, prepared)
        align = align_standard(layout.topk_ids, shape.local_experts, block_m, tail_m)
        pairs = layout.topk_ids.numel()
        inter = torch.randn(pairs, shape.intermediate, device="cuda").to(acts.out_dtype)
        inter_scales = None
        if prepared.fp8:
            inter, inter_scales = quantize_rows(inter)
        pair_rows = torch.empty(pairs, shape.hidden, device="cuda", dtype=acts.out_dtype)
        return cls(shape, acts, align, inter, inter_scales, pair_rows, layout.topk_weights.reshape(-1).contiguous())

    def launch(self, gemm: str, config: TileConfig, prepared: PreparedWeights) -> None:
        if gemm == "gate_up":
            grouped_gemm(self.acts.values, prepared.w13, self.inter, self.align, config, a_scale=self.acts.scales,
                         b_scale=prepared.w13_scale, a_row_div=self.shape.top_k, gated=True)
        else:
            grouped_gemm(self.inter, prepared.w2, self.pair_rows, self.align, config, a_scale=self.inter_scales,
                         b_scale=prepared.w2_scale, routed_weights=self.routed)


def replay_ms(fn) -> float:
    try:
        return do_bench_cudagraph(fn, rep=10, return_mode="median")
    except Exception as exc:  # too much shared memory or registers for this GPU: not a candidate
        print(f"  skip: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
        return float("inf")


@attrs.frozen
class Job:
    """One kernel variant to compile: a GEMM's tile over a direct alignment or a sorted one."""

    gemm: str
    config: TileConfig
    direct: bool

    @property
    def tokens(self) -> int:
        return 1 if self.direct else 64  # one token aligns directly; 64 at top-8 sort


def _compile_some(args) -> int:
    """Pool worker: launch each job once on a few experts, which leaves its binary in Triton's disk cache."""
    shape_name, fp8, jobs = args
    full = SHAPES[shape_name]
    shape = attrs.evolve(full, experts=full.ep_size * full.top_k)  # strides are those of any expert count
    prepared = PreparedWeights.from_expert_weights(make_weights(shape, fp8))
    cases = {}
    for job in jobs:
        key = job.config.block_m, job.config.tail_m, job.direct
        if key not in cases:
            cases[key] = Case.build(shape, make_layout(shape, job.tokens), prepared, *key[:2])
        try:
            cases[key].launch(job.gemm, job.config, prepared)
        except Exception:  # out of resources: the main process skips it too
            pass
    torch.cuda.synchronize()
    return len(jobs)


def compile_jobs(spaces, tokens, rows_per_expert, top_k: int) -> list[Job]:
    """Every variant the search will time: each (BLOCK_M, TAIL_M) a token count tries, direct or sorted as it aligns."""
    variants = {(gemm, tiles, can_align_direct(m, top_k, tiles[0]))
                for m in tokens for tiles in row_tiles(rows_per_expert[m]) for gemm in GEMMS}
    return [Job(gemm, config, direct) for gemm, tiles, direct in sorted(variants) for config in spaces[gemm, tiles]]


def precompile(shape_name: str, fp8: bool, jobs: list[Job], workers: int) -> None:
    started = time.monotonic()
    chunks = [(shape_name, fp8, jobs[i::workers]) for i in range(workers)]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        done = sum(pool.map(_compile_some, chunks))
    print(f"compiled {done} candidates in {time.monotonic() - started:.0f}s on {workers} processes", flush=True)


def whole_ms(tiles: MoETiles, layout, prepared: PreparedWeights) -> float:
    def run():
        acts = activations(layout.hidden, None, prepared)
        return moe_standard(acts, layout.topk_ids, layout.topk_weights, prepared, tiles)
    return replay_ms(run)


def check(layout, prepared, tiles: MoETiles, reference, fp8: bool) -> None:
    """A winner must still compute the right thing: compare with the torch kernel."""
    acts = activations(layout.hidden, None, prepared)
    ours = moe_standard(acts, layout.topk_ids, layout.topk_weights, prepared, tiles).float()
    want = reference.float()
    error = ((ours - want).norm() / want.norm().clamp_min(1e-30)).item()
    limit = 6e-2 if fp8 else 2e-2  # w8a8 also quantizes activations; the reference does not
    if not error <= limit:
        raise SystemExit(f"{tiles} at M={layout.num_rows} is off by {error:.3g} (limit {limit}); table not written")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="deepseek-v3-ep8", help="expert shapes of one EP rank")
    parser.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16", help="weight format, as in fused_moe.py")
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS, help="token counts M to tune")
    parser.add_argument("--budget-s", type=float, default=480.0, help="stop searching after this many seconds")
    parser.add_argument("--workers", type=int, default=max(1, min(16, (os.cpu_count() or 2) - 2)),
                        help="processes that compile candidates before the search")
    parser.add_argument("--table-dir", default=str(CONFIG_DIR),
                        help="where to write the JSON table (the incumbent is always read from the plugin's tables)")
    parser.add_argument("--log", help="CSV file of every timing")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("tuning needs the GPU the table is for, and no CUDA device is visible")
    started = time.monotonic()
    shape, fp8 = SHAPES[args.shape], args.dtype == "fp8"
    weights = make_weights(shape, fp8)
    prepared = PreparedWeights.from_expert_weights(weights)
    layouts = {m: make_layout(shape, m, seed=m) for m in args.tokens}
    # the table's key: the rows each local expert receives (what the plugin looks tiles up by)
    rows_per_expert = {m: float(f"{int((layout.topk_ids >= 0).sum()) / shape.local_experts:.4g}")
                       for m, layout in layouts.items()}
    spaces = {(gemm, tiles): gemm_space(gemm, *tiles, fp8) for gemm in GEMMS
              for tiles in {t for m in args.tokens for t in row_tiles(rows_per_expert[m])}}
    precompile(args.shape, fp8, compile_jobs(spaces, args.tokens, rows_per_expert, shape.top_k), args.workers)
    dtype = dtype_name(torch.bfloat16, fp8)
    name = table_file(device_name(torch.device("cuda"), False), dtype, shape.local_experts, shape.intermediate,
                      shape.hidden)
    table = read_table(CONFIG_DIR / name) or {}
    log_file = open(args.log, "w", newline="") if args.log else None
    log = csv.writer(log_file) if log_file else None

    torch_kernel = lookup("moe_kernel", "torch")(context(shape))
    torch_weights = torch_kernel.prepare_weights(weights)
    for m, layout in layouts.items():
        finalists = {default_tiles(rows_per_expert[m], dtype, False), table.get(rows_per_expert[m])} - {None}
        for tiles in row_tiles(rows_per_expert[m]):
            case = Case.build(shape, layout, prepared, *tiles)
            best = {}
            for gemm in GEMMS:
                timed = []
                for config in spaces[gemm, tiles]:
                    if time.monotonic() - started > args.budget_s:
                        break
                    ms = replay_ms(lambda: case.launch(gemm, config, prepared))
                    timed.append((ms, config))
                    if log:
                        log.writerow([args.shape, args.dtype, m, gemm, *attrs.astuple(config), f"{ms * 1e3:.2f}"])
                if timed:
                    best[gemm] = min(timed, key=lambda pair: pair[0])
            if len(best) == len(GEMMS):
                finalists.add(MoETiles(best["gate_up"][1], best["down"][1]))
                print(f"M={m} BLOCK_M, TAIL_M={tiles}: gate_up {best['gate_up'][0] * 1e3:.1f} µs, "
                      f"down {best['down'][0] * 1e3:.1f} µs", flush=True)
            del case
        ms, tiles = min(((whole_ms(t, layout, prepared), t) for t in finalists), key=lambda pair: pair[0])
        check(layout, prepared, tiles, torch_kernel.apply(layout, torch_weights).hidden, fp8)
        table[rows_per_expert[m]] = tiles
        print(f"M={m} ({rows_per_expert[m]:g} rows per expert): {ms * 1e3:.1f} µs with {tiles}  [{time.monotonic() - started:.0f}s]", flush=True)
    if log_file:
        log_file.close()
    path = Path(args.table_dir) / name
    write_table(path, table)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
