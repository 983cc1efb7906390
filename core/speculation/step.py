"""One engine step with speculation: draft, one target forward, verify, append, release the rejected KV.

A decoding request (one uncached token, at least one output) gets up to num_steps drafts from the
drafter; the step computes its last token and the drafts at 1 + m positions through the paged cache, as a
short extend or one decode row each (ModelRunner.prepare; the scheduler reserved pages for them). The accepted drafts and the target's own next
token are appended one at a time, so a stop token, stop string or max_new_tokens inside an accepted run
ends the request exactly there. num_cached then counts only the accepted positions, so the prefix cache
never stores a rejected one; their slots are overwritten by later steps, and whole pages beyond the
accepted length go back to the free list.

A step that drafts here runs without the overlap schedule: the drafts of step N+1 depend on the tokens step N
accepts (a drafter that drafts on the device verifies under it instead: overlap.py). How many drafts each request
verifies is the policy's choice (policy.py): adaptive (a measured step-cost model and each request's running
acceptance) or fixed (every due request drafts num_steps, with backoff after misses). A step in which no request
drafts is a plain step and takes the engine's ordinary path, overlap schedule and decode graphs included; for a
drafter that reads hidden states that path keeps the step's hidden rows, and the drafter observes them once the
step's tokens are read (plain_step). Drafting less never changes a token (verify.py), so the policy changes speed
only.
"""

from __future__ import annotations

import logging
import math
import numbers

from typing import Callable, Sequence

import attrs
import torch

from ..forward_batch import ForwardBatch
from ..interfaces import Drafter, DraftRequest, TargetStep
from ..kv_cache import KVPool
from ..model_runner import verify_logit_rows
from ..request import Request
from ..sampler import FAILED, Sampler
from ..scheduler import ScheduledWork
from ..transfer import to_device
from .policy import AdaptivePolicy, FixedPolicy
from .verify import verify

log = logging.getLogger(__name__)

MAX_UNASKED = 16  # steps: the longest a cheap drafter goes unasked after the policy kept declining its proposals
MAX_QUIET = 64  # steps: the longest drafts go unwanted after reads of the step in flight that launched no verify step
GAP_WEIGHT = 0.2  # PromptGaps: the latest gap's weight in the running mean

@attrs.define
class SpecCounts:
    """Since start-up, the policy's decisions (/metrics): decode steps with and without drafts, the drafts
    verified, and the requests that drafted, summed over the verify steps."""

    verify_steps: int = 0
    plain_steps: int = 0
    drafts: int = 0
    drafting: int = 0

    def step(self, drafts: Sequence[Sequence[int]]) -> None:
        if any(drafts):
            self.verify_steps += 1
            self.drafts += sum(len(d) for d in drafts)
            self.drafting += sum(1 for d in drafts if d)
        else:
            self.plain_steps += 1


@attrs.frozen
class PlainStep:
    """A step the engine ran on its ordinary path, for a drafter that reads its hidden states."""

    work: list[ScheduledWork]
    starts: list[int]  # each request's num_cached before the step
    preemptions: list[int]  # each request's num_preemptions then
    hidden: torch.Tensor  # [T, H] every token row's pre-norm hidden state


@attrs.define
class PromptGaps:
    """Engine steps between steps that hold prompt tokens (an admission, a prompt's chunk), each of which ends a run
    of overlapped verify steps: a running mean (GAP_WEIGHT on the latest gap), and at least the gap under way;
    unknown (infinite) until the first gap closes. Under steady serving at 32-64 requests a prompt came every
    2.6 steps (H100, Qwen3 12 layers), so a run entered from plain steps paid its two breaks of the overlap
    schedule every 2-3 verify steps. A count of steps: every rank alike."""

    mean: float = math.inf
    since: int = 0
    seen: bool = False  # a prompt step came (the gap before the first one is start-up's, not the workload's)

    def stepped(self, holds_prompt: bool) -> None:
        self.since += 1
        if not holds_prompt:
            return
        if self.seen:
            self.mean = self.since if math.isinf(self.mean) else (1 - GAP_WEIGHT) * self.mean + GAP_WEIGHT * self.since
        self.seen, self.since = True, 0

    def expected(self) -> float:
        return max(self.mean, self.since)


def is_decoding(item: ScheduledWork) -> bool:
    request = item.request
    return item.num_tokens == 1 and request.num_uncached == 1 and bool(request.output_ids)


def observes(drafter_cls) -> bool:
    """Whether a drafter class overrides `Drafter.observe` (learns from each step's kept tokens)."""
    return drafter_cls.observe is not Drafter.observe


