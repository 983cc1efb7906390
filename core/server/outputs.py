"""What the engine thread sends back for one request (Output), and all of it put together (Completion)."""

from __future__ import annotations

from typing import Any

import attrs

from ..sampling import SamplingParams


@attrs.frozen
class Ticket:
    """One engine request as the HTTP side submits it."""

    rid: str
    index: int  # position within its HTTP call (prompt-major, then choice)
    prompt_ids: list[int]
    params: SamplingParams
    queue: Any  # the asyncio.Queue of the HTTP call, filled from the engine thread
    submitted_at: float  # time.monotonic() when the HTTP request asked for it
    bootstrap: Any = None  # prefill/decode disaggregation: its room (and the prefill server, on a decode server)
    stream_interval: int | None = None  # tokens a chunk holds at least after the first (None: the server's)


@attrs.frozen
class Output:
    """What one engine step added to a request: new text, new tokens, and how it ended if it did."""

    index: int
    num_prompt_tokens: int
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[dict, ...] = ()  # per new token: {"token_id", "logprob", "top_logprobs": [[id, lp], ...]}
    finish_reason: str | None = None  # "stop", "length" or "abort"; None while generating
    stop_reason: Any = None  # the stop string or token id that ended it
    error: str | None = None
    status: int = 200  # the HTTP status of the failure, when error is set
    code: str | None = None  # the failure's error code (errors.UPSTREAM_PREFILL: another server's failure)
    cached_tokens: int = 0  # of the prompt, reused from the prefix cache
    spec_counts: tuple[int, int, int] = (0, 0, 0)  # speculative decoding so far (Request.spec_counts)
    prompt_logprobs: tuple | None = None  # per prompt position (None where not asked), in the first Output only

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def then(self, later: "Output") -> "Output":
        """This output and the next one of the same request as one (what several steps added, in one event)."""
        return attrs.evolve(later, text=self.text + later.text, token_ids=self.token_ids + later.token_ids,
                            logprobs=self.logprobs + later.logprobs,
                            prompt_logprobs=self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs)

    @classmethod
    def failure(cls, ticket: Ticket, status: int, message: str, code: str | None = None) -> "Output":
        return cls(ticket.index, len(ticket.prompt_ids), finish_reason="abort", error=message, status=status, code=code)


@attrs.define
class Completion:
    """Every Output of one request, accumulated."""

    index: int
    num_prompt_tokens: int = 0
    text: str = ""
    token_ids: list[int] = attrs.Factory(list)
    logprobs: list[dict] = attrs.Factory(list)
    finish_reason: str | None = None
    stop_reason: Any = None
    error: str | None = None
    status: int = 200
    cached_tokens: int = 0
    spec_counts: tuple[int, int, int] = (0, 0, 0)
    prompt_logprobs: tuple | None = None

    def add(self, output: Output) -> None:
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        self.num_prompt_tokens = output.num_prompt_tokens
        self.spec_counts = output.spec_counts
        self.cached_tokens = max(self.cached_tokens, output.cached_tokens)
        self.text += output.text
        self.token_ids.extend(output.token_ids)
        self.logprobs.extend(output.logprobs)
        if output.finished:
            self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason
            self.error, self.status = output.error, output.status
