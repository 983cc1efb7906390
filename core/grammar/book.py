"""The engine's grammar state: one matcher per constrained request, made off the step loop while its prompt is
prefilled, the mask of a step filled for every constrained row at once, and each sampled token fed back.

Tensor-parallel ranks of one DP group schedule the same requests and draw the same tokens: only the group's leader
(its first rank) compiles, holds matchers and fills masks; it sends each step's mask, and the outcome of each step's
tokens (go on, rejected, complete), to the others, which so agree with it by construction and do none of the work.

The backend is built on the first constrained request (reading a large vocabulary takes about a second), so an
engine that never sees one never pays for it."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch

from .. import registry
from ..interfaces import Constraint, GrammarBackend, GrammarError, GrammarMatcher, GrammarVocab
from ..parallel import Group
from .compiler import GrammarCompiler
from .ahead import OUTCOMES, REJECTED, TERMINATED, MasksAhead, foreseen
from .mask import BitTable, StepMask


def make_backend(backend_cls: type[GrammarBackend], tokenizer: Any, vocab_size: int, eos_ids) -> GrammarBackend:
    if tokenizer is None:
        raise GrammarError("structured outputs need the model's tokenizer.json")
    return backend_cls(GrammarVocab(tokenizer, vocab_size, tuple(sorted(eos_ids))))


class GrammarBook:
    def __init__(self, make_backend: Callable[[], GrammarBackend], needs_rollback: bool = False, group: Group = Group()):
        """`group`: the tensor-parallel ranks that share this book's masks (its rank 0 leads); size 1: no sharing."""
        self._make_backend = make_backend
        self.needs_rollback = needs_rollback  # speculative decoding: rejected drafts are rolled back
        self.group = group
        self.leads = group.rank == 0
        self.compiler: GrammarCompiler | None = None
        self._pool: ThreadPoolExecutor | None = None  # matchers are built apart from compiles: no pool waits on itself
        self._matchers: dict[str, Future | None] = {}  # None on a rank that does not lead: the leader holds it
        self._waiting_for: dict[str, str] = {}  # rid -> the text after which its constraint starts
        self._accepted: dict[str, tuple[int, str | None]] = {}  # rid -> (token, outcome) fed by accept_step
        self.errors: dict[str, str] = {}  # rid -> why its constraint failed (the request fails with it)
        self.mask_wait_seconds = 0.0  # time steps spent waiting for a compile or a matcher
        self.mask_waits = 0
        self.filled_rows = 0  # mask rows this rank filled (only the leader fills)
        self._table = BitTable()
        self.ahead = MasksAhead()  # a step's tokens fed and the next masks filled while the engine runs the next forward
        self._drawn: tuple[StepMask, dict[str, int]] | None = None  # the leader's last host mask, its row per rid
        self._cpu_dtype: torch.dtype | None = None  # the dtype of CPU logits, masked without sharing (else None)

    @classmethod
    def named(cls, name: str, tokenizer: Any, vocab_size: int, eos_ids, needs_rollback: bool = False,
              group: Group = Group()) -> "GrammarBook":
        """The book of the grammar_backend plugin `name`: an unknown name fails now, naming the installed ones; the
        plugin (and its library) is imported with the first constrained request (on the leader only)."""
        if name not in registry.discover("grammar_backend"):
            registry.lookup("grammar_backend", name)  # raises the PluginError that names what is installed
        make = lambda: make_backend(registry.lookup("grammar_backend", name), tokenizer, vocab_size, eos_ids)  # noqa: E731
        return cls(make, needs_rollback, group)

    def _start(self) -> GrammarCompiler:
        if self.compiler is None:
            backend = self._make_backend()
            if self.needs_rollback and not backend.caps.rollback:
                raise GrammarError(f"{type(backend).__name__} cannot roll back rejected speculative drafts")
            self.compiler = GrammarCompiler(backend)
            self._pool = ThreadPoolExecutor(2, thread_name_prefix="grammar-matcher")
        return self.compiler

    def add(self, rid: str, constraint: Constraint, after: str = "") -> None:
        """Start compiling (or find in the cache) and build the request's matcher in the background. `after`: the
        constraint starts once the output's text holds it (the end of a reasoning model's thinking)."""
        if self.leads:
            compiled = self._start().submit(constraint)
            self._matchers[rid] = self._pool.submit(lambda: self.compiler.backend.matcher(compiled.result()))
        else:
            self._matchers[rid] = None
        if after:
            self._waiting_for[rid] = after

    def tracks(self, rid: str) -> bool:
        """Whether the request has a constraint, applying now or once its thinking ends: either way its token in
        flight must be read before its next mask is made."""
        return rid in self._matchers

    def __contains__(self, rid: str) -> bool:
        """Whether the request's next token is constrained."""
        return rid in self._matchers and rid not in self._waiting_for

    def _matcher(self, rid: str) -> GrammarMatcher | None:
        future = self._matchers[rid]
        if not future.done():
            start = time.perf_counter()
            future.exception()  # waits
            self.mask_wait_seconds += time.perf_counter() - start
            self.mask_waits += 1
        try:
            return future.result()
        except GrammarError as exc:
            self.errors[rid] = str(exc)
            return None

    def mask(self, logits: torch.Tensor, rids: Sequence[str]) -> torch.Tensor:
        """The one point where constraints meet sampling: `logits` [B, V] with every constrained row's forbidden
        tokens at -inf (a row whose constraint failed to compile all NaN, so the sampler fails just that row)."""
        rows = [row for row, rid in enumerate(rids) if rid in self]
        if not rows:
            return logits
        words = -(-logits.shape[-1] // 32)
        self._cpu_dtype = logits.dtype if logits.device.type == "cpu" and self.group.size == 1 else None
        if self.leads:
            constrained = [rids[row] for row in rows]
            mask = self._filled_ahead(constrained, words)
            self._drawn = (mask, {rid: i for i, rid in enumerate(constrained)})
        else:
            mask = StepMask.receiving(len(rows), words, logits.device)
        return self._shared(mask, logits.device).apply(logits, rows, self._table)

    def _filled_ahead(self, rids: list[str], words: int) -> StepMask:
        """The rows of `rids` (in order) from the mask filled ahead; those it lacks (a request that joined the batch
        since, or one whose constraint failed) filled or marked now."""
        late, start = self.ahead.late, time.perf_counter()
        found, rows, refused = self.ahead.take(words)
        if late:  # the step waits for its mask: counted, as a wait for a compile is
            self.mask_wait_seconds += time.perf_counter() - start
            self.mask_waits += 1
        self._refuse(refused)
        rows = rows if found is not None else {}
        at = [rows.get(rid) if rid not in refused else None for rid in rids]
        if found is not None and at == list(range(found.rows)):
            return found  # the same requests in the same order: the usual decode step
        mask = StepMask.allowing_all(len(rids), words)
        hits = [i for i, j in enumerate(at) if j is not None]
        if hits:
            mask.bitmask[hits] = found.bitmask[[at[i] for i in hits]]
        self._fill(mask, [(self._matcher(rids[i]), i) for i, j in enumerate(at) if j is None])
        return mask

    def _fill(self, mask: StepMask, fills: list[tuple[GrammarMatcher | None, int]]) -> None:
        """Fill mask rows (the backend's batch API); a row without a matcher (its compile failed) is marked failed."""
        live = [(matcher, row) for matcher, row in fills if matcher is not None]
        for matcher, row in fills:
            if matcher is None:
                mask.fail(row)
        if live:
            self.compiler.backend.fill_masks([m for m, _ in live], mask.bitmask, [row for _, row in live])
            self.filled_rows += len(live)

    def _shared(self, mask: StepMask, device: torch.device) -> StepMask:
        """The leader's mask on every rank of the group, on `device` (one broadcast on the device's group: on a
        GPU the host does not wait for it)."""
        if self.group.size == 1:
            return mask
        mask = mask.to(device)
        self.group.broadcast(mask.buffer)
        return mask

    def mask_drafts(self, logits: torch.Tensor, rids: Sequence[str], drafts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Speculative verify: `logits` holds len(drafts[i]) + 1 rows per request. Row k of a constrained request is
        masked with its matcher advanced by its first k drafts (then rolled back): a draft the grammar forbids has
        no probability under the target, so verification rejects it and everything after it."""
        self._refuse(self.ahead.drop())  # drafts move the matchers (and roll them back)
        self._drawn = None
        rows, fills, at = [], [], 0
        for rid, draft in zip(rids, drafts):
            if rid in self:
                fills.append((self._matcher(rid) if self.leads else None, draft, len(rows)))
                rows.extend(range(at, at + len(draft) + 1))
            at += len(draft) + 1
        if not rows:
            return logits
        words = -(-logits.shape[-1] // 32)
        if not self.leads:
            mask = self._shared(StepMask.receiving(len(rows), words, logits.device), logits.device)
            return mask.apply(logits, rows, self._table)
        mask = StepMask.allowing_all(len(rows), words)
        for matcher, draft, first in fills:
            if matcher is None:
                for k in range(len(draft) + 1):
                    mask.fail(first + k)
                continue
            accepted = 0
            for k in range(len(draft) + 1):
                matcher.fill_mask(mask.bitmask, first + k)
                self.filled_rows += 1
                if k == len(draft) or not matcher.accept(draft[k]):
                    break  # rows after a forbidden draft stay unmasked: verification never reaches them
                accepted += 1
            if accepted:
                matcher.rollback(accepted)
        return self._shared(mask, logits.device).apply(logits, rows, self._table)

    def accept_step(self, rids: Sequence[str], tokens: Sequence[int], fill_ahead: bool = False) -> None:
        """A step's sampled tokens fed to their constrained requests' matchers at once (the backend's batch API);
        `accept` then reads each result (on every rank of the group: the leader sends them). `fill_ahead`: fill the
        next step's masks in the worker thread; then, where the backend allows, the tokens are fed there too."""
        pairs = [(rid, token) for rid, token in zip(rids, tokens) if rid in self]
        if not pairs:
            return
        feed: list[tuple[str, int]] = []  # tokens the worker feeds (their outcomes foreseen)
        outcomes = [None] * len(pairs)
        if self.leads:
            outcomes = self._foresee(pairs) if fill_ahead else None
            if outcomes is None:
                outcomes = self._outcomes(pairs)
            else:
                feed = [pair for pair, outcome in zip(pairs, outcomes) if outcome != REJECTED]
        for (rid, token), outcome in zip(pairs, self._agreed(outcomes)):
            self._accepted[rid] = (token, outcome)
        if fill_ahead and self.leads:  # the matchers taken now: a request may finish while the worker runs
            fed = [(self._matchers[rid].result(), token) for rid, token in feed]
            going = [(rid, self._matchers[rid].result()) for (rid, _), outcome in zip(pairs, outcomes) if outcome is None]
            # allocated here: pinned memory taken from another thread would open a CUDA context on its device 0
            mask = StepMask.allowing_all(len(going), self.compiler.backend.vocab.bitmask_words)
            self.ahead.start(lambda: self._advance(fed, going, mask), [rid for rid, _ in going])

    def _foresee(self, pairs: list[tuple[str, int]]) -> list[str | None] | None:
        """The outcomes read off the mask the tokens were drawn under, where the backend allows it."""
        self._refuse(self.ahead.drop())
        drawn, self._drawn = self._drawn, None
        if drawn is None or not self.compiler.backend.caps.ends_at_end_token:
            return None
        return foreseen(*drawn, pairs, self.compiler.backend.vocab.eos_ids)

    def _advance(self, fed: list[tuple[GrammarMatcher, int]], going: list[tuple[str, GrammarMatcher]],
                 mask: StepMask) -> tuple[StepMask, list[str]]:
        """In the worker: feed the tokens, then fill `mask`'s row of each request going on; (the mask, rids
        refused)."""
        backend = self.compiler.backend
        oks = backend.accept_tokens([m for m, _ in fed], [t for _, t in fed]) if fed else []
        refused_matchers = {id(m) for (m, _), ok in zip(fed, oks) if not ok}
        # a matcher the outcome said goes on, yet terminated: the backend broke ends_at_end_token
        refused_matchers |= {id(m) for _, m in going if m.is_terminated()}
        refused = [rid for rid, m in going if id(m) in refused_matchers]
        live = [(row, m) for row, (_, m) in enumerate(going) if id(m) not in refused_matchers]
        if live:
            backend.fill_masks([m for _, m in live], mask.bitmask, [row for row, _ in live])
            self.filled_rows += len(live)
        if self._cpu_dtype is not None:  # CPU logits: the worker also turns the bits into the form added to them
            mask.make_additive(self._table, self._cpu_dtype)
        return mask, refused

    def _refuse(self, rids: Sequence[str]) -> None:
        """Fail the constraint of requests whose token the worker's matcher refused though the mask allowed it, or
        that ended on a token that is not an end token (a backend that breaks its declared contract): their next
        mask row is marked failed."""
        for rid in rids:
            if rid in self._matchers:
                failed: Future = Future()
                failed.set_exception(GrammarError("the grammar backend broke its contract: a token its own mask "
                                                  "allowed was refused, or ended the output without an end token"))
                self._matchers[rid] = failed

    def _outcomes(self, pairs: list[tuple[str, int]]) -> list[str | None]:
        self._refuse(self.ahead.drop())  # the matchers move
        self._drawn = None
        matchers = [self._matcher(rid) for rid, _ in pairs]
        live = [i for i, m in enumerate(matchers) if m is not None]
        outcomes = [REJECTED] * len(pairs)  # a failed constraint refuses every token
        if live:
            oks = self.compiler.backend.accept_tokens([matchers[i] for i in live], [pairs[i][1] for i in live])
            for i, ok in zip(live, oks):
                outcomes[i] = REJECTED if not ok else TERMINATED if matchers[i].is_terminated() else None
        return outcomes

    def _agreed(self, outcomes: list[str | None]) -> list[str | None]:
        """The leader's outcomes on every rank of the group (a few integers over the host group)."""
        if self.group.size == 1:
            return outcomes
        codes = torch.tensor([OUTCOMES.index(o) for o in outcomes], dtype=torch.int64)
        return [OUTCOMES[code] for code in self.group.broadcast(codes, host=True).tolist()]

    def accept(self, rid: str, token: int, text: str = "") -> str | None:
        """Feed the sampled token (`text`: the output so far, with it); REJECTED, TERMINATED, or None while the
        output goes on."""
        if rid not in self._matchers:
            return None
        done = self._accepted.pop(rid, None)
        if done is not None and done[0] == token:
            return done[1]
        after = self._waiting_for.get(rid)
        if after is not None:
            if after in text:
                del self._waiting_for[rid]  # the constraint applies from the next token on
            return None
        # a token fed outside a step's batch (a decode server's first token, an accepted draft): every rank of the
        # group gets here at the same point, so the leader's outcome reaches them as accept_step's do
        return self._agreed(self._outcomes([(rid, token)]) if self.leads else [None])[0]

    def finished(self, rid: str) -> str | None:
        """Drop the request's matcher; the reason its constraint failed, if it did."""
        self._waiting_for.pop(rid, None)
        self._accepted.pop(rid, None)
        future = self._matchers.pop(rid, None)
        if future is not None:
            future.cancel()
        return self.errors.pop(rid, None)

    def close(self) -> None:
        if self.compiler is not None:
            self.compiler.close()
            self._pool.shutdown(wait=False, cancel_futures=True)
        self.ahead.close()
