"""The engine's speculative steps: whether a step verifies drafts, and how (overlapped or synchronously).

`Engine` (core/engine.py) inherits these. They read and replace its step in flight (`in_flight`) and call its
launch, completion and agreement paths (`_launch`, `_complete`, `_agree`), so they sit beside its step loop as
part of the same object; they are kept apart by concern, the loop itself staying in `Engine._step`.
"""

from __future__ import annotations

import attrs

from ..in_flight import InFlight
from ..request import Request
from .overlap import VerifyInFlight, eligible, host_decodes
from .step import is_decoding


class SpeculativeSteps:
    def _prompt_due(self) -> bool:
        """Whether the next step holds prompt tokens and drafts nothing whatever the policy wants (a plain mixed
        step: _mixed_plain): reading the step in flight for drafts would break the overlap schedule for nothing.
        (H100, Qwen3 12 layers, steady 64 with ngram: 41-46 such breaks a run.) A step that may verify is one whose
        rows, every decoding request at its full draft width beside the prompt's next chunk, fit the largest decode
        graph, and whose drafts the policy finds worth a synchronous step (mixed_pays)."""
        scheduler = self.scheduler
        if not self.plain_mixed_steps:
            return False
        prompt = scheduler.next_prompt()
        if prompt is None:
            return False
        graphs = self.runner.graphs
        decoding = [r for r in scheduler.running if r.num_uncached == 1]
        rows = len(decoding) * (1 + self.speculation.lookahead) + min(prompt.num_uncached, scheduler.chunk_size)
        return graphs is None or not self.speculation.decode_rows or rows > graphs.sizes[-1] or \
            not self.speculation.mixed_pays(decoding)

    def _mixed_plain(self, work, decoding: list[Request]) -> bool:
        """Whether a step holding prompt tokens beside decodes drafts nothing (plain_mixed_steps: --mixed-chunk auto
        where decode steps replay graphs): unless its rows, each decoding request at its full draft width, replay a
        decode graph as verify rows (ModelRunner.verify_replays) and the policy finds its drafts worth a
        synchronous step (AdaptivePolicy.mixed_pays: such a step waits for the step in flight and for its own
        forward). Always drafting there (session 24) cost ngram on random weights 3% and 9% at steady 32 and 64
        (H100, Qwen3 12 layers: 12-17 ms a step against 5-6 for a plain mixed one, for 2.0 tokens a request), and
        gained nextn 7% on the deep DeepSeek-V3 shapes at 32 (2.9 tokens a request). `--mixed-chunk on` drafts in
        every mixed step."""
        if not self.plain_mixed_steps or len(decoding) == len(work):
            return False
        if not self.speculation.decode_rows:
            return True
        lookahead = self.speculation.lookahead
        return not self.runner.verify_replays(work, [lookahead if is_decoding(item) else 0 for item in work]) or \
            not self.speculation.mixed_pays(decoding)

    def _admit_ahead(self) -> tuple[InFlight | None] | None:
        """Where a verify step in flight ends its run because requests wait: their prompt step, scheduled and
        launched before that step is read, so the device runs it while the host reads (the prompt needs none of
        the tokens in flight, as when the plain overlap schedule admits). The launched step in a 1-tuple (None in
        it where no token is due: a prompt chunk); None where nothing is admitted."""
        work = self.scheduler.admissions() if self.pd is None else []
        if not work:
            return None
        batch = self._agree(self.runner.prepare(work, None))
        return (self._launch(work, batch) if batch is not None else None,)

    def _follows_plain(self) -> bool:
        """Whether a verify step of every running request can be launched before the plain step in flight is read
        (OverlapVerify.after_plain): each one that step samples for has only that token to come, every other decodes
        with its token on the host. Entering a run of verify steps then breaks the overlap schedule only where
        it ends (H100, Qwen3 12 layers, steady 64: every admission's mixed step was read for drafts, a break)."""
        return self.overlap_verify is not None and self.pd is None and \
            self.overlap_verify.can_follow(self.in_flight, self.scheduler.running)

    def _verify_ahead(self, follows: bool) -> VerifyInFlight | None:
        """A verify step launched before the plain step in flight is read, so the device runs it while the host
        reads: of every running request where the drafter can follow that step (`follows`: _follows_plain); else,
        where that step samples only for some (a prompt step launched ahead of a verify step's read) and every
        other one decodes with its token on the host, of those (the step's own requests join the next verify
        step: OverlapVerify.follow). None where neither applies or the policy drafts for none of them."""
        if self.overlap_verify is None or self.pd is not None or self.scheduler.may_admit:
            return None
        if follows:
            launched = self.overlap_verify.after_plain(self.in_flight, list(self.scheduler.running),
                                                       self.grammar.tracks, self.hooks)
        else:
            pending = {id(r) for r in self.in_flight.requests}
            ready = [r for r in self.scheduler.running if id(r) not in pending]
            if not ready or not all(host_decodes(r) for r in ready):
                return None
            launched = self.overlap_verify.start(ready, self.grammar.tracks, self.hooks)
        if launched is not None:
            self.balancing.after_forward()
            self.step_log.launched("verify_overlap", *launched.shape)
        return launched

    def _speculative_step(self, work, drafts: list[list[int]]) -> list[Request]:
        batch = self.runner.prepare(work, drafts=drafts, decode_rows=self.speculation.decode_rows)
        if any(drafts):  # micro-batches would cut between a request's verify rows, which read each other's KV
            batch = attrs.evolve(batch, overlap_split=False)
        batch = self._agree(batch)
        if batch is None:
            return []
        self.hooks.hook.moeplex_batch_scheduled(batch=batch)
        decoding = sum(1 for item in work if is_decoding(item))  # (a prompt in it: a mixed step's cost, apart)
        self.step_log.launched("verify", decoding, decoding + sum(len(d) for d in drafts), prompt=decoding < len(work))
        finished = self.speculation.run(
            work, batch, drafts, self.runner.verify_forward, self.scheduler, self._append, self._fail, self.sampler,
            mask=self.grammar.mask_drafts,
        )
        self.balancing.after_forward()
        return finished

    def _verify_overlaps(self, work, decoding: list[Request]) -> bool:
        """Whether a step of `work` would verify under the overlap schedule (speculation/overlap.py), were drafts
        wanted: decoding requests only, each of which may be stepped before its tokens reach the host."""
        return (self.overlap_verify is not None and self.pd is None and len(decoding) == len(work)
                and eligible(decoding, self.grammar.tracks))

    def _start_verify(self, decoding: list[Request]) -> bool:
        """A step of decoding requests only (_verify_overlaps), whose drafts the policy wants: launched, its tokens
        read next step."""
        self.in_flight = self.overlap_verify.start(decoding, self.grammar.tracks, self.hooks)
        if self.in_flight is not None:
            self.balancing.after_forward()
            self.step_log.launched("verify_overlap", *self.in_flight.shape)
        return self.in_flight is not None