class SpeculativeDecoding:
    def __init__(self, drafter: Drafter, kv: KVPool, vocab_size: int, decode_rows: bool = False,
                 policy: AdaptivePolicy | FixedPolicy | None = None, name: str = ""):
        self.drafter = drafter
        self.kv = kv
        self.vocab_size = vocab_size
        self.name = name or type(drafter).__name__  # the --speculative-algorithm value, for the log
        self.refused = 0  # requests' drafts dropped for an id outside the vocabulary
        self.policy = policy if policy is not None else FixedPolicy(drafter.num_steps)
        self.counts = SpecCounts()
        self._choice = None  # ((rids, rooms), counts): drafts_in's choice, reused by draft() in the same step
        # a drafter that keeps the base class's no-op observe (ngram: it reads DraftRequest.token_ids) is not
        # told what each step kept: building that TargetStep costs a list per request per step for nothing
        self.observes = observes(type(drafter))
        # a cheap drafter asked at every step whose proposals the policy declines (too short to pay for a verify
        # step at this batch size) costs the asking for nothing: after steps declined in a row it is left unasked
        # for 2, 4, ... MAX_UNASKED steps while the batch keeps its size (a count of steps: every rank alike). A
        # steady batch's size dips by one while a slot takes its next prompt: within an eighth below the size
        # counts as the same (a larger batch pays for drafts less still); a batch that shrinks more is asked at once
        self._declined = 0
        self._unasked = (0, 0)  # (steps left unasked, the number of decoding requests then)
        # under the overlap schedule, wanting drafts reads the step in flight first (a break); a break after which no
        # verify step came (no page, no draft the policy kept) cost the overlap for nothing: after such breaks in a
        # row, drafts go unwanted for 1, 2, 4, ... MAX_QUIET steps (a count of steps: every rank alike). Drafts that
        # found no page caused ~300 of them a run at batch 32 on an H100 (session 10) before draft_pages was fixed
        self._wasted = 0
        self._quiet = 0
        self.prompt_gaps = PromptGaps()  # how long a run of verify steps started now may last (wants_drafts)
        self._steps = 0  # engine steps ended (stepped): _first_choice's cache holds for one step
        # verify steps as decode rows (ModelRunner.prepare): where the attention backend's paged decode reads
        # only fixed-size tensors (triton), so those batches replay the decode CUDA graphs; else as extends
        # (the torch backend's per-request SDPA over a prefix is the cheaper of its two paths)
        self.decode_rows = decode_rows

    @property
    def lookahead(self) -> int:
        """Positions a decoding request may add beyond its next token (the scheduler reserves their pages)."""
        return self.drafter.num_steps

    @property
    def reads_plain_steps(self) -> bool:
        """Whether the engine's ordinary steps (no drafts) keep their hidden rows for the drafter: one that reads
        hidden states must see every position the target kept (plain_step, then observe_plain)."""
        return self.drafter.caps.needs_hidden and self.observes

    @staticmethod
    def plain_step(work: Sequence[ScheduledWork], hidden: torch.Tensor) -> PlainStep:
        """A step on the ordinary path, before its requests advance: what observe_plain tells the drafter."""
        requests = [item.request for item in work]
        return PlainStep(list(work), [r.num_cached for r in requests], [r.num_preemptions for r in requests], hidden)

    def observe_plain(self, step: PlainStep) -> None:
        """Once the step's tokens are on the host (under the overlap schedule one step late): the drafter's observe,
        as a verify step without drafts gives it. A request preempted since keeps nothing of the step."""
        kept = [item.num_tokens if item.request.num_preemptions == n else 0
                for item, n in zip(step.work, step.preemptions)]
        self._observe(step.work, [()] * len(step.work), step.starts, kept, step.hidden)

    def room(self, request: Request) -> int:
        """Drafts the request can verify now: its reserved pages and its max_new_tokens bound them."""
        return min(self.lookahead, request.params.max_new_tokens - len(request.output_ids) - 1,
                   len(request.pages) * self.kv.page_size - request.num_tokens)

    def wants_drafts(self, running: Sequence[Request], breaks: int = 2) -> bool:
        """Whether the policy would draft for some of these running requests (those that decode), in a run that pays
        for the `breaks` breaks of the overlap schedule entering it makes (run_pays: 2 where the step in flight must
        be read first, 1 where a verify step can follow it unread). Drafts count with their chance of coming: a
        step that drafts nothing would have given up the overlap schedule for nothing."""
        decoding = [r for r in running if r.output_ids]
        if self._quiet:
            self._quiet -= 1
            return False
        if not decoding or not self.policy.may_draft(len(decoding)) or self._left_unasked(len(decoding)):
            return False
        counts = self.policy.choose(decoding, self._token_rooms(decoding), expect_offers=True)
        return any(counts) and self.policy.run_pays(decoding, counts, self.prompt_gaps.expected(), breaks)

    def mixed_pays(self, decoding: Sequence[Request]) -> bool:
        """Whether a step holding prompt tokens beside these decoding requests verifies drafts: the policy's
        mixed_pays for the drafts it would choose (their chance of coming counted)."""
        if not decoding or not self.policy.may_draft(len(decoding)):
            return False
        return self.policy.mixed_pays(decoding, self.policy.choose(decoding, self._token_rooms(decoding),
                                                                   expect_offers=True))

    def _token_rooms(self, decoding: Sequence[Request]) -> list[int]:
        """Drafts each request could verify by its tokens alone (before the schedule reserves its pages: room)."""
        return [min(self.lookahead, r.params.max_new_tokens - len(r.output_ids) - 1) for r in decoding]

    def stepped(self, holds_prompt: bool) -> None:
        """An engine step ended; whether it held prompt tokens (such a step ends a run of overlapped verify steps)."""
        self.prompt_gaps.stepped(holds_prompt)
        self._steps += 1

    def drafts_in(self, decoding: Sequence[Request]) -> bool:
        """Whether a step of these decoding requests (is_decoding) takes the speculative path (with no step in
        flight; asking a cheap drafter costs nothing then)."""
        return any(self._first_choice(decoding))

    def _first_choice(self, requests: Sequence[Request]) -> list[int]:
        """The policy's choice before asking the drafter; drafts_in's is kept for the draft() of the same step."""
        if not requests or not self.policy.may_draft(len(requests)):
            return [0] * len(requests)  # the step stays plain whatever the records say: look at nothing
        key = (self._steps, [(r.rid, len(r.output_ids)) for r in requests])  # the same requests at the same tokens
        if self._choice is not None and self._choice[0] == key:  # in the same step (so the same pages and rooms)
            return self._choice[1]
        rooms = [self.room(r) for r in requests]
        if self.drafter.caps.cheap_proposals:  # who is asked: every request with room, where some draft could pay
            counts = [0] * len(requests) if self._left_unasked(len(requests)) else self.policy.candidates(requests, rooms)
        else:
            counts = self.policy.choose(requests, rooms, expect_offers=True)
        self._choice = (key, counts)
        return counts

    def draft(self, work: Sequence[ScheduledWork]) -> list[list[int]]:
        """Per scheduled item, the drafts it verifies this step (none for prompt chunks and undrafted requests).

        A drafter whose proposals are cheap is asked for every request the policy might draft for, and the
        policy then chooses once among what it proposed (choosing first, as if every proposal came in full,
        asked it for drafts that a shorter proposal then did not pay for: two choices and the asking, every step,
        for nothing); any other is asked only for the drafts the policy chose."""
        decoding = [i for i, item in enumerate(work) if is_decoding(item)]
        requests = [work[i].request for i in decoding]
        cheap = self.drafter.caps.cheap_proposals
        counts = self._first_choice(requests)
        self._choice = None  # the records change after this step
        drafts: list[list[int]] = [[] for _ in work]
        asked = [j for j, m in enumerate(counts) if m > 0]
        if not asked:
            return drafts
        proposed = self.drafter.propose([DraftRequest(requests[j].rid, requests[j].token_view, requests[j].num_cached,
                                                      tuple(requests[j].pages), counts[j]) for j in asked]).tokens
        made = [[] for _ in requests]
        for j, tokens in zip(asked, proposed):
            made[j] = self._in_vocabulary(requests[j], list(tokens))[: counts[j]]  # a bad id anywhere: none of it
            self.policy.offered(requests[j], bool(made[j]))
        if cheap:
            counts = self.policy.choose(requests, [len(m) for m in made])
            self._record_asked(any(made), any(counts), len(requests))
        for j, i in enumerate(decoding):
            drafts[i] = made[j][: counts[j]]
        return drafts

    def break_ended(self, verified: bool) -> None:
        """A step that read the step in flight because drafts were wanted ended: whether it verified drafts."""
        if verified:
            self._wasted = 0
        else:
            self._wasted += 1
            self._quiet = min(2 ** (self._wasted - 1), MAX_QUIET)

    def _left_unasked(self, n: int) -> bool:
        """Whether a cheap drafter stays unasked this step (one call per step that may draft)."""
        left, size = self._unasked
        if not left or not size - size // 8 <= n:
            return False
        self._unasked = (left - 1, size)
        return True

    def _record_asked(self, proposed: bool, kept: bool, n: int) -> None:
        """After asking a cheap drafter: whether it proposed anything, and whether the policy kept any of it."""
        if kept:
            self._declined = 0
        elif proposed:
            self._declined += 1
            if self._declined >= 2:
                self._unasked = (min(2 ** (self._declined - 1), MAX_UNASKED), n)

    def _in_vocabulary(self, request: Request, tokens: list[int]) -> list[int]:
        """The drafts, or none when one is not a token id of the target: a faulty drafter's proposal is not
        verified at all (the rest of it is suspect too), and the first such proposal is logged once."""
        bad = next((t for t in tokens if not (isinstance(t, numbers.Integral) and 0 <= t < self.vocab_size)), None)
        if bad is None:
            return tokens
        if not self.refused:
            log.warning("drafter '%s' proposed id %r for request %s, outside the vocabulary 0..%d; its drafts are "
                        "dropped (and further such proposals without a log line)", self.name, bad, request.rid,
                        self.vocab_size - 1)
        self.refused += 1
        return []

    def run(self, work: Sequence[ScheduledWork], batch: ForwardBatch, drafts: Sequence[Sequence[int]],
            forward: Callable, scheduler, append: Callable[[Request, int], bool], fail: Callable[[Request], None],
            logprobs: Sampler, mask: Callable | None = None) -> list[Request]:
        """The step of `batch` (already agreed between ranks); the requests that finished in it."""
        rows, due = verify_logit_rows(work, drafts)
        if any(is_decoding(item) for item in work):
            self.counts.step(drafts)
        logits, hidden = forward(batch, to_device(batch.input_ids.device, torch.tensor(rows, dtype=torch.int64))[0],
                                 self.drafter.caps.needs_hidden)
        starts = [item.request.num_cached for item in work]
        for item in work:
            request = item.request
            request.num_cached += item.num_tokens
            if request.num_cached <= len(request.prompt_ids):  # a prompt chunk: its pages may be shared now
                scheduler.cache_progress(request)
        requests = [work[i].request for i in due]
        if mask is not None:  # structured outputs: each verify row masked at its draft's position in the grammar
            logits = mask(logits, [r.rid for r in requests], [drafts[i] for i in due])
        results = verify(logprobs.adjust_verify(logits, requests, [drafts[i] for i in due]), requests,
                         [drafts[i] for i in due])
        finished, at = [], 0
        kept = [item.num_tokens for item in work]
        for i, request, tokens in zip(due, requests, results):
            span = logits[at : at + len(drafts[i]) + 1] if request.params.logprobs > 0 else None
            at += len(drafts[i]) + 1
            accepted = len(tokens) - 1
            if drafts[i]:
                request.num_cached += accepted  # the accepted drafts' KV; the rejected ones' is left behind
                kept[i] += accepted
                request.spec_verify_steps += 1
                request.spec_draft_tokens += len(drafts[i])
                request.spec_accepted_tokens += accepted
                self.policy.record(request, len(drafts[i]), accepted)
            logprobs.record_accepted(request, tokens)
            if self.append_run(request, tokens, span, append, fail, logprobs):
                finished.append(request)
            else:
                self.release_rejected(request)
        self._observe(work, drafts, starts, kept, hidden)
        return finished

    @staticmethod
    def append_run(request, tokens, span, append, fail, logprobs: Sampler) -> bool:
        for k, token in enumerate(tokens):
            if token == FAILED:
                fail(request)
                return True
            if request.params.logprobs > 0:
                logprobs.record_logprobs(span[k : k + 1], [request], [token])
            if append(request, token):
                return True
        return False

    def release_rejected(self, request: Request, rows: int = 1) -> None:
        """Whole pages beyond the request's next `rows` positions (its next token; under the overlap schedule the
        rows of a step still in flight) go back to the free list."""
        keep = max(self.kv.pages_for(request.num_cached + rows), request.num_shared_pages)
        if len(request.pages) > keep:
            self.kv.release(request.pages[keep:])
            del request.pages[keep:]

    def _observe(self, work, drafts, starts, kept, hidden) -> None:
        """Tell the drafter which positions now hold target KV and what followed each (live requests only)."""
        live = [i for i, item in enumerate(work) if not item.request.finished and kept[i]] if self.observes else []
        if not live:
            return
        first = [0]
        for item, draft in zip(work, drafts):
            first.append(first[-1] + item.num_tokens + len(draft))
        if hidden is not None:
            rows = [t for i in live for t in range(first[i], first[i] + kept[i])]
            if len(rows) < hidden.shape[0]:  # (all of them, in order, in a plain step of live requests: no copy)
                hidden = hidden[to_device(hidden.device, torch.tensor(rows, dtype=torch.int64))[0]]
        self.drafter.observe(TargetStep(
            rids=[work[i].request.rid for i in live],
            starts=[starts[i] for i in live],
            next_ids=[work[i].request.token_ids(starts[i] + 1, kept[i]) for i in live],
            pages=[tuple(work[i].request.pages) for i in live],
            hidden=hidden,
        ))

    def finished(self, request: Request) -> None:
        self.policy.finished(request.rid)
        self.drafter.finished(request.rid)
