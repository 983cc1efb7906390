"""Search tile configurations of the `triton` fused MoE kernel on this GPU and write its JSON table.

    python benchmarks/tune_fused_moe.py --shape deepseek-v3-ep8 --dtype fp8 --shard 0/3
    python benchmarks/tune_fused_moe.py --shape deepseek-v3-ep8 --dtype fp8 --shard 1/3   (and 2/3)

Every candidate runs the whole fused path (align, both GEMMs, finish) on the routing of
benchmarks/fused_moe.py, replayed as a CUDA graph (triton.testing.do_bench_cudagraph). Candidates are the outer loop, so each
compiles once and is timed at every token count. A search too long for one run is split with
--shard i/n; each run also re-times the entry already in the table and the default, and keeps the
fastest, so the shards merge into one table. --budget-s stops a run early with what it has. The
winners are checked against the torch reference before the table
(configs/E=..,N=..,K=..,device=..,dtype=...json in the plugin package) is written.
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import triton
from triton.testing import do_bench_cudagraph

from fused_moe import SHAPES, TOKENS, context, make_layout, make_weights  # benchmarks/fused_moe.py, beside this file

from moeplex.plugins.moe_kernels.triton_moe.configs import (
    CONFIG_DIR,
    TileConfig,
    default_config,
    device_name,
    dtype_name,
    read_table,
    table_file,
    write_table,
)
from moeplex.plugins.moe_kernels.triton_moe.fused import PreparedWeights, activations, moe_standard
from moeplex.registry import lookup


def search_space(fp8: bool) -> list[TileConfig]:
    block_ks = (128,) if fp8 else (64, 128)  # fp8: a K tile must sit inside one 128-wide scale group
    space = itertools.product((16, 32, 64, 128), (32, 64, 128), block_ks, (1, 16), (4, 8), (2, 3, 4))
    return [TileConfig(bm, bn, bk, group, warps, stages) for bm, bn, bk, group, warps, stages in space]


def worth_timing(config: TileConfig, rows_per_expert: float) -> bool:
    """Row tiles much taller than an expert's rows only multiply padding."""
    return config.block_m <= max(16, 2 * triton.next_power_of_2(max(1, int(rows_per_expert))))


def time_config(config: TileConfig, layout, prepared: PreparedWeights) -> float:
    def run():
        acts = activations(layout.hidden, None, prepared)
        return moe_standard(acts, layout.topk_ids, layout.topk_weights, prepared, config)

    try:
        # replayed as a CUDA graph, as decode runs it: timed eagerly, small M measures the host's launches
        return do_bench_cudagraph(run, rep=25, return_mode="median")
    except Exception as exc:  # too much shared memory or registers for this GPU: not a candidate
        print(f"  skip {config}: {type(exc).__name__}", flush=True)
        return float("inf")


def check(layout, prepared, config, reference, fp8: bool) -> None:
    """A winner must still compute the right thing: compare with the torch kernel."""
    acts = activations(layout.hidden, None, prepared)
    ours = moe_standard(acts, layout.topk_ids, layout.topk_weights, prepared, config).float()
    want = reference.float()
    error = ((ours - want).norm() / want.norm().clamp_min(1e-30)).item()
    limit = 6e-2 if fp8 else 2e-2  # w8a8 also quantizes activations; the reference does not
    if not error <= limit:
        raise SystemExit(f"config {config} at M={layout.num_rows} is off by {error:.3g} (limit {limit}); table not written")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="deepseek-v3-ep8", help="expert shapes of one EP rank")
    parser.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16", help="weight format, as in fused_moe.py")
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS, help="token counts M to tune")
    parser.add_argument("--shard", default="0/1", help="i/n: time every n-th candidate of the search space, from i")
    parser.add_argument("--budget-s", type=float, default=540.0, help="stop searching after this many seconds")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("tuning needs the GPU the table is for, and no CUDA device is visible")
    started = time.monotonic()
    shape, fp8 = SHAPES[args.shape], args.dtype == "fp8"
    shard, shards = map(int, args.shard.split("/"))
    weights = make_weights(shape, fp8)
    prepared = PreparedWeights.from_expert_weights(weights)
    layouts = {m: make_layout(shape, m, seed=m) for m in args.tokens}
    rows_per_expert = {m: int((layout.topk_ids >= 0).sum()) / shape.local_experts for m, layout in layouts.items()}
    dtype = dtype_name(torch.bfloat16, fp8)
    path = CONFIG_DIR / table_file(device_name(torch.device("cuda"), False), dtype, shape.local_experts,
                                   shape.intermediate, shape.hidden)
    table = read_table(path) or {}

    best: dict[int, tuple[float, TileConfig]] = {}
    for m, layout in layouts.items():  # the incumbent and the default first: every M ends with an answer
        for config in {default_config(m, shape.local_experts, shape.top_k, dtype, False), table.get(m)} - {None}:
            best[m] = min(best.get(m, (float("inf"), config)), (time_config(config, layout, prepared), config),
                          key=lambda pair: pair[0])
    candidates = search_space(fp8)[shard::shards]
    for index, config in enumerate(candidates):
        if time.monotonic() - started > args.budget_s:
            print(f"budget spent after {index} of {len(candidates)} candidates", flush=True)
            break
        for m, layout in layouts.items():
            if worth_timing(config, rows_per_expert[m]):
                ms = time_config(config, layout, prepared)
                if ms < best[m][0]:
                    best[m] = (ms, config)
        print(f"[{index + 1}/{len(candidates)}] {time.monotonic() - started:.0f}s", flush=True)

    torch_kernel = lookup("moe_kernel", "torch")(context(shape))
    torch_weights = torch_kernel.prepare_weights(weights)
    for m, layout in layouts.items():
        check(layout, prepared, best[m][1], torch_kernel.apply(layout, torch_weights).hidden, fp8)
        table[m] = best[m][1]
        print(f"M={m}: {best[m][0] * 1e3:.1f} µs with {best[m][1]}")
    write_table(path, table)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
