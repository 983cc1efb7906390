"""Verify steps under the overlap schedule: step N + 1 is built and launched before step N's tokens reach the host.

For a drafter that drafts on the device (DrafterCaps.drafts_on_device) a verify step needs nothing from the host
after it is launched: acceptance runs on the device (accept.py), and the next step's inputs come from it there.
Each request's rows sit on a fixed grid of `width` decode rows (its last token, then its drafts, padding beyond
the drafts it verifies), so the host knows the batch's shape without the accepted counts. What it does not know
is where each request's rows start: step N emitted 1 .. width tokens for it. The host builds step N + 1 at the
positions step N's first row had (the positions it knows) and the device shifts every row by the count step N
emitted (`shift_rows`): positions, sequence lengths and KV slots from the page table, the page table covering
the longest run. Then the host reads step N (it waits for that step's copy only, the device already computes
N + 1) and appends its runs as the synchronous path does: a stop inside an accepted run ends the request there
(its rows of step N + 1 are dropped when that step is read), the policy records the outcome (so its choice for
step N + 1 was made one step stale), and pages beyond what the step in flight may write go back to the pool.

Requests with a grammar, logprobs, penalties or logit biases, or their own seed, need the host's tokens before
their next step (masks, counts, one draw per token from their stream): a step with one of them takes the
synchronous path, as does a step the scheduler must change (preemption, a prompt chunk, an admission whose prompt
does not fit). A waiting request whose whole prompt fits beside the grid is admitted into step N + 1 itself
(`follow`): its prompt tokens are decode rows after the grid, at positions the host knows, its last prompt token a
grid row with no drafts, so admissions do not end a run.
"""

from __future__ import annotations

from typing import Callable, Sequence

import attrs
import torch
import torch.nn.functional as F

from ..batch_builder import ScheduledSeq, build_forward_batch
from ..interfaces import DeviceTokens, DraftRequest, TargetStep
from ..model_runner import PROMPT_ROW_READS
from ..request import Request
from ..sampler import Sampler
from ..transfer import to_device
from .accept import Accepted, accept


@attrs.define
class VerifyInFlight:
    """A launched verify step whose outcome is still on its way to the host."""

    requests: list[Request]  # one per grid row, in row order
    width: int  # rows per request (1 + the most drafts a request verifies)
    chosen: list[int]  # drafts the policy chose per request (the drafter may have proposed fewer)
    accepted: Accepted  # on the device
    host: torch.Tensor  # [R, 3 + width]: drafts proposed, drafts verified, drafts accepted, tokens (complete once ready)
    ready: torch.cuda.Event | None
    graphed: bool = False  # launched from VerifyGraphs: `accepted` is its state, which the next graphed step reads
    idle: int = 0  # verify steps in a row, this one included, that verify no draft (the run goes on: keeps_run)
    hidden: torch.Tensor | None = None  # [R, width, H] the target's pre-norm hidden rows (a drafter that reads them)
    ahead: int = 0  # how far its requests' num_cached is past its first rows (standing_for: 1, counted at launch)
    prompts: int = 0  # requests it admitted, their prompt tokens as rows beside the grid (OverlapVerify.follow)

    @classmethod
    def standing_for(cls, step) -> VerifyInFlight:
        """A plain step in flight (in_flight.InFlight) as the step a verify step follows: each of its rows emits
        the one token it samples and verified no draft; the host counted each row's input when it launched it."""
        zeros = torch.zeros_like(step.tokens)
        return cls(list(step.requests), 1, [0] * len(step.requests), Accepted(zeros, step.tokens[:, None]),
                   step.host, step.ready, ahead=1)

    @property
    def shape(self) -> tuple[int, int]:
        """(requests, rows) as the policy priced the step: a row per request and one per chosen draft."""
        return len(self.requests), len(self.requests) + sum(self.chosen)

    def read(self) -> list[list[int]]:
        """Per request: [proposed, verified, accepted, emitted tokens...] (waits for this step's copy only)."""
        if self.ready is not None:
            self.ready.synchronize()
        return [row[: 4 + row[2]] for row in self.host.tolist()]


