"""How the `torch` kernel runs one rank's experts on a CPU: five ways, and the choice between them measured
on the layer's own weights when they are prepared.

Which way is fastest depends on the processor more than on the model: on a Xeon with AMX, oneDNN's bf16
kernels make "every expert on every token" (`every_expert`) win at decode sizes and MKL's small fp32 GEMMs
are fine; on an AMD EPYC without AMX, MKL's fp32 GEMMs of a few rows run at a third of the core's speed
and oneDNN's per-expert linears are 1.5-2x faster (benchmarks/results/cpu_throughput.md). So nothing here
is chosen by processor name: `CpuExperts` times every way the dtype allows, on this layer's weights and
synthetic routings of three sizes (a few tokens, a decode batch, a prefill chunk), keeps the fastest per
size, and packs weights only for the ways it kept (and times the packed ways only while a packed copy of the
layer fits: `packed_copy_fits`, a quarter of the free host memory). The choice is a fact about this machine
and shape, so it is measured once per machine for each (shape, dtype, top-k) and kept (`measured_choice`):
every later layer, engine and process of that shape takes it, so a server's ranks, a prefill and a decode
server, and the same command run twice all compute alike.

The ways, each `(hidden, topk_ids, topk_weights) -> [tokens, H]` (weights applied, pairs summed; ids of
-1 are other ranks' pairs):
- `grouped_mm`: the pairs sorted by expert once, one `torch._grouped_mm` per projection;
- `onednn`: the same sorted rows, each expert's two projections as oneDNN linears on weights packed once
  (fp32 always; bf16/fp16 where oneDNN runs them);
- `padded_bmm`: the sorted rows padded per expert, one `torch.bmm` per projection (oneDNN's batched matmul;
  bf16/fp16 where oneDNN runs them);
- `every_expert`: every expert on every token as two GEMMs over all experts at once, the routing weights
  (zero for experts a token did not pick) folded into the activations; at most EVERY_EXPERT_TOKENS tokens
  (bf16/fp16 where oneDNN runs them);
- `streamed`: moeplex's C++ expert GEMM (`streamed_experts`) on weights packed for streaming, each expert's
  weights read once for all its rows (fp32/bf16, where the kernel builds: `streams`). On the AMD EPYC it is
  1.8-2.9x faster than oneDNN's per-expert linears at decode sizes (results/cpu_throughput.md);
- `streamed_tiles`: the same on the Intel AMX tile unit, for bf16 weights packed in pairs (`streams_on_tiles`), on
  the `streamed` packing.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Callable

import attrs
import torch
import torch.nn.functional as F

from moeplex.interfaces.kernels import (
    measured_choice,
    measuring_clock,
    onednn_runs,
    pack_for_streaming,
    packed_copy_fits,
    streamed_experts,
    streams,
    streams_on_tiles,
)

log = logging.getLogger(__name__)

EVERY_EXPERT_TOKENS = 128  # every expert on every token reads each weight once but computes E/k times the pairs
ROUNDS = 3  # timed calls of each way at each size, interleaved; the fastest counts (noise only adds time)
PACKED_WAYS = ("onednn", "every_expert", "streamed")  # the ways that keep a packed copy of the weights
PACKING = {"streamed_tiles": "streamed"}  # a way that runs another's packed copy


def ways_for(dtype: torch.dtype, may_pack: bool = True, streamed: bool = False, tiles: bool = False) -> tuple[str, ...]:
    """The ways worth timing for weights of `dtype`; `may_pack` False: only those that need no packed copy;
    `streamed`: the C++ expert GEMM runs these weights (`streams`); `tiles`: its AMX form too (`streams_on_tiles`)."""
    if not (streamed and may_pack):
        return _torch_ways(dtype, may_pack)
    return _torch_ways(dtype, may_pack) + ("streamed",) + (("streamed_tiles",) if tiles else ())


def _torch_ways(dtype: torch.dtype, may_pack: bool) -> tuple[str, ...]:
    if not onednn_runs(dtype):
        return ("grouped_mm",)
    if dtype == torch.float32:  # fp32 batched matmuls and dense-over-experts go to MKL: never faster (measured)
        return ("grouped_mm", "onednn") if may_pack else ("grouped_mm",)
    if not may_pack:
        return ("grouped_mm", "padded_bmm")
    return ("grouped_mm", "onednn", "padded_bmm", "every_expert")


@attrs.frozen
class Choice:
    """The fastest way per size: sizes[i] tokens (a measured point) -> ways[i]; a call takes the measured
    size nearest its token count (in log scale). `table`: the milliseconds behind it, for the log."""

    sizes: tuple[int, ...] = attrs.field(converter=tuple)
    ways: tuple[str, ...] = attrs.field(converter=tuple)
    table: str = ""

    def way(self, tokens: int) -> str:
        if tokens <= 0:
            return self.ways[0]
        at = min(range(len(self.sizes)), key=lambda i: abs(math.log(tokens / self.sizes[i])))
        return self.ways[at]


class CpuExperts(tuple):
    """(w13, w2) as given (the other layouts' loops read them), the packed copies the chosen ways need, and
    the choice. `choice` None: this machine's measured one for the shape (measured now if there is none)."""

    def __new__(cls, w13: torch.Tensor, w2: torch.Tensor, top_k: int, choice: Choice | None = None):
        self = super().__new__(cls, (w13, w2))
        self.top_k = top_k
        self._packed: dict[str, tuple] = {}
        if choice is None:
            fits, streamed = packed_copy_fits(w13.nbytes + w2.nbytes), streams(w13, w2)
            ways = ways_for(w13.dtype, fits, streamed, streamed and fits and self._on_tiles())
            key = f"w13 {tuple(w13.shape)} w2 {tuple(w2.shape)} {w13.dtype} top-{top_k} {'/'.join(ways)}"
            choice = Choice(**measured_choice("moe_experts", key, lambda: attrs.asdict(self._measure(ways))))
        self.choice = choice
        # the chosen ways' packings (made by the measurement, or now); the others' are let go
        chosen = {PACKING.get(way, way) for way in self.choice.ways}
        self._packed = {way: self._packing(way) for way in chosen if way in PACKED_WAYS}
        return self

    def _on_tiles(self) -> bool:
        return self[0].dtype == torch.bfloat16 and streams_on_tiles(self._packing("streamed"))

    # --- the call ------------------------------------------------------------------------------------
    def takes(self, hidden: torch.Tensor) -> bool:
        return hidden.dtype == self[0].dtype

    def run(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, way: str | None = None):
        way = way or self.choice.way(hidden.shape[0])
        if way == "every_expert" and hidden.shape[0] > EVERY_EXPERT_TOKENS:
            way = "grouped_mm"
        if way == "every_expert":
            return self._every_expert(hidden, topk_ids, topk_weights)
        if way in ("streamed", "streamed_tiles"):
            return streamed_experts(hidden, topk_ids, topk_weights, self._packing("streamed"), tiles=way == "streamed_tiles")
        return sorted_pairs(hidden, topk_ids, topk_weights, len(self[0]), self._sorted_way(way))

    def _sorted_way(self, way: str) -> Callable[[torch.Tensor, list[int]], torch.Tensor]:
        if way == "onednn":
            return self._onednn
        if way == "padded_bmm":
            return functools.partial(padded_bmm, weights=self)
        return functools.partial(grouped_mm, weights=self)

    # --- the ways ------------------------------------------------------------------------------------
    def _pack(self, way: str) -> tuple:
        w13, w2 = self
        if way == "streamed":
            return pack_for_streaming(w13, w2)
        pack = torch.ops.mkldnn._reorder_linear_weight
        if way == "onednn":
            return tuple(pack(w13[e].contiguous()) for e in range(len(w13))), tuple(pack(w2[e].contiguous()) for e in range(len(w2)))
        experts, hidden, inter = w2.shape  # every_expert: gate/up of all experts as one weight, downs side by side
        return pack(w13.reshape(experts * 2 * inter, hidden)), pack(w2.permute(1, 0, 2).reshape(hidden, experts * inter))

    def _packing(self, way: str) -> tuple:
        if way not in self._packed:  # a way not chosen, run by the measurement or a test
            self._packed[way] = self._pack(way)
        return self._packed[way]

    def _onednn(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        gate_up, down = self._packing("onednn")
        linear = torch.ops.mkldnn._linear_pointwise
        rows = []
        for e, group in enumerate(x.split(counts)):
            if group.shape[0]:
                gate, up = linear(group, gate_up[e], None, "none", [], "").chunk(2, dim=-1)
                rows.append(linear(F.silu(gate) * up, down[e], None, "none", [], ""))
        return torch.cat(rows) if rows else x.new_empty(0, self[1].shape[1])

    def _every_expert(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        tokens, experts = hidden.shape[0], len(self[0])
        if tokens == 0:  # oneDNN's linear takes no empty batch
            return hidden.new_zeros(0, self[1].shape[1])
        gate_up_w, down_w = self._packing("every_expert")
        gate_up = torch.ops.mkldnn._linear_pointwise(hidden, gate_up_w, None, "none", [], "")
        gate, up = gate_up.view(tokens, experts, 2, -1).unbind(2)
        picked = topk_ids >= 0
        dense = hidden.new_zeros(tokens, experts).scatter_add_(
            1, topk_ids.clamp_min(0), torch.where(picked, topk_weights, 0).to(hidden.dtype)
        )
        act = F.silu(gate).mul_(up).mul_(dense[:, :, None])
        if hidden.dtype == torch.float16:  # an expert a token did not pick can overflow fp16's range (inf), and
            act.masked_fill_(dense[:, :, None] == 0, 0)  # inf x 0 is NaN: such rows are zero (bf16 has fp32's range)
        return torch.ops.mkldnn._linear_pointwise(act.reshape(tokens, -1), down_w, None, "none", [], "")

    # --- the measurement -----------------------------------------------------------------------------
    def sizes(self) -> tuple[int, ...]:
        """Token counts measured: a few tokens (half the experts hit), a decode batch (4 rows per expert),
        a prefill chunk (32 rows per expert, at most 1024 tokens)."""
        experts, k = len(self[0]), self.top_k
        return tuple(sorted({max(1, experts // (2 * k)), max(2, 4 * experts // k), max(4, min(1024, 32 * experts // k))}))

    def _measure(self, ways: tuple[str, ...]) -> Choice:
        w13, w2 = self
        sizes = self.sizes()
        if len(ways) == 1:
            return Choice(sizes, ways * len(sizes))
        gen = torch.Generator().manual_seed(0)
        clock = measuring_clock()
        picked, lines = [], []
        for tokens in sizes:
            hidden = torch.randn(tokens, w13.shape[2], generator=gen).to(w13.dtype)
            ids = torch.rand(tokens, len(w13), generator=gen).argsort(dim=1)[:, : self.top_k]
            weights = torch.full((tokens, self.top_k), 1.0 / self.top_k, dtype=torch.float32)
            usable = [w for w in ways if w != "every_expert" or tokens <= EVERY_EXPERT_TOKENS]
            best = {w: float("inf") for w in usable}
            for round in range(ROUNDS + 1):  # the first round warms up (packing, oneDNN's kernel builds)
                for way in usable:
                    start = clock()
                    self.run(hidden, ids, weights, way)
                    if round:
                        best[way] = min(best[way], clock() - start)
            picked.append(min(best, key=best.get))
            lines.append(f"{tokens} tokens: " + ", ".join(f"{w} {1e3 * t:.2f} ms" for w, t in best.items()))
        choice = Choice(sizes, tuple(picked), "; ".join(lines))
        log.info("CPU experts %s %s: %s (%s)", tuple(w13.shape), str(w13.dtype).removeprefix("torch."),
                 ", ".join(f"{t} tokens -> {w}" for t, w in zip(choice.sizes, choice.ways)), choice.table)
        return choice


def sorted_pairs(hidden, topk_ids, topk_weights, experts: int, run: Callable[[torch.Tensor, list[int]], torch.Tensor]):
    """The pairs sorted by expert once (one host read of the counts), `run(rows, counts)` over the sorted rows,
    the weighted rows summed back per token in fp32."""
    ids = topk_ids.flatten()
    counts = torch.bincount(ids + 1, minlength=experts + 1).tolist()  # bin 0: other ranks' pairs
    pairs = ids.argsort(stable=True)[counts[0] :]  # this rank's pairs, expert by expert
    token = pairs // topk_ids.shape[1]
    y = run(hidden.index_select(0, token), counts[1:])
    y = y.float() * topk_weights.flatten()[pairs, None].float()
    out = torch.zeros(hidden.shape[0], y.shape[1], dtype=torch.float32, device=hidden.device)
    return out.index_add_(0, token, y).to(hidden.dtype)


def grouped_mm(x: torch.Tensor, counts: list[int], weights) -> torch.Tensor:
    """Rows x [sum(counts), H] sorted by expert, counts[e] of them for expert e -> [sum(counts), H_out]."""
    w13, w2 = weights
    offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
    gate, up = torch._grouped_mm(x, w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)


def padded_bmm(x: torch.Tensor, counts: list[int], weights) -> torch.Tensor:
    """grouped_mm with each expert's rows padded to the most any expert got: two batched matmuls."""
    w13, w2 = weights
    experts, rows = len(counts), -(-max(counts, default=0) // 16) * 16  # oneDNN builds a kernel per new shape
    if not x.shape[0] or experts * rows > 8 * x.shape[0]:  # one expert crowded with most rows: padding would dominate
        return grouped_mm(x, counts, weights)
    count = torch.tensor(counts, device=x.device)
    expert = torch.repeat_interleave(torch.arange(experts, device=x.device), count, output_size=x.shape[0])
    first = count.cumsum(0) - count  # each expert's first row in x
    slot = expert * rows + torch.arange(x.shape[0], device=x.device) - first[expert]
    padded = x.new_zeros(experts * rows, x.shape[1]).index_copy_(0, slot, x).view(experts, rows, x.shape[1])
    gate, up = torch.bmm(padded, w13.transpose(1, 2)).chunk(2, dim=-1)
    return torch.bmm(F.silu(gate) * up, w2.transpose(1, 2)).view(experts * rows, w2.shape[1]).index_select(0, slot)
