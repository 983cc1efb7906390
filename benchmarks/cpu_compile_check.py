"""Does torch.compile (inductor's CPU backend) get the MoE experts or decode attention where the C++ kernels do?
(issue #31, target 6: a hand-written kernel only where nothing else gets there.)

Inductor needs static shapes, so the experts are compiled in their two static forms (every expert on every token
with the routing folded in; every expert on all rows by batched matmuls, weighted after), and decode attention as
the padded gather + masked SDPA (the per-request loop has a data-dependent shape per request). Each is checked
against the eager path, then timed interleaved with today's ways and the C++ kernels (CPU time, one thread, best
of 5).

    python benchmarks/cpu_compile_check.py
"""
import time

import torch
import torch.nn.functional as F

from moeplex.attention.torch_ref import decode_by, decode_padded
from moeplex.batch_builder import ScheduledSeq, build_forward_batch
from moeplex.kv_cache import KVPool
from moeplex.plugins.moe_kernels import cpu_experts as ce

torch.set_num_threads(1)
gen = torch.Generator().manual_seed(0)
E, k, H, I = 32, 4, 512, 256
T = 48
w13 = (torch.randn(E, 2 * I, H, generator=gen) * H**-0.5); w2 = (torch.randn(E, H, I, generator=gen) * I**-0.5)
x = torch.randn(T, H, generator=gen); ids = torch.rand(T, E, generator=gen).argsort(1)[:, :k]; wt = torch.full((T, k), 1.0 / k)
experts = ce.CpuExperts(w13, w2, k, ce.Choice((1,), ("streamed",)))

def dense_moe(x, ids, wt, w13, w2):  # every expert on every token, routing folded in: static shapes for inductor
    dense = torch.zeros(x.shape[0], w13.shape[0]).scatter_add_(1, ids, wt)
    gate_up = torch.einsum("th,eih->tei", x, w13)
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) * up * dense[:, :, None]
    return torch.einsum("tei,ehi->th", act, w2)

def padded_moe(x, ids, wt, w13, w2):  # each expert's rows gathered into a fixed [E, T, H] block (static)
    onehot = torch.zeros(x.shape[0], w13.shape[0]).scatter_add_(1, ids, wt)  # [T, E]
    gate_up = torch.bmm(x.expand(w13.shape[0], -1, -1), w13.transpose(1, 2))
    gate, up = gate_up.chunk(2, dim=-1)
    y = torch.bmm(F.silu(gate) * up, w2.transpose(1, 2))  # [E, T, H]
    return torch.einsum("te,eth->th", onehot, y)

t0 = time.perf_counter(); cdense = torch.compile(dense_moe, dynamic=False); cdense(x, ids, wt, w13, w2); c1 = time.perf_counter() - t0
t0 = time.perf_counter(); cpad = torch.compile(padded_moe, dynamic=False); cpad(x, ids, wt, w13, w2); c2 = time.perf_counter() - t0
ref = experts.run(x, ids, wt, "grouped_mm")
for f in (cdense, cpad):
    torch.testing.assert_close(f(x, ids, wt, w13, w2), ref, rtol=1e-4, atol=1e-4)
ways = {"onednn (today's choice)": lambda: experts.run(x, ids, wt, "onednn"), "streamed (C++)": lambda: experts.run(x, ids, wt, "streamed"),
        "compiled every-expert": lambda: cdense(x, ids, wt, w13, w2), "compiled padded bmm": lambda: cpad(x, ids, wt, w13, w2)}
best = {n: 9 for n in ways}
for r in range(6):
    for n, f in ways.items():
        t = time.thread_time(); f(); d = time.thread_time() - t
        if r: best[n] = min(best[n], d)
print(f"MoE experts, Qwen3-small fp32 shapes, {T} tokens (compile {c1:.0f} s / {c2:.0f} s):", {n: f"{v*1e3:.2f} ms" for n, v in best.items()})

lengths = [100 + 300 * i // 47 for i in range(48)]
kv = KVPool(sum(-(-n // 16) for n in lengths) + 1, 16, [[(2, 128), (2, 128)]], torch.float32, "cpu")
for b in kv.layer(0): b.copy_(torch.randn(b.shape, generator=gen))
keys, values = kv.layer(0)
batch = build_forward_batch([ScheduledSeq([1], n - 1, kv.allocate(kv.pages_for(n))) for n in lengths], kv, "cpu")
q = torch.randn(48, 8, 128, generator=gen)
t0 = time.perf_counter(); cpadded = torch.compile(decode_padded, dynamic=False); cpadded(q, keys, values, batch, 0.1); c3 = time.perf_counter() - t0
torch.testing.assert_close(cpadded(q, keys, values, batch, 0.1), decode_by("slots", q, keys, values, batch, 0.1), rtol=1e-4, atol=1e-4)
evict = torch.empty(64 << 20, dtype=torch.uint8)
attn = {"pages (today's)": lambda: decode_by("pages", q, keys, values, batch, 0.1), "slots": lambda: decode_by("slots", q, keys, values, batch, 0.1),
        "padded, eager": lambda: decode_padded(q, keys, values, batch, 0.1), "padded, compiled": lambda: cpadded(q, keys, values, batch, 0.1),
        "in_place (C++)": lambda: decode_by("in_place", q, keys, values, batch, 0.1)}
best = {n: 9 for n in attn}
for r in range(6):
    for n, f in attn.items():
        evict.add_(1)
        t = time.thread_time(); f(); d = time.thread_time() - t
        if r: best[n] = min(best[n], d)
print(f"decode attention, Qwen3-small fp32, 48 requests, {sum(lengths)} tokens (compile {c3:.0f} s):", {n: f"{v*1e3:.2f} ms" for n, v in best.items()})
