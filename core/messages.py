"""The one vocabulary a request travels in, from the HTTP front end to every rank and back.

    front end  --Round(commands, halt)-->  leader (rank 0)  --Round(commands)-->  every rank
    front end  <--RoundReport----------   leader           <--GroupReport-----  each DP group's output rank

Commands are the same three wherever they go: Admit a request, Abort one, Call an engine method on every
rank between two steps. The front end leaves `dp_rank` unset; the leader picks the DP group. What comes
back is one Updates per DP group (what its requests gained, column-wise), stats, the outcomes of calls, and the requests that failed.
"""

from __future__ import annotations

import operator
from typing import Any, Mapping

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


def pickled_as_fields(cls):
    """Pickle instances as (class, field values): a round's report is pickled on rank 0's path between two steps,
    and attrs' default state (a dict, each field's name written out) costs about twice as much."""
    values = operator.attrgetter(*(field.name for field in attrs.fields(cls)))
    cls.__reduce__ = lambda self: (cls, values(self))
    return cls


# --- progress -----------------------------------------------------------------------------------------


@pickled_as_fields
@attrs.frozen
class Updates:
    """What the requests of one DP group gained in one round, column-wise: one message, one row per request with
    something new (nothing for a request that gained nothing). The columns every row has are `rids`, `ids` (the new
    token ids, row after row; `counts` says how many each row has, empty when each has one, as in a decode step)
    and `texts` (the text each gained, where the engine makes it: for requests whose stop strings or constraint
    need it as it grows; the receiver's own detokenizer makes the rest from the ids, see `apply`). The rest are
    sparse, keyed by row: `cuts` where a stop string cut the text before what was reported (the row's text then
    replaces the text from there on), `logprobs` for requests that asked for them, `ends` (finish reason, stop
    reason, error) where a request finished, `cached` (prompt tokens the prefix cache gave it) and `spec`
    (speculative decoding so far, Request.spec_counts) where they changed."""

    rids: tuple[str, ...] = ()
    ids: tuple[int, ...] = ()
    counts: tuple[int, ...] = ()
    texts: tuple[str, ...] = ()
    cuts: dict[int, int] = attrs.field(factory=dict)
    logprobs: dict[int, tuple[dict, ...]] = attrs.field(factory=dict)
    ends: dict[int, tuple[FinishReason, Any, str | None]] = attrs.field(factory=dict)
    cached: dict[int, int] = attrs.field(factory=dict)
    spec: dict[int, tuple[int, int, int]] = attrs.field(factory=dict)
    prompt_logprobs: dict[int, tuple] = attrs.field(factory=dict)  # once, when the prompt is done, where asked for

    def __len__(self) -> int:
        return len(self.rids)

    def finished(self) -> list[tuple[str, FinishReason, Any, str | None]]:
        """(rid, finish reason, stop reason, error) of each request that finished."""
        rids = self.rids
        return [(rids[row], *end) for row, end in self.ends.items()]

    def new_ids(self) -> list[tuple[str, tuple[int, ...]]]:
        """(rid, its new token ids) of each row."""
        if not self.counts:
            return list(zip(self.rids, ((i,) for i in self.ids)))
        out, at = [], 0
        for rid, n in zip(self.rids, self.counts):
            out.append((rid, self.ids[at : at + n]))
            at += n
        return out

    def apply(self, requests: Mapping[str, Any]) -> None:
        """Bring the mirrors up to date: requests[rid].request for each row's rid (a rid not there was dropped).
        A holder whose `detok` is a Detokenizer gets its text from it: the new ids pushed, flushed at the end unless
        the request stopped (as the engine's own text is)."""
        ids, counts, texts, cuts = self.ids, self.counts, self.texts, self.cuts
        at = 0
        for row, rid in enumerate(self.rids):
            n = counts[row] if counts else 1
            holder = requests.get(rid)
            if holder is not None:
                request: Request = holder.request
                if n == 1:
                    request.output_ids.append(ids[at])
                elif n:
                    request.output_ids.extend(ids[at : at + n])
                detok = holder.detok
                if detok is not None:
                    request.text += "".join(map(detok.push, ids[at : at + n])) if n != 1 else detok.push(ids[at])
                    end = self.ends.get(row)
                    if end is not None and end[0] != FinishReason.STOP:
                        request.text += detok.flush()
                elif row in cuts:
                    request.text = request.text[: cuts[row]] + texts[row]
                elif texts[row]:
                    request.text += texts[row]
                if row in self.logprobs:
                    request.logprobs.extend(self.logprobs[row])
                if row in self.cached:
                    request.cached_tokens = self.cached[row]
                if row in self.prompt_logprobs:
                    request.prompt_logprobs = list(self.prompt_logprobs[row])
                    request.prompt_logprobs_done = True
                if row in self.spec:
                    request.spec_verify_steps, request.spec_draft_tokens, request.spec_accepted_tokens = self.spec[row]
                if row in self.ends:
                    request.finish(*self.ends[row])
            at += n


