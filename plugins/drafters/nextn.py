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
"""

from __future__ import annotations

import itertools
from typing import Sequence

import attrs
import torch

from moeplex.interfaces import DraftRequest, Drafter, DrafterCaps, DrafterContext, Drafts, TargetStep


@attrs.define
class ChainStart:
    position: int  # the last position the target kept (p - 1 for a request whose next input sits at p)
    draft: int  # the MTP layer's guess for the token at p + 1
    hidden: torch.Tensor  # [H] the layer's output hidden at that position (the next step's input)


class NextNDrafter(Drafter):
    caps = DrafterCaps(needs_weights=True, needs_hidden=True, architectures=frozenset({"deepseek_v3"}))

    def __init__(self, num_steps: int):
        super().__init__(num_steps)
        self.starts: dict[str, ChainStart] = {}

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
        context = self.context
        counts = [len(ids) for ids in step.next_ids]
        hidden = self.layer.from_target(step.hidden)
        # a verify step's few kept positions: one decode row each (a row at position 0 would make it an extend)
        if self.replays(sum(counts)) and min(step.starts) > 0:
            kept = zip(step.next_ids, step.starts, step.pages)
            batch = context.batch_of([([t], start + k, pages) for ids, start, pages in kept for k, t in enumerate(ids)])
            hidden, drafts = self.rows_step(batch, hidden)
            last = [end - 1 for end in itertools.accumulate(counts)]
            drafts = drafts[last].tolist()
        else:
            batch = context.batch_of(list(zip(step.next_ids, step.starts, step.pages)))
            hidden, logits = self.layer(hidden, batch, context.kv)
            last = batch.last_token_index
            drafts = torch.argmax(logits, dim=-1).tolist()
        for i, rid in enumerate(step.rids):
            self.starts[rid] = ChainStart(step.starts[i] + counts[i] - 1, drafts[i], hidden[last[i]])

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest]) -> Drafts:
        tokens: list[list[int]] = []
        chains = []  # (row in tokens, request) of the requests whose chain goes on
        starts = []  # their chain starts' hidden states
        for request in requests:
            start = self.starts.get(request.rid)
            if start is None or start.position != request.num_cached - 1 or self.num_steps < 1:
                tokens.append([])  # nothing observed at its last position (it was just preempted, say)
                continue
            tokens.append([start.draft])
            chains.append((len(tokens) - 1, request))
            starts.append(start.hidden)
        if not chains or self.num_steps < 2:
            return Drafts(tokens)
        page_size = self.context.kv.page_size
        hidden, drafted = torch.stack(starts), None  # drafted: the step before's drafts, on the device
        chained = []  # per step: (rows of tokens, its drafts on the device), read once at the end
        for j in range(2, self.num_steps + 1):
            # step j runs position p + j - 2, whose KV row needs a page (the scheduler reserves them: rarely false)
            keep = [k for k, (_, q) in enumerate(chains) if q.num_cached + j - 1 <= len(q.pages) * page_size]
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

    def finished(self, rid: str) -> None:
        self.starts.pop(rid, None)