def eligible(requests: Sequence[Request], tracks_grammar: Callable[[str], bool]) -> bool:
    """Whether the requests' next steps can be built before their tokens reach the host."""
    return bool(requests) and all(
        not tracks_grammar(r.rid) and r.params.logprobs <= 0 and not r.params.adjusts_logits
        and (r.params.greedy or r.params.seed is None) for r in requests)


def host_decodes(request: Request) -> bool:
    """Whether the request decodes next with its last token on the host (no step in flight samples for it)."""
    return bool(request.output_ids) and not request.pending_rows and request.num_uncached == 1 and not request.finished


def shift_rows(batch, offsets: torch.Tensor, bound: int, ragged: bool):
    """A decode batch built at known positions, every row moved on by offsets[row] <= bound (on the device): its
    positions, sequence lengths and KV slots (from its page table), its host lengths by `bound` (an upper bound,
    which is what the attention backends size their work by); with `ragged`, its flattened KV indices too (an
    attention backend that reads them; on a CPU that is no wait)."""
    page = batch.page_size
    positions = batch.positions + offsets
    seq_lens = batch.seq_lens + offsets
    table = batch.page_table
    rows = torch.arange(table.shape[0], device=table.device)
    out_cache_loc = table[rows, positions // page].to(torch.int64) * page + positions % page
    changed = dict(positions=positions, seq_lens=seq_lens, out_cache_loc=out_cache_loc,
                   prefix_lens=tuple(p + bound for p in batch.prefix_lens))
    if ragged:
        slots = (table.to(torch.int64)[:, :, None] * page + torch.arange(page, device=table.device)).flatten(1)
        cols = torch.arange(slots.shape[1], device=table.device)
        changed["kv_indices"] = slots[cols[None, :] < seq_lens[:, None]]
        changed["kv_indptr"] = torch.cat([seq_lens.new_zeros(1), torch.cumsum(seq_lens, 0)])
    return attrs.evolve(batch, **changed)


class OverlapVerify:
    """Launches verify steps from device state and reads them one step late (the engine calls it)."""

    def __init__(self, speculation, runner, kv, device: torch.device, ragged: bool,
                 draft_pages: Callable[[int], list[int]], graphs=None):
        self.spec, self.runner, self.kv, self.device, self.ragged = speculation, runner, kv, device, ragged
        self.draft_pages = draft_pages  # Scheduler.draft_pages: free pages, then evicted cached ones
        self.graphs = graphs  # VerifyGraphs (verify_graphs.py): greedy steps whose shapes were captured replay them
        # the most rows a verify step may hold with the prompts of requests it admits (follow), or None: admissions
        # end a run of verify steps (build.admit_rows: the largest decode graph where mixed steps replay graphs)
        self.admit_rows: int | None = None

    def start(self, requests: list[Request], tracks_grammar, hooks=None) -> VerifyInFlight | None:
        """The first verify step of these decoding requests (their tokens all on the host), where the policy wants
        drafts and the pages are free; None otherwise (the engine's synchronous path then)."""
        policy = self.spec.policy
        if not eligible(requests, tracks_grammar) or not policy.may_draft(len(requests)):
            return None
        counts = policy.choose(requests, [self.spec.room(r) for r in requests], expect_offers=True)
        if not any(counts) or not self._cover(requests, 1 + max(counts)):
            return None
        return self.launch(requests, counts, None, hooks)

    @property
    def follows_plain(self) -> bool:
        """Whether a verify step may follow a plain step in flight before that step is read (after_plain): the
        drafter drafts from the tokens it samples, on the device. One that reads hidden states would need that
        step's rows: the step is read first for it."""
        return not self.spec.drafter.caps.needs_hidden

    def can_follow(self, step, running: Sequence[Request]) -> bool:
        """Whether after_plain applies to the plain `step` in flight: the drafter follows plain steps, and each
        running request either has only the token `step` samples for it to come or decodes from the host."""
        if not self.follows_plain or step is None:
            return False
        sampled = {id(r) for r in step.requests}
        return all(len(r.pending_rows) == 1 and r.num_uncached == 1 if id(r) in sampled else host_decodes(r)
                   for r in running)

    def after_plain(self, step, requests: list[Request], tracks_grammar, hooks=None) -> VerifyInFlight | None:
        """The first verify step of the running requests, launched before the plain `step` in flight (a decode,
        mixed or prompt step) is read: a request it samples for starts from that token on the device, the others
        from their last token on the host. The engine then reads `step`, as it reads a prompt step launched ahead.
        None where the policy drafts for none of them or the pages are not free (the engine reads `step` first)."""
        policy = self.spec.policy
        if not eligible(requests, tracks_grammar) or not policy.may_draft(len(requests)):
            return None
        rooms = [max(min(self.spec.lookahead, r.params.max_new_tokens - len(r.output_ids) - len(r.pending_rows) - 1), 0)
                 for r in requests]
        counts = policy.choose(requests, rooms, expect_offers=True)
        if not any(counts) or not self._cover(requests, 1 + max(counts)):
            return None
        return self.launch(requests, counts, VerifyInFlight.standing_for(step), hooks)

    def follow(self, previous: VerifyInFlight, scheduler, tracks_grammar, hooks=None) -> VerifyInFlight | None:
        """The next verify step of the same requests, launched before `previous` is read, with the running requests
        that joined since (their last token read: a prompt step's, launched ahead of `previous`) and, where requests
        wait, those whose whole prompt fits beside its rows (`admit_rows`: their prompt tokens as decode rows, then a
        row with no drafts at the last one; where every request of the run has ended, a step of those alone). None
        where the scheduler must act first (a request it runs that cannot decode yet, a prompt that does not fit,
        pages that only preemption would free) or where the policy drafts for none of them and ending the run costs
        less than going on without drafts (the engine's plain steps then)."""
        carried = [r for r in previous.requests if not r.finished]
        running = scheduler.running
        ids = {id(r) for r in carried}
        joined = [r for r in running if id(r) not in ids]
        requests = carried + joined
        waiting = scheduler.may_admit
        if (waiting and self.admit_rows is None) or len(requests) != len(running) or \
                not all(host_decodes(r) for r in joined) or (requests and not eligible(requests, tracks_grammar)):
            return None
        counts, ends = [], not requests  # ends: the run would end here unless it admits
        if requests:
            spec = self.spec
            if not spec.policy.may_draft(len(requests)):
                return None
            # from the records as of the step before `previous` (one stale)
            rooms = [min(spec.lookahead, r.params.max_new_tokens - len(r.output_ids) - 1) for r in requests]
            counts = spec.policy.choose(requests, rooms, expect_offers=True)
            # no drafts: a verify step of none while that costs less than ending the run (AdaptivePolicy.keeps_run:
            # the breaks of the overlap schedule now and when drafts are wanted again), or while requests wait for
            # the slots of these, whose tokens run out in the steps in flight (the next step admits them), else the
            # engine's plain step
            ends = not any(counts) and not spec.policy.keeps_run(len(requests), previous.idle + 1) and \
                not (scheduler.waiting and max(rooms) <= 0)
            if (ends and not waiting) or not self._cover(requests, previous.width + 1 + max(counts)):
                return None  # (_cover: rows start anywhere in `previous`'s run)
        width = 1 + max(counts, default=0)
        prompts = self._admit(scheduler, len(requests) * width, width, tracks_grammar) if waiting else []
        if not prompts and (waiting or ends):
            return None
        # (no request of `previous` in it: a step of new prompts only, which needs none of its tokens)
        step = self.launch(requests + [r for r, _ in prompts], counts + [0] * len(prompts),
                           previous if requests else None, hooks, prompts)
        for request, _ in prompts:  # its full pages may be shared now (their KV is written before any later step reads)
            scheduler.cache_progress(request)
        step.idle, step.prompts = 0 if any(counts) or prompts else previous.idle + 1, len(prompts)
        return step

    def _admit(self, scheduler, grid_rows: int, width: int, tracks_grammar) -> list[tuple[Request, int]]:
        """Waiting requests admitted into the next verify step with their whole prompt, each as (request, its first
        uncached position); their num_cached moves to their last prompt position, where their grid row starts."""

        def allowed(request: Request) -> bool:  # (after its prefix-cache match: num_cached set)
            n = request.num_uncached
            return eligible([request], tracks_grammar) and n * request.num_tokens <= PROMPT_ROW_READS

        prompts = []
        for request in scheduler.admit_whole(self.admit_rows - grid_rows, width, allowed):
            prompts.append((request, request.num_cached))
            request.num_cached = request.num_tokens - 1
        return prompts

    def read(self, step: VerifyInFlight, following: VerifyInFlight | None, append, fail, sampler) -> list[Request]:
        """Append a verify step's runs (read now) to its requests through `append`; those that finish with them."""
        spec, finished = self.spec, []
        outcome = step.read()
        spec.counts.step([[0] * row[1] for row, r in zip(outcome, step.requests) if not r.finished])
        then = {id(r) for r in following.requests} if following is not None else set()
        kept = []  # (row, request, its first position, tokens) of the live requests: the drafter observes a run's last
        for i, (request, row, chosen) in enumerate(zip(step.requests, outcome, step.chosen)):
            if request.finished:  # stopped in the step before (its rows here came too late) or aborted
                continue
            proposed, verified, accepted, tokens = row[0], row[1], row[2], row[3:]
            kept.append((i, request, request.num_cached, tokens))
            request.num_cached += 1 + accepted
            if chosen:
                spec.policy.offered(request, proposed > 0)
            if verified:
                request.spec_verify_steps += 1
                request.spec_draft_tokens += verified
                request.spec_accepted_tokens += accepted
                spec.policy.record(request, verified, accepted)
            sampler.record_accepted(request, tokens)
            if spec.append_run(request, tokens, None, append, fail, sampler):
                finished.append(request)
            else:  # the step in flight may still write its rows after the run
                spec.release_rejected(request, following.width if id(request) in then else 1)
        if following is None and spec.observes:
            self._observe_last(step, [k for k in kept if not k[1].finished])
        return finished

    def _observe_last(self, step: VerifyInFlight, kept) -> None:
        """The drafter's observe of a run's last verify step (the steps before it it drafted from on the device):
        the positions each live request kept and their hidden rows."""
        if not kept:
            return
        rows = [i * step.width + k for i, _, _, tokens in kept for k in range(len(tokens))]
        hidden = step.hidden.flatten(0, 1) if step.hidden is not None else None
        if hidden is not None:
            hidden = hidden[to_device(hidden.device, torch.tensor(rows, dtype=torch.int64))[0]]
        self.spec.drafter.observe(TargetStep(
            rids=[r.rid for _, r, _, _ in kept], starts=[start for _, _, start, _ in kept],
            next_ids=[list(tokens) for _, _, _, tokens in kept], pages=[tuple(r.pages) for _, r, _, _ in kept],
            hidden=hidden,
        ))

    def overhead(self, requests: int, rows: int) -> float:
        """Seconds a graphed step's graphs add to its forward (0.0 without them), for the step costs."""
        return self.graphs.overhead(requests, rows) if self.graphs is not None else 0.0

    def _cover(self, requests: Sequence[Request], positions: int) -> bool:
        """Pages for `positions` positions of each request from its first uncached one (draft_pages: drafts never
        preempt; pages left over go back when its step is read)."""
        for request in requests:
            missing = self.kv.pages_for(request.num_cached + positions) - len(request.pages)
            if missing > 0:
                pages = self.draft_pages(missing)
                request.pages.extend(pages)
                if len(pages) < missing:
                    return False
        return True

    def launch(self, requests: Sequence[Request], counts: Sequence[int], previous: VerifyInFlight | None,
               hooks=None, prompts: Sequence[tuple[Request, int]] = ()) -> VerifyInFlight:
        """Verify up to counts[i] device drafts for each request (pages cover its rows), after `previous`, whose
        tokens are not read yet (its live requests in its row order), or from the host's own state. `prompts`:
        (request, first position) of requests among them just admitted, whose prompt tokens from that position up to
        their last one (num_cached, where their grid rows start) run as decode rows after the grid."""
        requests = list(requests)
        width = 1 + max(counts)
        steps = self.spec.drafter.num_steps
        drafter_requests = [DraftRequest(r.rid, r.token_view, r.num_cached, tuple(r.pages), count)
                            for r, count in zip(requests, counts)]
        shape = None
        prompt_ids = [r.token_ids(first, r.num_cached - first) for r, first in prompts]
        # (token, position, pages) of each prompt row, after the grid's rows
        prompt_rows = [(t, first + k, r.pages) for (r, first), ids in zip(prompts, prompt_ids)
                       for k, t in enumerate(ids)]
        if self.graphs is not None:
            runtime = getattr(self.runner.model, "moe_runtime", None)
            shape = self.graphs.shape_for(requests, width, runtime is not None and runtime.records_load)
            if shape is not None and not self.graphs.holds(shape, len(prompt_rows)):
                shape = None
        if shape is not None:
            extra = self.graphs.extra_rows(prompt_rows) if prompt_rows else None
            return self._launch_graphed(shape, requests, counts, previous, drafter_requests, hooks, prompts,
                                        prompt_ids, extra)
        previous_rows = _previous_rows(previous, requests)
        starts = _starts(previous, requests, previous_rows)
        host_last = torch.tensor(host_last_tokens(requests, previous_rows), dtype=torch.int64)
        with_hidden = self.spec.drafter.caps.needs_hidden
        if previous is not None:  # rows of requests that joined since `previous` (-1) take their token from the host
            rows, host_last = to_device(self.device, torch.tensor(previous_rows), host_last)
            had, at = rows >= 0, rows.clamp_min(0)
            tokens, emitted = previous.accepted.tokens[at], torch.where(had, previous.accepted.emitted[at], 0)
            hidden = previous.hidden[at] if with_hidden else None
            drafts = self.spec.drafter.propose_on_device(drafter_requests,
                                                         DeviceTokens(tokens, emitted, hidden, width - 1))
            # a FAILED row's request ends when read
            last, offsets = torch.where(had, previous.accepted.last[at].clamp_min(0), host_last), emitted
        else:
            drafts = self.spec.drafter.propose_on_device(drafter_requests)
            last = to_device(self.device, host_last)[0]
            offsets = None
        chosen = to_device(self.device, torch.tensor(list(counts), dtype=torch.int64))[0]
        proposed = drafts.counts
        verified = torch.minimum(proposed, chosen)
        grid = drafts.tokens[:, : width - 1] if steps else drafts.tokens.new_empty(len(requests), 0)
        if grid.shape[1] < width - 1:
            grid = torch.nn.functional.pad(grid, (0, width - 1 - grid.shape[1]), value=-1)
        # a draft id outside the vocabulary voids the request's drafts (as on the host path) and never reaches the
        # embedding: decided on the device, with no read back
        k = torch.arange(grid.shape[1], device=grid.device)[None, :]
        bad = ((grid < 0) | (grid >= self.spec.vocab_size)) & (k < verified[:, None])
        verified = torch.where(bad.any(dim=1), 0, verified)
        grid = torch.where(k < verified[:, None], grid, -1)
        seqs = [ScheduledSeq([0], start + j, r.pages) for r, start in zip(requests, starts) for j in range(width)]
        seqs += [ScheduledSeq([t], position, pages) for t, position, pages in prompt_rows]
        grid_rows, input_ids = len(requests) * width, torch.cat([last[:, None], grid.clamp_min(0)], dim=1).flatten()
        batch = build_forward_batch(seqs, self.kv, self.device, rows=True)
        if offsets is not None:  # step N's emitted counts, which only the device knows yet (prompt rows: known)
            offsets = offsets.repeat_interleave(width)
            batch = shift_rows(batch, F.pad(offsets, (0, len(seqs) - grid_rows)), previous.width, self.ragged)
        if len(seqs) > grid_rows:  # the prompt rows' ids (on the host) after the grid's; logits of the grid's only
            prompt_tokens = torch.tensor([t for t, _, _ in prompt_rows], dtype=torch.int64)
            input_ids = torch.cat([input_ids, to_device(self.device, prompt_tokens)[0]])
            batch = attrs.evolve(batch, sample_rows=tuple(range(grid_rows)))
        batch = attrs.evolve(batch, input_ids=input_ids, overlap_split=False)
        if hooks is not None:
            hooks.hook.moeplex_batch_scheduled(batch=batch)
        rows = torch.arange(grid_rows, device=self.device)
        logits, hidden = self.runner.verify_forward(batch, rows, with_hidden)
        drawn = Sampler.draw(logits, [r for r in requests for _ in range(width)]).view(len(requests), width)
        accepted = accept(drawn, grid, verified)
        packed = torch.cat([proposed[:, None], verified[:, None], accepted.counts[:, None], accepted.tokens], dim=1)
        if hidden is not None and self.spec.observes:  # the prompts' positions but the last, as a plain step's
            self._observe_prompts(prompts, prompt_ids, hidden[grid_rows:])
        hidden = hidden[:grid_rows].view(len(requests), width, -1) if hidden is not None else None
        return VerifyInFlight(requests, width, list(counts), accepted, *_to_host(packed), hidden=hidden)

    def _observe_prompts(self, prompts: Sequence[tuple[Request, int]], prompt_ids, hidden: torch.Tensor) -> None:
        """The drafter's observe of the prompt rows a verify step held: each position's hidden row and the prompt
        token after it (the last position's next token is the step's own, which the next step's drafts start from)."""
        kept = [(r, first, ids) for (r, first), ids in zip(prompts, prompt_ids) if ids]
        if kept:
            self.spec.drafter.observe(TargetStep(
                rids=[r.rid for r, _, _ in kept], starts=[first for _, first, _ in kept],
                next_ids=[r.token_ids(first + 1, len(ids)) for r, first, ids in kept],
                pages=[tuple(r.pages) for r, _, _ in kept], hidden=hidden,
            ))

    def _launch_graphed(self, shape, requests, counts, previous: VerifyInFlight | None, drafter_requests,
                        hooks, prompts=(), prompt_ids=(), extra=None) -> VerifyInFlight:
        """launch, replayed from VerifyGraphs (the same rows reach the host); the prompts' rows (`extra`, ExtraRows)
        after the grid."""
        if previous is not None and not previous.graphed:  # its accepted tokens are not where the graphs read them yet
            self.graphs.carry(previous.accepted, previous.hidden)
        rows = _previous_rows(previous, requests)
        accepted, packed, hidden, prompt_hidden = self.graphs.launch(
            shape, requests, counts, rows, drafter_requests, self.runner, hooks, _starts(previous, requests, rows), extra)
        if prompt_hidden is not None and self.spec.observes:
            self._observe_prompts(prompts, prompt_ids, prompt_hidden)
        return VerifyInFlight(requests, shape[1], list(counts), accepted, *_to_host(packed), graphed=True,
                              hidden=hidden)


def host_last_tokens(requests: Sequence[Request], previous_rows: Sequence[int]) -> list[int]:
    """Each request's last token where the host has it (no row in the step before: -1), else 0 (the device's)."""
    return [r.token_ids(r.num_cached, 1)[0] if row < 0 else 0 for r, row in zip(requests, previous_rows)]


def _previous_rows(previous: VerifyInFlight | None, requests: Sequence[Request]) -> list[int]:
    """Each request's row in `previous` (-1: not in it, its last token is on the host)."""
    index = {} if previous is None else {id(r): i for i, r in enumerate(previous.requests)}
    return [index.get(id(r), -1) for r in requests]


def _starts(previous: VerifyInFlight | None, requests: Sequence[Request], previous_rows: Sequence[int]) -> list[int]:
    """Each request's position of its row in `previous` (where the shift by what that step emitted starts), or its
    first uncached one (no row there)."""
    ahead = previous.ahead if previous is not None else 0
    return [r.num_cached - (ahead if row >= 0 else 0) for r, row in zip(requests, previous_rows)]


def _to_host(packed: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """(the packed rows on the host, complete once the event is reached): a copy to pinned memory on a GPU; on a
    CPU a copy too where the rows are a graph's static tensor (the next step overwrites it)."""
    if packed.device.type != "cuda":
        return packed.clone(), None
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(packed.device))
    return host, ready
