"""Turning logits into next tokens, per request parameters, with per-request random streams."""

from __future__ import annotations

from typing import Sequence

import torch

from .penalties import LogitAdjuster
from .transfer import to_device
from .request import Request
from .sampling import GREEDY_TEMPERATURE

FAILED = -1  # the token of a row that could not be sampled: its request fails, the rest of the batch does not


def _generator(request: Request, device: torch.device) -> torch.Generator | None:
    if request.params.seed is None:
        return None
    if request.generator is None:
        request.generator = torch.Generator(device=device).manual_seed(request.params.seed)
    return request.generator


def filtered_probs(logits: torch.Tensor, params: Sequence) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p filtering of each row of fp32 logits with its own params[i],
    all rows at once: a fixed number of kernels whatever the batch."""
    device = logits.device

    def column(values, dtype=torch.float32) -> torch.Tensor:
        return to_device(device, torch.tensor(values, dtype=dtype))[0][:, None]

    logits = logits / column([max(p.temperature, GREEDY_TEMPERATURE) for p in params])
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        k = column(top_k, torch.int64)
        values = torch.topk(logits, max(top_k), dim=-1).values
        kth = torch.where(k > 0, values.gather(-1, (k - 1).clamp_min(0)), float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if any(p.top_p < 1.0 for p in params):
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= column([p.top_p for p in params])
        drop[:, 0] = False  # the most likely token stays, even where top_p underflows float32 to 0
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    if any(p.min_p > 0.0 for p in params):
        probs = probs.masked_fill(probs < column([p.min_p for p in params]) * probs.amax(-1, keepdim=True), 0.0)
    return probs


class Sampler:
    """Draws tokens; `adjuster` keeps the per-request device state of penalties and biases (None: the logits are
    drawn from as they are, which only a caller that knows no request asks for them may choose)."""

    def __init__(self, adjuster: LogitAdjuster | None = None):
        self.adjuster = adjuster

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        """One token per row of `logits` [B, V] (fp32), with the logprobs the requests ask for recorded."""
        chosen = self.sample(logits, requests).tolist()
        self.record_logprobs(logits, requests, chosen)
        return chosen

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """[B] tokens on the device: penalties and biases applied, drawn, and counted for the next step's
        penalties, without a host sync. Logprobs stay those of the model's own logits (vLLM's default)."""
        if self.adjuster is None:
            return self.draw(logits, requests)
        generated = [len(r.output_ids) + len(r.pending_rows) for r in requests]
        in_place = not any(r.params.logprobs for r in requests)  # the model's logits are read for logprobs only
        tokens = self.draw(self.adjuster.adjust(logits, requests, generated, in_place=in_place), requests)
        self.adjuster.record(tokens, requests)
        return tokens

    def adjust_verify(self, logits: torch.Tensor, requests: Sequence[Request],
                      drafts: Sequence[Sequence[int]]) -> torch.Tensor:
        """A verify step's logits (len(drafts[i]) + 1 rows per request) with each row's adjustments: row k of a
        request sees its first k drafts as generated, so the accepted tokens are drawn from the distribution
        plain decoding would have used."""
        if self.adjuster is None or not any(r.params.adjusts_logits for r in requests):
            return logits
        owners, generated, prior = [], [], []
        for request, draft in zip(requests, drafts):
            done = len(request.output_ids)
            for k in range(len(draft) + 1):
                owners.append(request)
                generated.append(done + k)
                prior.append(draft[:k])
        return self.adjuster.adjust(logits, owners, generated, prior)

    def record_accepted(self, request: Request, tokens: Sequence[int]) -> None:
        if self.adjuster is not None:
            self.adjuster.record_accepted(request, tokens)

    def release(self, request: Request) -> None:
        if self.adjuster is not None:
            self.adjuster.release(request)

    @staticmethod
    def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([B] each row's argmax, [B] whether that row's logits are not finite): no host value, graph-safe."""
        tokens = torch.argmax(logits, dim=-1)  # a NaN wins argmax, so the chosen logit shows a bad row
        return tokens, ~torch.isfinite(logits.gather(-1, tokens[:, None])[:, 0])

    @staticmethod
    def draw(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """[B] tokens on the logits' device, no host sync: greedy rows in one argmax, sampled rows filtered
        and drawn together, a row with a seed then drawn again from its own random stream (reproducible
        whatever shares its batch). A row whose logits are not finite (or whose filters leave nothing to
        draw) gets FAILED instead of failing the batch: multinomial on a bad row raises on the CPU and
        trips a device assert on a GPU, which would end every request."""
        tokens, failed = Sampler.greedy(logits)
        sampled = [row for row, r in enumerate(requests) if not r.params.greedy]
        if sampled:
            every = len(sampled) == len(requests)
            index = None if every else to_device(logits.device, torch.tensor(sampled))[0]
            probs = filtered_probs(logits if every else logits[index], [requests[row].params for row in sampled])
            mass = probs.sum(-1)
            drawable = torch.isfinite(mass) & (mass > 0)
            probs = torch.where(drawable[:, None], probs, 1.0)  # a placeholder draw, replaced by FAILED below
            drawn = torch.multinomial(probs, 1)[:, 0]
            for j, row in enumerate(sampled):
                request = requests[row]
                if request.params.seed is not None:
                    drawn[j] = torch.multinomial(probs[j], 1, generator=_generator(request, logits.device))[0]
            if every:
                tokens, failed = drawn, failed | ~drawable
            else:
                tokens = tokens.index_copy(0, index, drawn)
                failed = failed.index_copy(0, index, failed[index] | ~drawable)
        return torch.where(failed, FAILED, tokens)

    @staticmethod
    def record_logprobs(logits: torch.Tensor, requests: Sequence[Request], chosen: list[int]) -> None:
        rows = [i for i, r in enumerate(requests) if r.params.logprobs > 0]
        if not rows:
            return
        logprobs = torch.log_softmax(logits[rows], dim=-1)
        for j, row in enumerate(rows):
            request = requests[row]
            top = torch.topk(logprobs[j], min(request.params.logprobs, logprobs.shape[-1]))
            request.logprobs.append(
                {
                    "token_id": chosen[row],
                    "logprob": float(logprobs[j, chosen[row]]),
                    "top_logprobs": [[int(t), float(v)] for t, v in zip(top.indices, top.values)],
                }
            )
