"""DeepSeek-V3's MTP (NextN) layer as the draft model, chained for any number of steps.

After every target forward (`observe`) the MTP layer runs over the positions the target kept, with the
target's hidden states and the tokens that followed them: that writes the layer's own KV (one pool layer,
in the request's pages) and, at a decoding request's last kept position p - 1, predicts the token after its
next one: the first draft, for free. `propose` then chains: step j runs the layer at position p + j - 2 on
its own hidden state of the step before and draft j - 1. One MTP layer serves every step (as SGLang runs
DeepSeek's single layer); the chain's KV rows beyond p are rewritten by the next observe from the target's
own hidden states where the target keeps those positions. Drafts are greedy point masses.

The chain's steps are decode batches of one row per request, and so is `observe` where the target verified as
decode rows (a few kept positions per request, each a row reading the cache up to itself): both go through
`context.graphs_for`, which replays them from CUDA graphs on a GPU engine that captured its own decode steps.
Prompts and other extends run eagerly (their logits only at each request's last position).

A request that does not draft costs the layer nothing: `observe` keeps the target's hidden rows of the positions
it kept (Pending), and the layer runs over them in one batch when the request is next asked to draft, or, when
all requests together hold more than MAX_PENDING_ROWS rows, for the requests holding the most (in batches of at
most CATCH_UP_ROWS rows): the same rows, the same KV slots, computed later. A request holds its rows in
segments: under the overlap schedule a run of verify steps puts its positions through the layer on the device
(nextn_device.py), so the rows observed after such a run start a segment past those held from before it. The
engine's plain steps run under the overlap schedule and tell the drafter their rows one step late, so nothing here
reads the device: the chain starts' first drafts stay there until `propose` reads them all at once. A request that
ends while rows are pending never gets them written: a later request reusing those positions from the prefix cache
drafts from whatever MTP rows its pages hold there (worse drafts, never another token).

Why a budget over all requests and not a cap per request: a catch-up batch is one MTP layer forward, whose MoE
reads about every expert's weights once it holds a few hundred rows. Capped at 64 rows per request, a batch of
64 undrafted requests paid that read at nearly every step (~25% of a DeepSeek-V3 step); 16384 rows between
catch-ups make it ~1%, and hold 16384 x H hidden values (235 MB at DeepSeek-V3's 7168 in bf16).
"""

from __future__ import annotations

import itertools
import time
from typing import Sequence

import attrs
import torch

from moeplex.interfaces import (DeviceDrafts, DeviceTokens, DraftRequest, Drafter, DrafterCaps, DrafterContext, Drafts,
                                TargetStep)

from .nextn_device import MTPChain


@attrs.define
class ChainStart:
    position: int  # the last position the target kept (p - 1 for a request whose next input sits at p)
    draft: torch.Tensor  # [] the MTP layer's guess for the token at p + 1, on the device
    hidden: torch.Tensor  # [H] the layer's output hidden at that position (the next step's input)


SCRATCH_CONTEXT = 128  # proposal_cost: positions each timed row reads
ROUNDS = 3  # proposal_cost: timings, the fastest kept
MAX_PENDING_ROWS = 16384  # target hidden rows kept over all requests before the MTP layer catches up on some
CATCH_UP_ROWS = 4096  # the most rows one catch-up batch runs
# KV tokens the rows of a catch-up that holds a prompt's positions may read in all (every row reads its sequence up
# to itself): as the engine's prompt steps run as decode rows (the same bound, moeplex.model_runner.PROMPT_ROW_READS)
ROW_READS = 1 << 17


@attrs.define
class Pending:
    """Kept positions start .. start+len(next_ids)-1 of a request, not yet through the MTP layer."""

    start: int
    next_ids: list[int]
    pages: tuple
    hidden: list[torch.Tensor]  # the target's pre-norm hidden rows, in pieces of [rows, H]


def held_rows(segments: Sequence[Pending]) -> int:
    return sum(len(p.next_ids) for p in segments)