@pickled_as_fields
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
    kv_pages_evictable: int = 0  # of the prefix cache's pages, those no request reads (freed on demand)
    # speculative decoding since start-up: decode steps with and without drafts, the drafts verified and the
    # requests that drafted (summed over verify steps): the draft policy's decisions
    spec_verify_steps: int = 0
    spec_plain_steps: int = 0
    spec_drafts: int = 0
    spec_drafting: int = 0
    grammar_mask_waits: int = 0  # since start-up: steps that waited for a constraint's compile or matcher
    grammar_mask_wait_seconds: float = 0.0  # the time they waited
    engine_steps: tuple[tuple[str, int, float], ...] = ()  # since start-up: (kind, steps, seconds) (step_log.py)
    overlap_breaks: tuple[tuple[str, int], ...] = ()  # since start-up: (reason, count) (step_log.py)
    # (batch size, scale) where the adaptive policy's verify costs are scaled to what serving measured
    # (speculation/calibration.py)
    verify_cost_scales: tuple[tuple[int, float], ...] = ()
    break_cost_scales: tuple[tuple[int, float], ...] = ()  # the same for a break of the overlap schedule
    mixed_verify_cost_scales: tuple[tuple[int, float], ...] = ()  # ... and for a verify step holding a prompt


@pickled_as_fields
@attrs.frozen
class GroupReport:
    """One DP group's round, from its output rank."""

    dp_rank: int
    updates: Updates
    has_work: bool
    stats: GroupStats
    reserved: tuple[tuple[str, tuple[int, ...]], ...] = ()  # decode: (rid, destination pages) reserved this round


@pickled_as_fields
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

    @property
    def kv_pages_evictable(self) -> int:
        return sum(g.kv_pages_evictable for g in self.groups)

    def cache_total(self, counter: str) -> int:
        """A prefix-cache counter summed over the DP groups: queried_tokens, hit_tokens or evicted_pages."""
        return sum(getattr(g, f"cache_{counter}") for g in self.groups)

    def spec_total(self, counter: str) -> int:
        """A speculative-decoding counter summed over the DP groups: verify_steps, plain_steps, drafts, drafting."""
        return sum(getattr(g, f"spec_{counter}") for g in self.groups)

    def grammar_total(self, counter: str) -> float:
        """A grammar counter summed over the DP groups: mask_waits or mask_wait_seconds."""
        return sum(getattr(g, f"grammar_{counter}") for g in self.groups)

    def step_totals(self) -> dict[str, tuple[int, float]]:
        """Per step kind (step_log.py), its steps and seconds summed over the DP groups."""
        totals: dict[str, tuple[int, float]] = {}
        for group in self.groups:
            for kind, steps, seconds in group.engine_steps:
                before = totals.get(kind, (0, 0.0))
                totals[kind] = (before[0] + steps, before[1] + seconds)
        return totals

    def verify_cost_scales(self) -> dict[int, float]:
        """Per batch size, the largest scale of any DP group's verify costs (calibration.py; one group has them)."""
        return self._largest_scales("verify_cost_scales")

    def break_cost_scales(self) -> dict[int, float]:
        """Per batch size, the largest scale of any DP group's break of the overlap schedule (calibration.py)."""
        return self._largest_scales("break_cost_scales")

    def mixed_verify_cost_scales(self) -> dict[int, float]:
        """Per batch size, the largest scale of any DP group's verify step holding a prompt (calibration.py)."""
        return self._largest_scales("mixed_verify_cost_scales")

    def _largest_scales(self, field: str) -> dict[int, float]:
        scales: dict[int, float] = {}
        for group in self.groups:
            for size, scale in getattr(group, field):
                scales[size] = max(scale, scales.get(size, 0.0))
        return scales

    def break_totals(self) -> dict[str, int]:
        """Per reason (step_log.py), the times the overlap schedule was broken, summed over the DP groups."""
        totals: dict[str, int] = {}
        for group in self.groups:
            for reason, count in group.overlap_breaks:
                totals[reason] = totals.get(reason, 0) + count
        return totals

    @property
    def page_size(self) -> int:
        return self.groups[0].page_size

    @property
    def kv_pages_used(self) -> int:
        """Pages requests hold (their own, and cached ones they read): what no eviction can free. The prefix cache's
        pages that no request reads are reuse, not pressure: they count in kv_pages_evictable, not here."""
        return self.kv_pages_total - self.kv_pages_free - self.kv_pages_evictable


@attrs.frozen
class Failure:
    """A request the engine gave up on: `status` is the HTTP status its client gets."""

    rid: str
    status: int
    message: str
    code: str | None = None  # the error code the client sees (server/errors.py: UPSTREAM_PREFILL)


@pickled_as_fields
@attrs.frozen
class RoundReport:
    """The leader's answer to the front end, one per round."""

    updates: tuple[Updates, ...]  # one per DP group with something new
    failures: tuple[Failure, ...]
    outcomes: tuple[tuple[int, Any], ...]  # (call id, rank 0's result or exception)
    stats: LoopStats
    reserved: tuple[tuple[str, int, tuple[int, ...]], ...] = ()  # decode: (rid, DP group, pages) to register with P
    transfers: Any = None  # prefill/decode: the TransferStats of the leader's book (disagg/book.py)
    landed: tuple[str, ...] = ()  # decode: requests whose KV arrived whole (they no longer depend on their prefill server)


@attrs.frozen
class Halted:
    """The leader's last message: `reason` is None when the front end asked for it, else why the rounds stopped."""

    reason: str | None = None
