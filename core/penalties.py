"""Penalties, biases and min_tokens: each request's logits changed before filtering, on the logits' device.

The order is vLLM's: the bias terms first (allowed_token_ids, logit_bias, min_tokens' masked stops), then the
penalties — repetition (multiplicative, over the prompt and the output: a positive logit is divided by it, a
negative one multiplied), frequency and presence (OpenAI's, additive, over the output: logit -= frequency *
count + presence * [count > 0]).

State lives in rows of three device tensors, one row ("slot") per running request that needs one: how often
each token was generated (`counts`), which tokens its prompt holds (`seen`) and its dense bias (`bias`). A step
records its drawn tokens into `counts` on the device, so under the overlap schedule the next step's penalties
already see the token the host has not read yet: no host round trip. A batch in which no request asks for any
of this does nothing at all here (one pass over the params on the host).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .request import Request
from .transfer import to_device

INITIAL_SLOTS = 8


def _fused_kernel():
    from .kernels.penalties import penalize_  # Triton is imported only where it runs

    return penalize_


class LogitAdjuster:
    def __init__(self, vocab_size: int, device: torch.device, eos_ids: set[int] | frozenset = frozenset(),
                 fused: bool | None = None):
        """`fused`: the Triton kernel applies the slots (default: where Triton compiles for the device, a GPU)."""
        self.vocab = vocab_size
        self.device = device
        self.fused = _fused_kernel() if (device.type == "cuda" if fused is None else fused) else None
        self.eos_ids = tuple(sorted(eos_ids))
        self.slots: dict[str, int] = {}  # rid -> row of the tensors below
        self._free: list[int] = []
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.bias = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)

    # --- slots ----------------------------------------------------------------------------------------
    @staticmethod
    def _needs_slot(request: Request) -> bool:
        p = request.params
        return p.counts_tokens or bool(p.logit_bias) or bool(p.allowed_token_ids)

    def _slot(self, request: Request) -> int:
        slot = self.slots.get(request.rid)
        if slot is None:
            slot = self._open(request)
        return slot

    def _open(self, request: Request) -> int:
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self.slots[request.rid] = slot
        p = request.params
        self.counts[slot].zero_()
        self.seen[slot].zero_()
        self.bias[slot].zero_()
        done = list(request.output_ids)  # a request that arrives with output (a transferred first token, a replay)
        if p.repetition_penalty != 1.0 and request.prompt_ids:
            self.seen[slot, self._ids(request.prompt_ids)] = True
        if done and p.counts_tokens:
            self.counts[slot].index_add_(0, self._ids(done), torch.ones(len(done), dtype=torch.int32, device=self.device))
        if p.allowed_token_ids:
            self.bias[slot].fill_(float("-inf"))
            self.bias[slot, self._ids(p.allowed_token_ids)] = 0.0
        if p.logit_bias:
            ids, values = zip(*p.logit_bias)
            self.bias[slot, self._ids(ids)] += to_device(self.device, torch.tensor(values, dtype=torch.float32))[0]
        return slot

    def _grow(self) -> None:
        old = self.counts.shape[0]
        new = max(INITIAL_SLOTS, 2 * old)
        self.counts = torch.cat([self.counts, self.counts.new_zeros(new - old, self.vocab)])
        self.seen = torch.cat([self.seen, self.seen.new_zeros(new - old, self.vocab)])
        self.bias = torch.cat([self.bias, self.bias.new_zeros(new - old, self.vocab)])
        self._free.extend(range(new - 1, old - 1, -1))

    def release(self, request: Request) -> None:
        slot = self.slots.pop(request.rid, None)
        if slot is not None:
            self._free.append(slot)

    def _ids(self, ids: Sequence[int]) -> torch.Tensor:
        return to_device(self.device, torch.tensor(list(ids), dtype=torch.int64))[0]

    # --- a step -----------------------------------------------------------------------------------------
    @torch.inference_mode()  # the logits are inference tensors; the state is only ever touched here
    def adjust(self, logits: torch.Tensor, owners: Sequence[Request], generated: Sequence[int],
               prior: Sequence[Sequence[int]] | None = None, in_place: bool = False) -> torch.Tensor:
        """`logits` [R, V] (fp32) with each row's adjustments; row i belongs to owners[i], which had generated
        generated[i] tokens before it, the last len(prior[i]) of them (speculative drafts ahead of a verify row)
        not yet recorded. Returns `logits` itself when no row asks for anything, or when `in_place` (nobody reads
        the model's own logits afterwards: no logprobs asked for)."""
        # a request that finished meanwhile (its token in flight read early) is drawn for nothing: no slot for it
        rows = [i for i, r in enumerate(owners) if r.params.adjusts_logits and not r.finished]
        if not rows:
            return logits
        if not in_place:
            logits = logits.clone()
        slotted = [i for i in rows if self._needs_slot(owners[i])]
        if slotted and self.fused is not None and not any(prior or ()):
            self._apply_slots_fused(logits, owners, slotted)
        elif slotted:
            self._apply_slots(logits, owners, slotted, prior)
        self._mask_early_stops(logits, owners, rows, generated)
        return logits

    def _apply_slots_fused(self, logits, owners, rows) -> None:
        """One kernel for every row (core/kernels/penalties.py), the same arithmetic as _apply_slots."""
        index, slots = self._ids([*rows, *(self._slot(owners[i]) for i in rows)]).view(2, -1)
        values = [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty, float(p.counts_tokens)]
                  for p in (owners[i].params for i in rows)]
        params = to_device(self.device, torch.tensor(values, dtype=torch.float32))[0]
        self.fused(logits, index, slots, params, self.counts, self.seen, self.bias)

    def _apply_slots(self, logits, owners, rows, prior) -> None:
        # one host-to-device copy for the rows and their slots, one for the penalties' parameters
        index, slots = self._ids([*rows, *(self._slot(owners[i]) for i in rows)]).view(2, -1)
        part = logits[index] + self.bias[slots]
        counting = [j for j, i in enumerate(rows) if owners[i].params.counts_tokens]
        if counting:
            sub = self._ids(counting)
            counts = self.counts[slots[sub]].float()
            extra = [(j, t) for j, row in enumerate(counting) for t in (prior[rows[row]] if prior else ())]
            if extra:  # a verify row also sees the drafts before it
                at, tok = self._ids([*(j for j, _ in extra), *(t for _, t in extra)]).view(2, -1)
                counts.index_put_((at, tok), torch.ones(len(extra), device=self.device), accumulate=True)
            params = [owners[rows[j]].params for j in counting]
            values = [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params]
            rep, frequency, presence = to_device(self.device, torch.tensor(values, dtype=torch.float32))[0].T[:, :, None]
            x = part[sub]
            hit = (counts > 0) | self.seen[slots[sub]]
            x = torch.where(hit, torch.where(x > 0, x / rep, x * rep), x)
            part[sub] = x - frequency * counts - presence * (counts > 0)
        logits[index] = part

    def _mask_early_stops(self, logits, owners, rows, generated) -> None:
        """min_tokens: EOS and the stop token ids cannot be drawn before the request has that many tokens."""
        cells = []
        for i in rows:
            p = owners[i].params
            if generated[i] < p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_ids))
                cells += [(i, t) for t in stops if 0 <= t < self.vocab]
        if cells:
            at, tok = zip(*cells)
            logits[self._ids(at), self._ids(tok)] = float("-inf")

    @torch.inference_mode()  # the logits are inference tensors; the state is only ever touched here
    def record(self, tokens: torch.Tensor, owners: Sequence[Request]) -> None:
        """Count the drawn `tokens` [R] (on the device; FAILED rows skipped) for the owners that keep counts."""
        rows = [i for i, r in enumerate(owners) if r.params.counts_tokens and not r.finished]
        if not rows:
            return
        index, slots = self._ids([*rows, *(self._slot(owners[i]) for i in rows)]).view(2, -1)
        drawn = tokens[index]
        self.counts.index_put_((slots, drawn.clamp_min(0)), (drawn >= 0).to(torch.int32), accumulate=True)

    @torch.inference_mode()  # the logits are inference tensors; the state is only ever touched here
    def record_accepted(self, request: Request, tokens: Sequence[int]) -> None:
        """Count tokens the host already knows (a verify step's accepted run)."""
        kept = [t for t in tokens if t >= 0]
        if request.params.counts_tokens and kept:
            slot = self._slot(request)
            self.counts[slot].index_add_(0, self._ids(kept), torch.ones(len(kept), dtype=torch.int32, device=self.device))
