"""How much of a running request its client has been sent; turns the request's growth into Outputs."""

from __future__ import annotations

from typing import Sequence

from ..request import Request
from ..tokenizer import Detokenizer
from .outputs import Output, Ticket


def held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of `text` that is the start of a stop string.

    The engine cuts a matched stop string out of request.text, but text already streamed cannot be
    taken back, so such an end waits until the next tokens decide whether it is a stop string.
    Per stop string only the positions in the text's last len(stop) - 1 characters where its first
    character occurs are tried, each by one C-level comparison: no Python loop over every length.
    """
    longest = 0
    for stop in stops:
        start = max(len(text) - len(stop) + 1, 0)
        at = text.find(stop[0], start) if stop else -1
        while at >= 0 and len(text) - at > longest:
            if stop.startswith(text[at:]):
                longest = len(text) - at
                break
            at = text.find(stop[0], at + 1)
    return longest


class Progress:
    """One admitted request, seen from the engine thread after each step. `detok`: where the engine does not grow the
    request's text (no stop string or constraint needs it), the front end makes it from the ids (Updates.apply)."""

    def __init__(self, request: Request, ticket: Ticket, detok: Detokenizer | None = None, interval: int = 1):
        """`interval`: outputs after the first wait for this many new tokens, or the request's end."""
        self.request = request
        self.ticket = ticket
        self.detok = detok
        self.interval = interval
        self.sent_text = 0
        self.sent_tokens = 0
        self.sent_logprobs = 0
        self.sent_prompt_logprobs = request.params.prompt_logprobs is None
        self.last_token_at: float | None = None

    def advance(self) -> Output | None:
        """What the request gained since the last call, or None when nothing changed."""
        request = self.request
        text_end = len(request.text)
        if not request.finished:
            text_end -= held_back(request.text, request.params.stop)
        new_ids = request.output_ids[self.sent_tokens :]
        if 0 < len(new_ids) < self.interval and self.sent_tokens and not request.finished:
            return None  # the rest of the interval first (prompt logprobs come with the first output)
        new_text = request.text[self.sent_text : max(text_end, self.sent_text)]
        new_logprobs = request.logprobs[self.sent_logprobs :]
        prompt_logprobs = None
        if not self.sent_prompt_logprobs and request.prompt_logprobs_done:
            prompt_logprobs, self.sent_prompt_logprobs = tuple(request.prompt_logprobs), True
        if not (new_ids or new_text or request.finished or prompt_logprobs):
            return None
        self.sent_tokens += len(new_ids)
        self.sent_text += len(new_text)
        self.sent_logprobs += len(new_logprobs)
        reason = request.finish_reason.value if request.finished else None
        return Output(
            self.ticket.index,
            len(request.prompt_ids),
            new_text,
            tuple(new_ids),
            tuple(new_logprobs),
            finish_reason=reason,
            stop_reason=request.stop_reason if request.finished else None,
            error=request.error,
            status=500 if request.error else 200,
            cached_tokens=request.cached_tokens,
            spec_counts=request.spec_counts,
            prompt_logprobs=prompt_logprobs,
        )
