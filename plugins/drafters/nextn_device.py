"""nextn's drafting on the device: verify steps of the MTP layer's drafts under the overlap schedule.

Verify step N + 1 is launched before the host reads step N (speculation/overlap.py), so its drafts come from step
N's outcome on the device: the tokens it emitted (DeviceTokens.tokens, counts) and the target's hidden rows of its
positions (DeviceTokens.hidden). `MTPChain.propose` does what the host path (nextn.py) does between two verify
steps, at shapes fixed by the row count:

  catch-up  the MTP layer over all W rows of each request's step N (row k at position q + k, where q is the
            request's num_cached as the host knows it: step N's first position), with the target's hidden row and
            the token emitted after it. Rows k >= the emitted count are padding: position 0, KV in the pool's
            scratch page. That writes the layer's KV of the kept positions, and the row of the last one gives the
            chain start (its output hidden, and its greedy token: the first draft).
  chain     steps j = 2 .. the drafts verified: one row per request at position q + emitted + j - 2, on the
            hidden state and draft of the step before (the host path's chain, row for row).

A request without a row in step N (the run's first step, or one that joined it) starts from the host's chain start
(`stage`: the plain steps' rows it holds go through the layer first, as the host path's `propose` does). A row's
drafts stop where its pages end or where the engine verifies no more (DraftRequest.max_drafts), and rows of no
request (padding) draft nothing. Every op reads device tensors only: the engine captures `propose` in a CUDA graph
with the rest of the verify step (StaticProposer), or runs it as it is (`NextNDrafter.propose_on_device`).

The KV rows the chain writes beyond the kept positions are the chain's guesses; the next catch-up rewrites the
positions the target keeps from its own hidden states, as on the host path.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from moeplex.interfaces import DeviceDrafts, DeviceTokens, DraftRequest, ForwardBatch, ForwardMode, StaticProposer

from .host_copies import pinned, to_device

START, PAGES, CHOSEN, HOST_OK = range(4)  # the staged integers' columns, per row


class MTPChain(StaticProposer):
    """The catch-up and the chain over static inputs: up to `max_rows` requests with pending steps of up to
    `pending_width` rows, page tables of up to `max_pages` pages."""

    def __init__(self, drafter, max_rows: int, pending_width: int, max_pages: int):
        context = drafter.context
        self.drafter, self.layer, self.kv = drafter, drafter.layer, context.kv
        self.steps, self.max_rows, self.pending_width = drafter.num_steps, max_rows, pending_width
        device = context.device
        weight = self.layer.eh_proj.weight
        rows = max_rows * max(pending_width, 1)  # the catch-up's rows

        def ints(*shape, dtype=torch.int64):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.staged = ints(max_rows, 4)
        self.table = ints(max_rows, max_pages, dtype=torch.int32)
        self.host_hidden = torch.zeros(max_rows, weight.shape[0], dtype=weight.dtype, device=device)
        self.host_draft = ints(max_rows)
        # the MTP batches' static inputs (a batch of n rows reads their first n)
        self.input_ids, self.positions, self.seq_lens, self.out_cache_loc = ints(rows), ints(rows), ints(rows), ints(rows)
        self.page_table = ints(rows, max_pages, dtype=torch.int32)
        self.every_row = torch.arange(rows, device=device)
        # on a CPU the batches carry flattened KV indices too (an attention backend that reads them; no wait there)
        self.ragged = device.type != "cuda"
        self.bound = max_pages * self.kv.page_size  # host lengths the batches claim: an upper bound of every row's

    @property
    def max_pages(self) -> int:
        return self.table.shape[1]

    def fits(self, requests: Sequence[DraftRequest], pending_width: int) -> bool:
        return (len(requests) <= self.max_rows and pending_width <= max(self.pending_width, 1)
                and all(len(r.pages) <= self.max_pages for r in requests))

    # --- host ------------------------------------------------------------------------------------------------
    def stage(self, requests: Sequence[DraftRequest], rows: int) -> None:
        drafter = self.drafter
        # the plain steps' rows each request that drafts holds: its chain start now (one that drafts nothing keeps
        # them until it does, or ends: a verify step for one request does not run the layer over every request's)
        drafter.catch_up([r.rid for r in requests if r.max_drafts != 0])
        staged = np.zeros((rows, 4), dtype=np.int64)
        pages = max([len(r.pages) for r in requests] + [1])
        table = np.full((rows, pages), self.kv.scratch_page, dtype=np.int32)
        known, hidden, drafts = [], [], []
        for i, request in enumerate(requests):
            start = drafter.starts.get(request.rid)
            ok = start is not None and start.position == request.num_cached - 1
            chosen = self.steps if request.max_drafts is None else min(request.max_drafts, self.steps)
            staged[i] = (request.num_cached, len(request.pages), chosen, ok)
            table[i, : len(request.pages)] = request.pages
            if ok:
                known.append(i)
                hidden.append(start.hidden)
                drafts.append(start.draft)
        device = self.staged.device
        self.staged[:rows].copy_(pinned(device, torch.from_numpy(staged)), non_blocking=True)
        self.table[:rows, :pages].copy_(pinned(device, torch.from_numpy(table)), non_blocking=True)
        if known:  # the host's chain starts, already on the device: two copies for the batch
            at = to_device(device, torch.tensor(known, dtype=torch.int64))
            self.host_hidden.index_copy_(0, at, torch.stack(hidden))
            self.host_draft.index_copy_(0, at, torch.stack(drafts))
        if self.ragged:
            self.bound = max([r.num_cached for r in requests] + [0]) + 2 * (self.steps + 1)

    # --- device ----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, pending: DeviceTokens) -> DeviceDrafts:
        rows, width = pending.tokens.shape
        start, pages, chosen, host_ok = self.staged[:rows].unbind(1)
        table = self.table[:rows]
        counts = pending.counts
        had = counts > 0
        if width:
            if pending.hidden is None:
                raise ValueError("nextn drafts after a step the host has not read only from its hidden rows")
            k = torch.arange(width, device=table.device)
            valid = k[None, :] < counts[:, None]
            batch = self._batch(rows * width, pending.tokens.clamp_min(0).flatten(), (start[:, None] + k).flatten(),
                                table.repeat_interleave(width, dim=0), valid.flatten())
            last = self.every_row[:rows] * width + (counts - 1).clamp_min(0)
            hidden_in = self.layer.from_target(pending.hidden.reshape(rows * width, -1))
            out, logits = self.layer(hidden_in, batch, self.kv, logits_at=last)
            hidden = torch.where(had[:, None], out[last], self.host_hidden[:rows])
            draft = torch.where(had, torch.argmax(logits, dim=-1), self.host_draft[:rows])
        else:
            hidden, draft = self.host_hidden[:rows], self.host_draft[:rows]
        wanted = self.steps if pending.max_drafts is None else min(pending.max_drafts, self.steps)
        first = start + counts  # each request's next input position
        room = pages * self.kv.page_size - first + 1  # chain step j writes position first + j - 2
        made = torch.where(had | (host_ok > 0), torch.minimum(chosen, room).clamp(0, wanted), 0)
        drafts = [draft]
        for j in range(2, wanted + 1):
            batch = self._batch(rows, drafts[-1], first + j - 2, table, made >= j)
            hidden, logits = self.layer(hidden, batch, self.kv, logits_at=self.every_row[:rows])
            drafts.append(torch.argmax(logits, dim=-1))
        tokens = torch.stack(drafts, dim=1)
        if tokens.shape[1] < self.steps:
            tokens = torch.nn.functional.pad(tokens, (0, self.steps - tokens.shape[1]), value=-1)
        cols = torch.arange(self.steps, device=tokens.device)[None, :]
        return DeviceDrafts(torch.where(cols < made[:, None], tokens, -1), made)

    def _batch(self, n: int, ids: torch.Tensor, positions: torch.Tensor, table: torch.Tensor,
               valid: torch.Tensor) -> ForwardBatch:
        """A decode batch of n one-token rows in the static inputs; rows not `valid` are padding (id 0 at position
        0, KV in the pool's scratch page)."""
        page, scratch = self.kv.page_size, self.kv.scratch_page
        at = torch.where(valid, positions, 0)
        pages = torch.where(valid[:, None], table, scratch).to(torch.int32)
        self.input_ids[:n].copy_(torch.where(valid, ids, 0))
        self.positions[:n].copy_(at)
        self.seq_lens[:n].copy_(at + 1)
        self.out_cache_loc[:n].copy_(pages.gather(1, (at // page)[:, None])[:, 0].to(torch.int64) * page + at % page)
        self.page_table[:n, : table.shape[1]].copy_(pages)
        seq_lens = self.seq_lens[:n]
        kv_indices = torch.empty(0, dtype=torch.int64, device=seq_lens.device)
        kv_indptr = torch.zeros(n + 1, dtype=torch.int64, device=seq_lens.device)
        if self.ragged:
            slots = (pages.to(torch.int64)[:, :, None] * page + torch.arange(page, device=pages.device)).flatten(1)
            cols = torch.arange(slots.shape[1], device=pages.device)
            kv_indices = slots[cols[None, :] < seq_lens[:, None]]
            kv_indptr = torch.cat([seq_lens.new_zeros(1), torch.cumsum(seq_lens, 0)])
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=self.input_ids[:n], positions=self.positions[:n],
            out_cache_loc=self.out_cache_loc[:n], seq_lens=seq_lens, extend_lens=(1,) * n,
            prefix_lens=(self.bound - 1,) * n, kv_indices=kv_indices, kv_indptr=kv_indptr,
            page_table=self.page_table[:n], page_size=page,
        )
