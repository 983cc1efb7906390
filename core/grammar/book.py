"""The engine's grammar state: one matcher per constrained request, made off the step loop while its prompt is
prefilled, the mask of a step filled for every constrained row at once, and each sampled token fed back.

The backend is built on the first constrained request (reading a large vocabulary takes about a second), so an
engine that never sees one never pays for it."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch

from .. import registry
from ..interfaces import Constraint, GrammarBackend, GrammarError, GrammarMatcher, GrammarVocab
from .compiler import GrammarCompiler
from .mask import apply_bitmask, bitmask_rows

REJECTED = "rejected"  # the matcher refused the sampled token
TERMINATED = "terminated"  # the output is complete


def make_backend(backend_cls: type[GrammarBackend], tokenizer: Any, vocab_size: int, eos_ids) -> GrammarBackend:
    if tokenizer is None:
        raise GrammarError("structured outputs need the model's tokenizer.json")
    return backend_cls(GrammarVocab(tokenizer, vocab_size, tuple(sorted(eos_ids))))


class GrammarBook:
    def __init__(self, make_backend: Callable[[], GrammarBackend], needs_rollback: bool = False):
        self._make_backend = make_backend
        self.needs_rollback = needs_rollback  # speculative decoding: rejected drafts are rolled back
        self.compiler: GrammarCompiler | None = None
        self._pool: ThreadPoolExecutor | None = None  # matchers are built apart from compiles: no pool waits on itself
        self._matchers: dict[str, Future] = {}
        self._waiting_for: dict[str, str] = {}  # rid -> the text after which its constraint starts
        self._accepted: dict[str, tuple[int, str | None]] = {}  # rid -> (token, outcome) fed by accept_step
        self.errors: dict[str, str] = {}  # rid -> why its constraint failed (the request fails with it)
        self.mask_wait_seconds = 0.0  # time steps spent waiting for a compile or a matcher
        self.mask_waits = 0

    @classmethod
    def named(cls, name: str, tokenizer: Any, vocab_size: int, eos_ids, needs_rollback: bool = False) -> "GrammarBook":
        """The book of the grammar_backend plugin `name`: an unknown name fails now, naming the installed ones; the
        plugin (and its library) is imported with the first constrained request."""
        if name not in registry.discover("grammar_backend"):
            registry.lookup("grammar_backend", name)  # raises the PluginError that names what is installed
        make = lambda: make_backend(registry.lookup("grammar_backend", name), tokenizer, vocab_size, eos_ids)  # noqa: E731
        return cls(make, needs_rollback)

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
        compiled = self._start().submit(constraint)
        self._matchers[rid] = self._pool.submit(lambda: self.compiler.backend.matcher(compiled.result()))
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
        live, matchers, broken = [], [], []
        for row in rows:
            matcher = self._matcher(rids[row])
            (broken if matcher is None else live).append(row)
            if matcher is not None:
                matchers.append(matcher)
        if broken:
            logits = logits.index_fill(0, torch.tensor(broken, device=logits.device), float("nan"))
        if live:
            bitmask = bitmask_rows(len(live), -(-logits.shape[-1] // 32))
            self.compiler.backend.fill_masks(matchers, bitmask, range(len(live)))
            logits = apply_bitmask(logits, bitmask, torch.tensor(live))
        return logits

    def mask_drafts(self, logits: torch.Tensor, rids: Sequence[str], drafts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Speculative verify: `logits` holds len(drafts[i]) + 1 rows per request. Row k of a constrained request is
        masked with its matcher advanced by its first k drafts (then rolled back): a draft the grammar forbids has
        no probability under the target, so verification rejects it and everything after it."""
        rows, fills, broken, at = [], [], [], 0
        for rid, draft in zip(rids, drafts):
            if rid in self:
                matcher = self._matcher(rid)
                if matcher is None:
                    broken.extend(range(at, at + len(draft) + 1))
                else:
                    fills.append((matcher, draft, len(rows)))
                    rows.extend(range(at, at + len(draft) + 1))
            at += len(draft) + 1
        if broken:
            logits = logits.index_fill(0, torch.tensor(broken, device=logits.device), float("nan"))
        if not rows:
            return logits
        bitmask = bitmask_rows(len(rows), -(-logits.shape[-1] // 32))
        for matcher, draft, first in fills:
            accepted = 0
            for k in range(len(draft) + 1):
                matcher.fill_mask(bitmask, first + k)
                if k == len(draft) or not matcher.accept(draft[k]):
                    break  # rows after a forbidden draft stay unmasked: verification never reaches them
                accepted += 1
            if accepted:
                matcher.rollback(accepted)
        return apply_bitmask(logits, bitmask, torch.tensor(rows))

    def accept_step(self, rids: Sequence[str], tokens: Sequence[int]) -> None:
        """A step's sampled tokens fed to their constrained requests' matchers at once (the backend's batch API);
        `accept` then reads each result."""
        pairs = [(rid, token) for rid, token in zip(rids, tokens) if rid in self]
        if not pairs:
            return
        matchers = [self._matcher(rid) for rid, _ in pairs]
        live = [(pair, m) for pair, m in zip(pairs, matchers) if m is not None]
        if not live:
            return
        oks = self.compiler.backend.accept_tokens([m for _, m in live], [token for (_, token), _ in live])
        for ((rid, token), matcher), ok in zip(live, oks):
            self._accepted[rid] = (token, REJECTED if not ok else TERMINATED if matcher.is_terminated() else None)

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
        matcher = self._matcher(rid)
        if matcher is None or not matcher.accept(token):
            return REJECTED
        return TERMINATED if matcher.is_terminated() else None

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
