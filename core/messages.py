"""The one vocabulary a request travels in, from the HTTP front end to every rank and back.

    front end  --Round(commands, halt)-->  leader (rank 0)  --Round(commands)-->  every rank
    front end  <--RoundReport----------   leader           <--GroupReport-----  each DP group's output rank

Commands are the same three wherever they go: Admit a request, Abort one, Call an engine method on every
rank between two steps. The front end leaves `dp_rank` unset; the leader picks the DP group. What comes
back is a RequestUpdate per request that grew, stats, the outcomes of calls, and the requests that failed.
"""

from __future__ import annotations

from typing import Any

import attrs

from .request import FinishReason, Request
from .sampling import SamplingParams

# --- commands -----------------------------------------------------------------------------------------


@attrs.frozen
class Admit:
    rid: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    dp_rank: int | None = None  # the DP group that runs it (the leader's choice)
    room: int | None = None  # prefill/decode disaggregation: the bootstrap room its KV pages travel under


@attrs.frozen
class Abort:
    """Drop the request and free its KV pages (the client has gone)."""

    rid: str
    dp_rank: int | None = None


@attrs.frozen
class Call:
    """engine.<method>(*args) on every rank between two steps (the expert-load calls, collectives themselves);
    rank 0's result or exception answers call `id`."""

    method: str
    args: tuple = ()
    id: int = 0


@attrs.frozen
class SendKV:
    """Prefill: where request `rid`'s KV pages go (the decode group's pages and its ranks' transfer endpoints)."""

    rid: str
    dst_pages: tuple[int, ...]
    peers: tuple[bytes, ...]  # one per decode attention-TP rank: prefill rank i of the group sends to peers[i]
    dp_rank: int | None = None


@attrs.frozen
class EndTransfer:
    """The leader's decision on a request's transfer, applied by every rank of its group in the same round.

    Prefill: free the source pages (ok or not). Decode: ok admits the request with its first token, else it fails
    with `reason` after its room is closed (no byte lands afterwards) and its pages are freed."""

    rid: str
    ok: bool
    reason: str | None = None
    dp_rank: int | None = None


@attrs.frozen
class Round:
    """Commands in arrival order; `halt` (after them) ends the rounds: the leader stops, the followers return."""

    commands: tuple = ()
    halt: bool = False


# --- progress -----------------------------------------------------------------------------------------


@attrs.frozen
class RequestUpdate:
    """What a request gained in one round. Text is append-only except for a stop string cut off its end,
    so it travels as (where the new text starts, the new text)."""

    rid: str
    new_ids: tuple[int, ...] = ()
    new_logprobs: tuple[dict, ...] = ()
    text_from: int = 0
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: Any = None
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens the prefix cache gave it
    spec_counts: tuple[int, int, int] = (0, 0, 0)  # speculative decoding so far (Request.spec_counts)

    def __reduce__(self):
        # one per running request in every round's report: pickled as its fields, without attrs' state dict
        # (the leader's dumps about 30% and the front end's loads about half the time, 64 updates a round)
        return RequestUpdate, (self.rid, self.new_ids, self.new_logprobs, self.text_from, self.text, self.finish_reason,
                               self.stop_reason, self.error, self.cached_tokens, self.spec_counts)

    def apply(self, request: Request) -> None:
        request.cached_tokens = self.cached_tokens
        request.spec_verify_steps, request.spec_draft_tokens, request.spec_accepted_tokens = self.spec_counts
        request.output_ids.extend(self.new_ids)
        request.logprobs.extend(self.new_logprobs)
        request.text = request.text[: self.text_from] + self.text
        if self.finish_reason is not None:
            request.finish(self.finish_reason, self.stop_reason, self.error)


@attrs.frozen
class GroupStats:
    """One DP group's scheduler and KV cache after a round."""

    num_running: int = 0
    num_queued: int = 0
    kv_pages_total: int = 0
    kv_pages_free: int = 0
    page_size: int = 1
    kv_pages_cached: int = 0  # held by the prefix cache (evictable when no request reads them)
    cache_queried_tokens: int = 0  # since start-up: tokens looked up in the prefix cache at admission
    cache_hit_tokens: int = 0  # of those, tokens found cached
    cache_evicted_pages: int = 0


@attrs.frozen
class GroupReport:
    """One DP group's round, from its output rank."""

    dp_rank: int
    updates: tuple[RequestUpdate, ...]
    has_work: bool
    stats: GroupStats
    reserved: tuple[tuple[str, tuple[int, ...]], ...] = ()  # decode: (rid, destination pages) reserved this round


@attrs.frozen
class LoopStats:
    """The engine's state as of its last round."""

    groups: tuple[GroupStats, ...]  # one per DP group
    admitted: tuple[int, ...]  # requests each DP group was given since start-up
    steps: int
    failed_steps: int

    @property
    def num_running(self) -> int:
        return sum(g.num_running for g in self.groups)

    @property
    def num_queued(self) -> int:
        return sum(g.num_queued for g in self.groups)

    @property
    def kv_pages_total(self) -> int:
        return sum(g.kv_pages_total for g in self.groups)

    @property
    def kv_pages_free(self) -> int:
        return sum(g.kv_pages_free for g in self.groups)

    @property
    def kv_pages_cached(self) -> int:
        return sum(g.kv_pages_cached for g in self.groups)

    def cache_total(self, counter: str) -> int:
        """A prefix-cache counter summed over the DP groups: queried_tokens, hit_tokens or evicted_pages."""
        return sum(getattr(g, f"cache_{counter}") for g in self.groups)

    @property
    def page_size(self) -> int:
        return self.groups[0].page_size

    @property
    def kv_pages_used(self) -> int:
        return self.kv_pages_total - self.kv_pages_free


@attrs.frozen
class Failure:
    """A request the engine gave up on: `status` is the HTTP status its client gets."""

    rid: str
    status: int
    message: str


@attrs.frozen
class RoundReport:
    """The leader's answer to the front end, one per round."""

    updates: tuple[RequestUpdate, ...]
    failures: tuple[Failure, ...]
    outcomes: tuple[tuple[int, Any], ...]  # (call id, rank 0's result or exception)
    stats: LoopStats
    reserved: tuple[tuple[str, int, tuple[int, ...]], ...] = ()  # decode: (rid, DP group, pages) to register with P
    transfers: Any = None  # prefill/decode: the TransferStats of the leader's book (disagg/book.py)


@attrs.frozen
class Halted:
    """The leader's last message: `reason` is None when the front end asked for it, else why the rounds stopped."""

    reason: str | None = None
