"""A launched step whose sampled tokens are still on their way to the host (the overlap schedule).

Sampling leaves the tokens on the device; a pinned copy of them is started at once and an event
marks its end. The host reads them only when it has launched the next step, so the GPU never
waits for the host between steps. A next step that needs one of these tokens as input (a decode
continuing the sequence) gets the placeholder -(row + 1) on the host, and fill_placeholders puts
the token itself in place on the device.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import torch

from .request import Request


@attrs.frozen
class InFlight:
    requests: Sequence[Request]  # whose next token the step samples, in row order
    logits: torch.Tensor  # [rows, vocab] fp32, for the logprobs some requests ask for
    tokens: torch.Tensor  # [rows] on the device, each a valid token id (what a next step may take as input)
    host: torch.Tensor  # [rows] on the host, complete once `ready` is; FAILED in a row that could not be sampled
    ready: torch.cuda.Event | None
    observed: Any = None  # what the step tells a drafter once its tokens are read (SpeculativeDecoding.plain_step)

    @classmethod
    def start(cls, requests: Sequence[Request], logits: torch.Tensor, drawn: torch.Tensor, observed: Any = None) -> InFlight:
        """`drawn` as the sampler returns it; a FAILED row's request ends when the host reads it, and a step
        launched before that reads token 0 in its place (never an id the embedding would fault on)."""
        tokens = drawn.clamp_min(0)
        if tokens.device.type != "cuda":
            return cls(requests, logits, tokens, drawn, None, observed)
        host = torch.empty(drawn.shape, dtype=drawn.dtype, pin_memory=True)
        host.copy_(drawn, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(tokens.device))
        return cls(requests, logits, tokens, host, ready, observed)

    def token_list(self) -> list[int]:
        """The tokens, waiting for their copy only (not for steps launched after this one)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


def fill_placeholders(input_ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """input_ids with every placeholder -(row + 1) replaced by tokens[row], on the device."""
    rows = (-input_ids - 1).clamp(0, max(tokens.numel() - 1, 0))
    return torch.where(input_ids < 0, tokens[rows], input_ids)
