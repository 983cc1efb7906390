"""moeplex's C++ CPU kernels against the ways chosen before them, per kernel, in one process (issue #31, target 6).

- experts: one MoE layer's routed experts at decode sizes: the `streamed` way (csrc/expert_gemm.cpp; `streamed_tiles`,
  its AMX form, for bf16 where the processor has it) against
  every torch way CpuExperts times (grouped_mm, oneDNN per-expert linears, padded bmm, every expert), on
  --layers copies of the weights used in turn (so, as in a model, a layer's weights are not in cache when it runs);
- attention: decode over a paged KV cache of --requests requests (lengths spread as a decode batch's): `in_place`
  (csrc/paged_decode.cpp; `in_place_tiles`, the same on the AMX tile unit, for bf16 where the processor has it) against gathering each request's KV by slots or by pages for SDPA, the cache cold.

Each run times every way once per round, interleaved, --rounds rounds, best round kept (CPU time of the calling
thread with one torch thread: time other jobs take is not counted); --runs runs; the table gives each way's
median over runs, the spread (min-max), and the speed-up: the fastest torch way (what the measured choice
took before the kernel) over the kernel, median with its range over runs.

    python benchmarks/cpu_kernels.py                      # the three small checkpoints' shapes, 3 runs
    python benchmarks/cpu_kernels.py --tiny --runs 1      # a smoke run (CI-sized shapes)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moeplex.attention.torch_ref import PagedGather, decode_by
from moeplex.batch_builder import ScheduledSeq, build_forward_batch
from moeplex.kv_cache import KVPool
from moeplex.plugins.moe_kernels import cpu_experts as ce
from report import cpu_features, emit, processor

# name: (experts, top_k, hidden, moe intermediate, weight dtype; q heads, KV heads, key width, value width, latent)
SHAPES = {
    "qwen3-small": (32, 4, 512, 256, torch.float32, 8, 2, 128, 128, False),
    "mixtral-small": (16, 2, 512, 512, torch.float32, 8, 2, 64, 64, False),
    "dsv3-small": (64, 8, 384, 128, torch.bfloat16, 8, 1, 576, 512, True),  # MLA: the latent + rope as one head
}
TINY = {"tiny": (8, 2, 64, 32, torch.float32, 4, 2, 32, 32, False)}
PAGE = 16


def best_of_rounds(ways: dict, rounds: int) -> dict[str, float]:
    best = {name: float("inf") for name in ways}
    for round in range(rounds + 1):  # the first round warms up (packing, oneDNN's kernel builds)
        for name, call in ways.items():
            start = time.thread_time()
            call()
            if round:
                best[name] = min(best[name], time.thread_time() - start)
    return best


def expert_ways(shape, tokens: int, layers: int, gen) -> dict:
    experts, top_k, hidden, inter, dtype = shape[:5]
    copies = []
    for _ in range(layers):
        w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(dtype)
        w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).to(dtype)
        copies.append(ce.CpuExperts(w13, w2, top_k, ce.Choice((1,), ("grouped_mm",))))
    streamed = ce.streams(copies[0][0], copies[0][1])
    names = ce.ways_for(dtype, streamed=streamed, tiles=streamed and copies[0]._on_tiles())
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    ids = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k]
    weights = torch.full((tokens, top_k), 1.0 / top_k)
    reference = copies[0].run(x, ids, weights, "grouped_mm").float()
    for name in names:  # every way computes the same before it is timed
        torch.testing.assert_close(copies[0].run(x, ids, weights, name).float(), reference, rtol=2e-2, atol=2e-2)

    def way(name):
        return lambda: [layer.run(x, ids, weights, name) for layer in copies]

    return {name: way(name) for name in names if name != "every_expert" or tokens <= ce.EVERY_EXPERT_TOKENS}


def attention_ways(shape, requests: int, longest: int, gen) -> tuple[dict, int]:
    q_heads, kv_heads, dk, dv, latent = shape[5:]
    dtype = shape[4]
    lengths = [longest // 4 + (3 * longest // 4) * i // max(requests - 1, 1) for i in range(requests)]
    kv = KVPool(sum(-(-n // PAGE) for n in lengths) + 1, PAGE, [[(kv_heads, dk)]] if latent else [[(kv_heads, dk), (kv_heads, dv)]],
                dtype, "cpu")
    for buffer in kv.layer(0):
        buffer.copy_(torch.randn(buffer.shape, generator=gen))
    keys = kv.layer(0)[0]
    values = keys[..., :dv] if latent else kv.layer(0)[1]
    batch = build_forward_batch([ScheduledSeq([1], n - 1, kv.allocate(kv.pages_for(n))) for n in lengths], kv, "cpu")
    q = torch.randn(requests, q_heads, dk, generator=gen).to(dtype)
    names = PagedGather.ways(q, keys, values, batch)
    reference = decode_by("slots", q, keys, values, batch, dk**-0.5).float()
    for name in names:
        torch.testing.assert_close(decode_by(name, q, keys, values, batch, dk**-0.5).float(), reference, rtol=2e-2, atol=2e-2)
    evict = torch.empty(64 << 20, dtype=torch.uint8)  # larger than the last-level cache: the KV is read from memory

    def way(name):
        def call():
            evict.add_(1)
            start = time.thread_time()
            decode_by(name, q, keys, values, batch, dk**-0.5)
            return time.thread_time() - start
        return call

    return {name: way(name) for name in names}, sum(lengths)


def attention_best(ways: dict, rounds: int) -> dict[str, float]:
    best = {name: float("inf") for name in ways}
    for round in range(rounds + 1):
        for name, call in ways.items():
            took = call()  # the eviction is not timed
            if round:
                best[name] = min(best[name], took)
    return best


def table_rows(kind: str, what: str, runs: list[dict[str, float]], kernels: tuple[str, ...]) -> str:
    """One table row; the speed-up is the fastest torch way over the fastest of the C++ kernel's ways (by median)."""
    names = list(runs[0])
    medians = {n: statistics.median(r[n] for r in runs) for n in names}
    torch_ways = [n for n in names if n not in kernels]
    built = [n for n in names if n in kernels]
    kernel = min(built, key=medians.get) if built else None
    cells = []
    for n in names:
        values = [r[n] * 1e3 for r in runs]
        cells.append(f"{n} {statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})")
    if kernel and torch_ways:
        ratios = [min(r[n] for n in torch_ways) / r[kernel] for r in runs]
        gain = f"**{statistics.median(ratios):.2f}x** ({min(ratios):.2f}-{max(ratios):.2f})"
        before = min(torch_ways, key=medians.get)
    else:
        gain, before = "kernel not built", min(names, key=medians.get)
    return f"| {kind} | {what} | {'; '.join(cells)} | {before} | {gain} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), help="model shapes to time")
    parser.add_argument("--tiny", action="store_true", help="CI-sized shapes only (a smoke run)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4, 16, 48], help="tokens per MoE call (decode batches)")
    parser.add_argument("--requests", type=int, default=48, help="decode batch for attention")
    parser.add_argument("--longest", type=int, default=400, help="the longest request's cached tokens (the shortest a quarter)")
    parser.add_argument("--layers", type=int, default=3, help="copies of the expert weights used in turn (cold weights)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per run (best kept)")
    parser.add_argument("--runs", type=int, default=3, help="runs (median and spread reported)")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shapes = TINY if args.tiny else {name: SHAPES[name] for name in args.shapes}
    if args.tiny:
        args.requests, args.longest, args.layers = 6, 64, 1
    lines = [f"Processor: {processor()} ({cpu_features()})", "",
             "| kernel | shape | per way: median ms (min-max over runs) | fastest torch way | torch / C++ |",
             "|---|---|---|---|---|"]
    gen = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():
        for tokens in args.tokens:
            ways = expert_ways(shape, tokens, args.layers, gen)
            runs = [best_of_rounds(ways, args.rounds) for _ in range(args.runs)]
            per_layer = [{n: t / args.layers for n, t in r.items()} for r in runs]
            lines.append(table_rows("experts", f"{name} {str(shape[4]).removeprefix('torch.')}, {tokens} tokens", per_layer, ("streamed", "streamed_tiles")))
        ways, rows = attention_ways(shape, args.requests, args.longest, gen)
        runs = [attention_best(ways, args.rounds) for _ in range(args.runs)]
        lines.append(table_rows("decode attention", f"{name} {str(shape[4]).removeprefix('torch.')}, {args.requests} requests, "
                                f"{rows} cached tokens", runs, ("in_place", "in_place_tiles")))
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