class NextNDrafter(Drafter):
    caps = DrafterCaps(needs_weights=True, needs_hidden=True, architectures=frozenset({"deepseek_v3"}),
                       drafts_on_device=True)

    def __init__(self, num_steps: int):
        super().__init__(num_steps)
        self.starts: dict[str, ChainStart] = {}
        self.pending: dict[str, list[Pending]] = {}  # per request, its held segments in position order
        self.pending_rows = 0  # rows held in `pending`, over all requests
        self.device_chain: MTPChain | None = None  # propose_on_device's (grown to the calls it serves)

    def kv_layers(self, model) -> list[list[tuple[int, ...]]]:
        return list(model.mtp_kv_shapes()[:1])  # the first MTP layer only: it serves every step

    def bind(self, context: DrafterContext) -> None:
        self.context = context
        self.layer = context.model.mtp_layers[0]
        if self.layer.layer_id != context.kv_layer_ids[0]:
            raise ValueError(f"the MTP layer caches in pool layer {self.layer.layer_id}, the engine gave {context.kv_layer_ids[0]}")
        self.rows_step, self.replays = self.step_rows, lambda rows: False  # eager: no graphs offered
        if context.graphs_for is not None:
            self.rows_step = context.graphs_for(self.step_rows, self.layer.eh_proj.weight.shape[0])
            self.replays = self.rows_step.can_replay

    def step_rows(self, batch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer over a batch of one-token rows: (new hidden [B, H], greedy next-next token [B]) per row.
        Reads only the batch's tensors (it is what the drafter's CUDA graphs capture)."""
        every_row = torch.arange(hidden.shape[0], device=hidden.device)
        new_hidden, logits = self.layer(hidden, batch, self.context.kv, logits_at=every_row)
        return new_hidden, torch.argmax(logits, dim=-1)

    @torch.inference_mode()
    def observe(self, step: TargetStep) -> None:
        """Keep the kept positions' hidden rows; the layer runs now only where all requests hold too many."""
        at = 0
        for rid, start, ids, pages in zip(step.rids, step.starts, step.next_ids, step.pages):
            rows = step.hidden[at : at + len(ids)]
            at += len(ids)
            segments = self.pending.setdefault(rid, [])
            held = segments[-1] if segments else None
            end = held.start + len(held.next_ids) if held is not None else start
            if start < end:  # before where it left off (preempted, prefilled again): start over
                self.pending_rows -= held_rows(segments)
                segments.clear()
            if start != end or not segments:  # (beyond it: the positions between went through the layer on the
                held = Pending(start, [], (), [])  # device, in verify steps under the overlap schedule)
                segments.append(held)
            held.next_ids.extend(ids)
            held.pages = tuple(pages)
            held.hidden.append(rows)
            self.pending_rows += len(ids)
        if self.pending_rows > MAX_PENDING_ROWS:  # the requests holding the most, down to half the budget
            holding = {rid: held_rows(segments) for rid, segments in self.pending.items()}
            due, left = [], self.pending_rows
            for rid in sorted(holding, key=lambda rid: -holding[rid]):
                if left <= MAX_PENDING_ROWS // 2:
                    break
                due.append(rid)
                left -= holding[rid]
            self.catch_up(due)

    @torch.inference_mode()
    def catch_up(self, rids: Sequence[str]) -> None:
        """Run the MTP layer over the pending rows of these requests, in batches of at most CATCH_UP_ROWS rows."""
        held = [(rid, segment) for rid in rids for segment in self.pending.pop(rid, ())]  # (a request's in order)
        while held:
            batch, rows = [], 0
            while held and (not batch or rows + len(held[0][1].next_ids) <= CATCH_UP_ROWS):
                batch.append(held.pop(0))
                rows += len(batch[-1][1].next_ids)
            self.pending_rows -= rows
            self.run_now(TargetStep(
                rids=[rid for rid, _ in batch], starts=[p.start for _, p in batch], next_ids=[p.next_ids for _, p in batch],
                pages=[p.pages for _, p in batch], hidden=torch.cat([row for _, p in batch for row in p.hidden]),
            ))

    @torch.inference_mode()
    def run_now(self, step: TargetStep) -> None:
        """The MTP layer over the kept positions of `step`: their KV rows, and each request's chain start."""
        context = self.context
        counts = [len(ids) for ids in step.next_ids]
        hidden = self.layer.from_target(step.hidden)
        # kept positions as one decode row each, where a captured step holds them: a verify step's few, and a
        # prompt's where its rows read at most ROW_READS cached tokens (a prompt beside verify rows made the whole
        # catch-up an eager extend: DeepSeek-V3 shapes on an H100, 32 requests, ~56 ms mixed verify steps against
        # ~25 ms overlapped ones)
        last = [end - 1 for end in itertools.accumulate(counts)]  # each request's last row (python ints: views only)
        reads = sum(n * (start + n) for n, start in zip(counts, step.starts))
        if self.replays(sum(counts)) and (min(step.starts) > 0 or reads <= ROW_READS):
            kept = zip(step.next_ids, step.starts, step.pages)
            batch = context.batch_of([([t], start + k, pages) for ids, start, pages in kept for k, t in enumerate(ids)],
                                     rows=True)
            hidden, drafts = self.rows_step(batch, hidden)
            draft_rows = last
        else:
            batch = context.batch_of(list(zip(step.next_ids, step.starts, step.pages)))
            hidden, logits = self.layer(hidden, batch, context.kv)
            drafts, draft_rows = torch.argmax(logits, dim=-1), range(len(counts))  # logits at each request's last row
        for i, rid in enumerate(step.rids):  # views on the device: propose reads them, never a step in flight
            self.starts[rid] = ChainStart(step.starts[i] + counts[i] - 1, drafts[draft_rows[i]], hidden[last[i]])

    def proposal_cost(self, n: int) -> float:
        return self.proposal_costs(n)[-1]

    @torch.inference_mode()
    def proposal_costs(self, n: int) -> list[float]:
        """The chain's device work for n requests and d = 1 .. num_steps drafts each: d MTP row batches of n rows
        (the catch-up's last row, which gives the first draft, then one per further draft), each row reading
        SCRATCH_CONTEXT positions of the pool's scratch page, the fastest of ROUNDS timings. A catch-up's other
        rows (the plain steps since the request last drafted) are left out: they cost the same whenever the
        request drafts again."""
        kv, context = self.context.kv, self.context
        pages = [kv.scratch_page] * kv.pages_for(SCRATCH_CONTEXT + self.num_steps + 1)
        # rows that differ (ids spread over the vocabulary, random hidden states): real rows route to many experts,
        # and n equal rows to the same top-k (on an H100 a chain step of 32 requests was priced at under half its cost)
        vocab = max(context.vocab_size, 1)
        batch = context.batch_of([([i * 7919 % vocab], SCRATCH_CONTEXT, pages) for i in range(n)])
        weight = self.layer.eh_proj.weight
        noise = torch.randn(n, weight.shape[0], generator=torch.Generator().manual_seed(n))
        hidden = noise.to(device=context.device, dtype=weight.dtype)

        def chain(steps: int) -> None:
            out = hidden
            for _ in range(steps):
                out, drafted = self.rows_step(batch, out)
            drafted.tolist()  # the host reads the drafts, as propose does

        steps = range(1, max(self.num_steps, 1) + 1)
        chain(steps[-1])  # warm-up
        best = [float("inf")] * len(steps)
        for _ in range(ROUNDS):  # interleaved: a burst of interference spoils one timing of each length, not all
            for i, d in enumerate(steps):
                start = time.perf_counter()
                chain(d)
                best[i] = min(best[i], time.perf_counter() - start)
        return [max(best[: i + 1]) for i in range(len(best))]  # more steps never cost less

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest]) -> Drafts:
        self.catch_up([request.rid for request in requests])
        tokens: list[list[int]] = []
        chains = []  # (row in tokens, request) of the requests whose chain goes on
        starts = []  # their chain starts
        for request in requests:
            start = self.starts.get(request.rid)
            if start is None or start.position != request.num_cached - 1 or self.num_steps < 1:
                tokens.append([])  # nothing observed at its last position (it was just preempted, say)
                continue
            tokens.append([])
            chains.append((len(tokens) - 1, request))
            starts.append(start)
        if chains:  # the first drafts, read in one copy
            for (row, _), draft in zip(chains, torch.stack([start.draft for start in starts]).tolist()):
                tokens[row].append(draft)
        if not chains or self.num_steps < 2:
            return Drafts(tokens)
        page_size = self.context.kv.page_size
        hidden, drafted = torch.stack([start.hidden for start in starts]), None  # drafted: the step before's drafts
        chained = []  # per step: (rows of tokens, its drafts on the device), read once at the end
        for j in range(2, self.num_steps + 1):
            # step j runs position p + j - 2, whose KV row needs a page (the scheduler reserves them: rarely false),
            # for the requests the engine verifies j drafts of
            keep = [k for k, (_, q) in enumerate(chains) if q.num_cached + j - 1 <= len(q.pages) * page_size
                    and (q.max_drafts is None or q.max_drafts >= j)]
            if not keep:
                break
            if len(keep) < len(chains):
                chains, hidden = [chains[k] for k in keep], hidden[keep]
                drafted = None if drafted is None else drafted[keep]
            batch = self.context.batch_of(
                [([tokens[row][-1]], request.num_cached + j - 2, request.pages) for row, request in chains]
            )
            if drafted is not None:  # the ids in the batch are step 1's; the host has not waited for the later ones
                batch.input_ids.copy_(drafted)
            hidden, drafted = self.rows_step(batch, hidden)
            chained.append(([row for row, _ in chains], drafted))
        for rows, drafts in chained:
            for row, token in zip(rows, drafts.tolist()):
                tokens[row].append(token)
        return Drafts(tokens)

    def propose_on_device(self, requests: Sequence[DraftRequest], pending: DeviceTokens | None = None) -> DeviceDrafts:
        """The drafts `propose` would give after each request's pending tokens, from their hidden rows, left on the
        device (nextn_device.py)."""
        width = 0 if pending is None else pending.tokens.shape[1]
        chain = self.device_chain
        if chain is None or not chain.fits(requests, width):
            rows = max(len(requests), 1 if chain is None else chain.max_rows)
            pages = max([len(r.pages) for r in requests] + [1 if chain is None else chain.max_pages])
            chain = self.device_chain = MTPChain(self, rows, max(width, self.num_steps + 1), pages)
        chain.stage(requests, len(requests))
        if pending is None:  # every chain starts from the host's state; it goes as far as some request verifies
            device = self.context.device
            most = max((self.num_steps if r.max_drafts is None else r.max_drafts for r in requests), default=0)
            pending = DeviceTokens(torch.zeros(len(requests), 0, dtype=torch.int64, device=device),
                                   torch.zeros(len(requests), dtype=torch.int64, device=device), max_drafts=most)
        return chain.propose(pending)

    def static_proposer(self, max_rows: int, pending_width: int) -> MTPChain:
        """propose_on_device at fixed shapes, for the overlapped verify step's CUDA graphs: page tables as wide as
        the target's decode graphs'."""
        kv, config = self.context.kv, self.context.model.hf_config
        longest = config.get("max_position_embeddings")
        pages = kv.num_pages if longest is None else min(kv.num_pages, kv.pages_for(longest))
        return MTPChain(self, max_rows, pending_width, max(pages, 1))

    def finished(self, rid: str) -> None:
        self.starts.pop(rid, None)
        self.pending_rows -= held_rows(self.pending.pop(rid, ()))
