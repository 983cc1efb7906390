"""One engine step with speculation: draft, one target forward, verify, append, release the rejected KV.

A decoding request (one uncached token, at least one output) gets up to num_steps drafts from the
drafter; the step computes its last token and the drafts at 1 + m positions through the paged cache, as a
short extend or one decode row each (ModelRunner.prepare; the scheduler reserved pages for them). The accepted drafts and the target's own next
token are appended one at a time, so a stop token, stop string or max_new_tokens inside an accepted run
ends the request exactly there. num_cached then counts only the accepted positions, so the prefix cache
never stores a rejected one; their slots are overwritten by later steps, and whole pages beyond the
accepted length go back to the free list.

A step that drafts runs without the overlap schedule: the drafts of step N+1 depend on the tokens step N
accepts. Backoff keeps a drafter that cannot predict a request from costing it much: after two verify steps
running in which a request's drafts all missed, it pauses drafting for 2, 4, ... MAX_PAUSE of its tokens
(... IDLE_PAUSE where the drafter had nothing to say: that costs only the asking), and any accepted draft
ends the pause. A step in which no request drafts is
a plain step; where the drafter needs no hidden states (it sees every token through DraftRequest), such steps
take the engine's ordinary path, overlap schedule included.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..forward_batch import ForwardBatch
from ..interfaces import Drafter, DraftRequest, TargetStep
from ..kv_cache import KVPool
from ..request import Request
from ..sampler import FAILED, Sampler
from ..scheduler import ScheduledWork
from ..transfer import to_device
from .verify import verify


MAX_PAUSE = 64  # tokens: the longest a request goes without drafts after its drafts kept missing
IDLE_PAUSE = 8  # tokens: the longest after the drafter had nothing to say (asking again is cheap)


def is_decoding(item: ScheduledWork) -> bool:
    request = item.request
    return item.num_tokens == 1 and request.num_uncached == 1 and bool(request.output_ids)


class SpeculativeDecoding:
    def __init__(self, drafter: Drafter, kv: KVPool, vocab_size: int, decode_rows: bool = False, backoff: bool = True):
        self.drafter = drafter
        self.kv = kv
        self.vocab_size = vocab_size
        self.backoff = backoff
        self._misses: dict[str, int] = {}  # per request: verify steps running whose drafts all missed
        self._resume_at: dict[str, int] = {}  # per paused request: the output length at which it drafts again
        # verify steps as decode rows (ModelRunner.prepare): where the attention backend's paged decode reads
        # only fixed-size tensors (triton), so those batches replay the decode CUDA graphs; else as extends
        # (the torch backend's per-request SDPA over a prefix is the cheaper of its two paths)
        self.decode_rows = decode_rows

    @property
    def lookahead(self) -> int:
        """Positions a decoding request may add beyond its next token (the scheduler reserves their pages)."""
        return self.drafter.num_steps

    @property
    def plain_steps_overlap(self) -> bool:
        """Whether a step without drafts may take the engine's ordinary path (the overlap schedule included):
        the drafter sees every token through DraftRequest and needs no hidden states from such a step."""
        return not self.drafter.caps.needs_hidden

    def due(self, request: Request) -> bool:
        """Whether the request drafts when it next decodes (it has a token to draft from and is not paused)."""
        return bool(request.output_ids) and len(request.output_ids) >= self._resume_at.get(request.rid, 0)

    def drafts_in(self, work: Sequence[ScheduledWork]) -> bool:
        return any(is_decoding(item) and self.due(item.request) for item in work)

    def draft(self, work: Sequence[ScheduledWork]) -> list[list[int]]:
        """Per scheduled item, the drafts it verifies this step (none for prompt chunks and paused requests)."""
        rows = [i for i, item in enumerate(work) if is_decoding(item) and self.due(item.request)]
        drafts: list[list[int]] = [[] for _ in work]
        if not rows:
            return drafts
        asked = [work[i].request for i in rows]
        proposed = self.drafter.propose(
            [DraftRequest(r.rid, r.all_ids, r.num_cached, tuple(r.pages)) for r in asked]
        ).tokens
        for i, request, tokens in zip(rows, asked, proposed):
            room = min(self.lookahead, request.params.max_new_tokens - len(request.output_ids) - 1,
                       len(request.pages) * self.kv.page_size - request.num_tokens)
            tokens = list(tokens[: max(room, 0)])
            bad = next((k for k, t in enumerate(tokens) if not 0 <= t < self.vocab_size), len(tokens))
            drafts[i] = tokens[:bad]  # a draft outside the vocabulary (a faulty drafter) ends the chain
            if not drafts[i] and room > 0:
                self._missed(request, IDLE_PAUSE)  # asked, with room, and nothing to say
        return drafts

    def _missed(self, request: Request, longest: int = MAX_PAUSE) -> None:
        if not self.backoff:
            return
        misses = self._misses[request.rid] = self._misses.get(request.rid, 0) + 1
        if misses >= 2:
            self._resume_at[request.rid] = len(request.output_ids) + min(2 ** (misses - 1), longest)

    def _hit(self, request: Request) -> None:
        self._misses.pop(request.rid, None)
        self._resume_at.pop(request.rid, None)

    @staticmethod
    def logit_rows(work: Sequence[ScheduledWork], drafts: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
        """The token rows whose logits the step needs (a due request's last token and its drafts), and the
        work items that are due a token."""
        rows, due, at = [], [], 0
        for i, (item, draft) in enumerate(zip(work, drafts)):
            at += item.num_tokens + len(draft)
            if item.request.num_uncached - item.num_tokens == 0:
                due.append(i)
                rows.extend(range(at - len(draft) - 1, at))
        return rows, due

    def run(self, work: Sequence[ScheduledWork], batch: ForwardBatch, drafts: Sequence[Sequence[int]],
            forward: Callable, scheduler, append: Callable[[Request, int], bool], fail: Callable[[Request], None],
            logprobs: Sampler, mask: Callable | None = None) -> list[Request]:
        """The step of `batch` (already agreed between ranks); the requests that finished in it."""
        rows, due = self.logit_rows(work, drafts)
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
        results = verify(logits, requests, [drafts[i] for i in due])
        finished, at = [], 0
        kept = [item.num_tokens for item in work]
        for i, request, tokens in zip(due, requests, results):
            span = logits[at : at + len(drafts[i]) + 1]
            at += len(drafts[i]) + 1
            accepted = len(tokens) - 1
            if drafts[i]:
                request.num_cached += accepted  # the accepted drafts' KV; the rejected ones' is left behind
                kept[i] += accepted
                request.spec_verify_steps += 1
                request.spec_draft_tokens += len(drafts[i])
                request.spec_accepted_tokens += accepted
                if accepted:
                    self._hit(request)
                else:
                    self._missed(request)
            if self._append_run(request, tokens, span, append, fail, logprobs):
                finished.append(request)
            else:
                self._release_rejected(request)
        self._observe(work, drafts, starts, kept, hidden)
        return finished

    @staticmethod
    def _append_run(request, tokens, span, append, fail, logprobs: Sampler) -> bool:
        for k, token in enumerate(tokens):
            if token == FAILED:
                fail(request)
                return True
            if request.params.logprobs > 0:
                logprobs.record_logprobs(span[k : k + 1], [request], [token])
            if append(request, token):
                return True
        return False

    def _release_rejected(self, request: Request) -> None:
        """Whole pages beyond the request's next position go back to the free list."""
        keep = max(self.kv.pages_for(request.num_tokens), request.num_shared_pages)
        if len(request.pages) > keep:
            self.kv.release(request.pages[keep:])
            del request.pages[keep:]

    def _observe(self, work, drafts, starts, kept, hidden) -> None:
        """Tell the drafter which positions now hold target KV and what followed each (live requests only)."""
        live = [i for i, item in enumerate(work) if not item.request.finished and kept[i]]
        if not live:
            return
        first = [0]
        for item, draft in zip(work, drafts):
            first.append(first[-1] + item.num_tokens + len(draft))
        if hidden is not None:
            rows = [t for i in live for t in range(first[i], first[i] + kept[i])]
            hidden = hidden[to_device(hidden.device, torch.tensor(rows, dtype=torch.int64))[0]]
        self.drafter.observe(TargetStep(
            rids=[work[i].request.rid for i in live],
            starts=[starts[i] for i in live],
            next_ids=[work[i].request.token_ids(starts[i] + 1, kept[i]) for i in live],
            pages=[tuple(work[i].request.pages) for i in live],
            hidden=hidden,
        ))

    def finished(self, request: Request) -> None:
        self._hit(request)
        self.drafter.finished(request.rid)
