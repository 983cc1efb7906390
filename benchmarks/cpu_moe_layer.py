"""Time ways of running one MoE layer's experts on CPU at decode sizes (issue 22, target 6).

Every candidate takes the same routed tokens and the same expert weights (w13 [E, 2I, H], w2 [E, H, I])
and returns the weighted sum per token; each is checked against the first (`grouped`, the sorted rows
through `torch._grouped_mm`) before it is timed. The candidates run round robin, --repeats rounds of
--iters calls each; the best round's CPU time of the calling thread is reported (with one torch thread
the ops run on it, so time lost to other jobs on a shared machine is not counted).

    python benchmarks/cpu_moe_layer.py --shape deepseek-v3-small --tokens 16 32 48 --dtype fp32 bf16

`packed_cat` (bf16/fp16 only; the kernel's path at decode sizes since 2026-12-02) is `dense_cat` with both
weights packed once by oneDNN (`torch.ops.mkldnn._reorder_linear_weight`), so no call reorders them.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = {  # experts, top_k, hidden, moe intermediate
    "deepseek-v3-small": (64, 8, 384, 128),
    "qwen3-moe-small": (32, 4, 512, 256),
    "mixtral-small": (16, 2, 512, 512),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _route(tokens: int, experts: int, top_k: int, gen: torch.Generator):
    logits = torch.randn(tokens, experts, generator=gen)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return ids, weights


def _sorted(ids: torch.Tensor, experts: int):
    flat = ids.flatten()
    counts = torch.bincount(flat, minlength=experts)
    pairs = flat.argsort(stable=True)
    return counts, pairs, pairs // ids.shape[1]


def grouped(x, ids, w, w13, w2):
    counts, pairs, token = _sorted(ids, w13.shape[0])
    offs = counts.cumsum(0).to(torch.int32)
    gate, up = torch._grouped_mm(x.index_select(0, token), w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)
    y = y.float() * w.flatten()[pairs, None].float()
    return torch.zeros(x.shape[0], x.shape[1]).index_add_(0, token, y).to(x.dtype)


def padded_bmm(x, ids, w, w13, w2):
    """Rows padded per expert into [E, max_rows, H]; one bmm per projection over every expert."""
    experts = w13.shape[0]
    counts, pairs, token = _sorted(ids, experts)
    rows = -(-int(counts.max()) // 16) * 16  # as the kernel: a multiple of 16, so oneDNN reuses its kernels
    starts = counts.cumsum(0) - counts
    expert = ids.flatten()[pairs]
    slot = expert * rows + (torch.arange(pairs.numel()) - starts[expert])
    xp = x.new_zeros(experts * rows, x.shape[1]).index_copy_(0, slot, x.index_select(0, token))
    gate, up = torch.bmm(xp.view(experts, rows, -1), w13.transpose(1, 2)).chunk(2, dim=-1)
    y = torch.bmm(F.silu(gate) * up, w2.transpose(1, 2)).view(experts * rows, -1).index_select(0, slot)
    y = y.float() * w.flatten()[pairs, None].float()
    return torch.zeros(x.shape[0], x.shape[1]).index_add_(0, token, y).to(x.dtype)


def hit_bmm(x, ids, w, w13, w2):
    """As padded_bmm, over only the experts that got rows (their weights gathered)."""
    counts, pairs, token = _sorted(ids, w13.shape[0])
    hit = counts.nonzero().squeeze(1)
    c = counts[hit]
    rows = int(c.max())
    starts = c.cumsum(0) - c
    rank = torch.full((w13.shape[0],), -1, dtype=torch.long)
    rank[hit] = torch.arange(hit.numel())
    local = rank[ids.flatten()[pairs]]
    slot = local * rows + (torch.arange(pairs.numel()) - starts[local])
    xp = x.new_zeros(hit.numel() * rows, x.shape[1]).index_copy_(0, slot, x.index_select(0, token))
    gate, up = torch.bmm(xp.view(hit.numel(), rows, -1), w13[hit].transpose(1, 2)).chunk(2, dim=-1)
    y = torch.bmm(F.silu(gate) * up, w2[hit].transpose(1, 2)).view(hit.numel() * rows, -1).index_select(0, slot)
    y = y.float() * w.flatten()[pairs, None].float()
    return torch.zeros(x.shape[0], x.shape[1]).index_add_(0, token, y).to(x.dtype)


def dense(x, ids, w, w13, w2):
    """Every expert on every token: one GEMM for gate/up over all experts, one bmm down, weighted sum."""
    experts, two_i, hidden = w13.shape
    gate, up = F.linear(x, w13.view(experts * two_i, hidden)).view(-1, experts, two_i).chunk(2, dim=-1)
    dense_w = torch.zeros(x.shape[0], experts, dtype=x.dtype).scatter_(1, ids, w.to(x.dtype))
    h = (F.silu(gate) * up * dense_w[:, :, None]).transpose(0, 1)  # [E, T, I]
    return torch.bmm(h, w2.transpose(1, 2)).sum(0, dtype=torch.float32).to(x.dtype)


def dense_cat(x, ids, w, w13, w2, w2_cat):
    """dense, with the down projection as one GEMM over [T, E*I] x [E*I, H] (w2 pre-laid [H, E*I])."""
    experts, two_i, hidden = w13.shape
    gate, up = F.linear(x, w13.view(experts * two_i, hidden)).view(-1, experts, two_i).chunk(2, dim=-1)
    dense_w = torch.zeros(x.shape[0], experts, dtype=x.dtype).scatter_(1, ids, w.to(x.dtype))
    h = (F.silu(gate) * up * dense_w[:, :, None]).reshape(x.shape[0], -1)
    return F.linear(h, w2_cat)


def packed_cat(x, ids, w, w13_packed, w2_packed, experts):
    """dense_cat with both weights prepacked once for oneDNN (no per-call reorder; bf16/fp16 only)."""
    gate_up = torch.ops.mkldnn._linear_pointwise(x, w13_packed, None, "none", [], "")
    gate, up = gate_up.view(x.shape[0], experts, 2, -1).unbind(2)
    dense_w = torch.zeros(x.shape[0], gate.shape[1], dtype=x.dtype).scatter_(1, ids, w.to(x.dtype))
    h = (F.silu(gate) * up * dense_w[:, :, None]).reshape(x.shape[0], -1)
    return torch.ops.mkldnn._linear_pointwise(h, w2_packed, None, "none", [], "")


def loop(x, ids, w, w13, w2):
    counts, pairs, token = _sorted(ids, w13.shape[0])
    xs = x.index_select(0, token).split(counts.tolist())
    outs = []
    for e, rows in enumerate(xs):
        if rows.shape[0]:
            gate, up = F.linear(rows, w13[e]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, w2[e]))
    y = torch.cat(outs).float() * w.flatten()[pairs, None].float()
    return torch.zeros(x.shape[0], x.shape[1]).index_add_(0, token, y).to(x.dtype)


def _time(fn, args, iters: int) -> float:
    """CPU seconds of this thread per call: with one torch thread the ops run on it, and time spent
    descheduled by other jobs on a shared machine is not counted."""
    start = time.thread_time()
    for _ in range(iters):
        fn(*args)
    return (time.thread_time() - start) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", nargs="+", default=["deepseek-v3-small"], choices=sorted(SHAPES), help="layer shapes")
    p.add_argument("--tokens", nargs="+", type=int, default=[16, 32, 48], help="decode batch sizes")
    p.add_argument("--dtype", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES), help="dtypes")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: the shared-machine setting)")
    p.add_argument("--iters", type=int, default=10, help="calls per timed run")
    p.add_argument("--repeats", type=int, default=5, help="timed runs; the best is reported")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    names = ["grouped", "loop", "padded_bmm", "hit_bmm", "dense", "dense_cat", "packed_cat"]
    print(f"threads {args.threads}, best of {args.repeats} x {args.iters} calls, CPU ms per layer (speed-up over grouped)\n")
    print("| shape | dtype | tokens | " + " | ".join(names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for shape in args.shape:
        experts, top_k, hidden, inter = SHAPES[shape]
        for dname in args.dtype:
            dtype = DTYPES[dname]
            gen = torch.Generator().manual_seed(0)
            w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
            w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
            w2_cat = w2.permute(1, 0, 2).reshape(hidden, experts * inter).contiguous()
            packed = dtype != torch.float32  # oneDNN's prepacked linear takes bf16/fp16 here
            if packed:
                w13_packed = torch.ops.mkldnn._reorder_linear_weight(w13.reshape(-1, hidden), max(args.tokens))
                w2_packed = torch.ops.mkldnn._reorder_linear_weight(w2_cat, max(args.tokens))
            for tokens in args.tokens:
                x = torch.randn(tokens, hidden, generator=gen).to(dtype)
                ids, w = _route(tokens, experts, top_k, gen)
                ref = grouped(x, ids, w, w13, w2).float()
                calls = {}
                for name in names:
                    fn = globals()[name]
                    if name == "packed_cat" and not packed:
                        continue
                    calls[name] = (fn, (x, ids, w, w13, w2, w2_cat) if name == "dense_cat" else (x, ids, w, w13, w2))
                    if name == "packed_cat":
                        calls[name] = (fn, (x, ids, w, w13_packed, w2_packed, experts))
                    tol = 1e-4 if dtype == torch.float32 else 3e-2
                    torch.testing.assert_close(fn(*calls[name][1]).float(), ref, atol=tol, rtol=tol)
                best = {name: float("inf") for name in names}
                for _ in range(args.repeats):  # round robin, so a burst of load hits every candidate alike
                    for name, (fn, fargs) in calls.items():
                        best[name] = min(best[name], _time(fn, fargs, args.iters))
                cells = [f"{1e3 * best[n]:.2f} ({best['grouped'] / best[n]:.2f}x)" if n in calls else "-" for n in names]
                print(f"| {shape} | {dname} | {tokens} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
