"""DeepSeek-V3's MTP (NextN) layer as the draft model, chained for any number of steps.

After every target forward (`observe`) the MTP layer runs over the positions the target kept, with the
target's hidden states and the tokens that followed them: that writes the layer's own KV (one pool layer,
in the request's pages) and, at a decoding request's last kept position p - 1, predicts the token after its
next one: the first draft, for free. `propose` then chains: step j runs the layer at position p + j - 2 on
its own hidden state of the step before and draft j - 1. One MTP layer serves every step (as SGLang runs
DeepSeek's single layer); the chain's KV rows beyond p are rewritten by the next observe from the target's
own hidden states where the target keeps those positions. Drafts are greedy point masses.
"""

from __future__ import annotations

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

    @torch.inference_mode()
    def observe(self, step: TargetStep) -> None:
        context = self.context
        batch = context.batch_of(list(zip(step.next_ids, step.starts, step.pages)))
        hidden, logits = self.layer(self.layer.from_target(step.hidden), batch, context.kv)
        last = batch.last_token_index
        drafts = torch.argmax(logits, dim=-1).tolist()
        for i, rid in enumerate(step.rids):
            self.starts[rid] = ChainStart(step.starts[i] + len(step.next_ids[i]) - 1, drafts[i], hidden[last[i]])

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest]) -> Drafts:
        tokens: list[list[int]] = []
        chains = []  # (row in tokens, request, hidden) of the requests whose chain goes on
        for request in requests:
            start = self.starts.get(request.rid)
            if start is None or start.position != request.num_cached - 1 or self.num_steps < 1:
                tokens.append([])  # nothing observed at its last position (it was just preempted, say)
                continue
            tokens.append([start.draft])
            chains.append((len(tokens) - 1, request, start.hidden))
        page_size = self.context.kv.page_size
        for j in range(2, self.num_steps + 1):
            # step j runs position p + j - 2, whose KV row needs a page
            chains = [c for c in chains if c[1].num_cached + j - 1 <= len(c[1].pages) * page_size]
            if not chains:
                break
            batch = self.context.batch_of(
                [([tokens[row][-1]], request.num_cached + j - 2, request.pages) for row, request, _ in chains]
            )
            hidden, logits = self.layer(torch.stack([h for _, _, h in chains]), batch, self.context.kv)
            for (row, request, _), token, h in zip(chains, torch.argmax(logits, dim=-1).tolist(), hidden):
                tokens[row].append(token)
            chains = [(row, request, h) for (row, request, _), h in zip(chains, hidden)]
        return Drafts(tokens)

    def finished(self, rid: str) -> None:
        self.starts.pop(rid, None)
