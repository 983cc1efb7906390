"""A request's state from arrival to finish."""

from __future__ import annotations

import enum
import time
from collections import abc
from typing import Any, Sequence

import attrs
import torch

from .sampling import SamplingParams


def check_prompt(prompt_ids: Sequence[int], vocab_size: int, capacity_tokens: int) -> None:
    """The admission check, one for every layer that applies it (the front end early, for a 400; the leader
    against the smallest DP group; the engine last, against its own KV cache): ValueError saying what is wrong."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:  # two C-level scans; the loop only to name the culprit
        bad = next(t for t in prompt_ids if not 0 <= t < vocab_size)
        raise ValueError(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
    if len(prompt_ids) > capacity_tokens:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the KV cache holds at most {capacity_tokens}")


def accept_length(spec_counts: tuple[int, int, int]) -> float | None:
    """Tokens gained per verify step that carried drafts (accepted drafts + the target's own token)."""
    steps, _, accepted = spec_counts
    return (accepted + steps) / steps if steps else None


def accept_rate(spec_counts: tuple[int, int, int]) -> float | None:
    """Share of the drafted tokens the target accepted."""
    _, drafted, accepted = spec_counts
    return accepted / drafted if drafted else None


class TokenIds(abc.Sequence):
    """A request's prompt + output ids as one read-only sequence, without concatenating them: what a drafter
    sees each step (DraftRequest.token_ids). Indexing and slicing read the two lists in place (a slice of the
    last few thousand tokens copies those only); it compares equal to the list of the same ids, and `+` gives
    a list, as all_ids did. It shows the ids there were when it was made (the lists only ever grow at the end),
    so a drafter that keeps it sees no later token."""

    __slots__ = ("prompt", "output", "_len")

    def __init__(self, prompt: list[int], output: list[int]):
        self.prompt, self.output = prompt, output
        self._len = len(prompt) + len(output)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index):
        n, p = len(self), len(self.prompt)
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            if step != 1:
                return list(self)[index]
            return self.prompt[start:min(stop, p)] + self.output[max(start - p, 0):max(stop - p, 0)]
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("token index out of range")
        return self.prompt[index] if index < p else self.output[index - p]

    def __iter__(self):
        yield from self.prompt
        yield from self.output[: self._len - len(self.prompt)]

    def __eq__(self, other) -> bool:
        if isinstance(other, TokenIds):
            other = list(other)
        return isinstance(other, (list, tuple)) and len(other) == len(self) and list(self) == list(other)

    def __add__(self, other) -> list[int]:
        return list(self) + list(other)

    def __radd__(self, other) -> list[int]:
        return list(other) + list(self)

    def __repr__(self) -> str:
        return f"TokenIds({list(self)!r})"

    __hash__ = None


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an eos token, a stop token id or a stop string
    LENGTH = "length"  # max_new_tokens reached
    ABORT = "abort"  # cancelled by the client or refused by the engine


@attrs.define(eq=False)
class Request:
    """The tokens of one sequence and how many of them already have KV in the cache.

    Each step processes some of the uncached tokens all_ids[num_cached:]; when none
    remain afterwards, the step's logits give the next token. A preempted request
    drops its cache (num_cached = 0) and recomputes everything when re-admitted.

    Under the overlap schedule a step's tokens reach the host only after the next step is
    launched: until then each is `pending`, counted in num_tokens, and given to that next
    step as the placeholder -(row + 1), its row among the sampled tokens still on the device.
    """

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = attrs.Factory(list)
    pages: list[int] = attrs.Factory(list)
    num_cached: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: Any = None  # the stop string or token that ended the request
    error: str | None = None
    text: str = ""  # detokenized output (when the engine has a tokenizer)
    logprobs: list[dict] = attrs.Factory(list)  # per generated token: its logprob and the top-K
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    arrival_time: float = attrs.Factory(time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None
    pending_rows: list[int] = attrs.Factory(list)  # per step in flight that samples for it, the row of its token
    # the prefix cache: pages[:num_shared_pages] belong to its tree, locked through `cache_node` while this
    # request reads them; the rest are the request's own. cached_tokens: prompt tokens its first admission reused
    num_shared_pages: int = 0
    cache_node: Any = None
    cached_tokens: int = 0
    # speculative decoding: verify steps that carried drafts, the drafts they carried, the drafts accepted
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # prompt logprobs (params.prompt_logprobs set): one entry per prompt position, None before the first asked for
    prompt_logprobs: list[dict | None] | None = None
    prompt_logprobs_done: bool = False

    @property
    def cache_match_limit(self) -> int:
        """The most tokens the prefix cache may give it: one token is always computed, and a position whose prompt
        logprob is still due is recomputed (its logits are needed), so cached tokens stop before it."""
        limit = self.num_tokens - 1
        p = self.params
        if p.prompt_logprobs is not None and not self.prompt_logprobs_done:
            limit = min(limit, max(p.prompt_logprobs_start, 1) - 1)
        return limit

    @property
    def awaiting_final_token(self) -> bool:
        """Whether the token in flight is its last (max_new_tokens): nothing more to schedule."""
        return bool(self.pending_rows) and len(self.output_ids) + len(self.pending_rows) >= self.params.max_new_tokens

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def token_view(self) -> TokenIds:
        """all_ids without the copy."""
        return TokenIds(self.prompt_ids, self.output_ids)

    def token_ids(self, start: int, count: int) -> list[int]:
        """all_ids[start:start+count] without concatenating the whole sequence (decode asks for one);
        a pending token is its placeholder."""
        end, prompt = start + count, len(self.prompt_ids)
        ids = self.prompt_ids[start:end] + self.output_ids[max(0, start - prompt) : max(0, end - prompt)]
        first_pending = prompt + len(self.output_ids)
        if end > first_pending:
            ids += [-(row + 1) for row in self.pending_rows[max(0, start - first_pending) : end - first_pending]]
        return ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + len(self.pending_rows)

    @property
    def num_uncached(self) -> int:
        return self.num_tokens - self.num_cached

    @property
    def spec_counts(self) -> tuple[int, int, int]:
        """(verify steps with drafts, drafted tokens, accepted drafts): how speculation went for it."""
        return self.spec_verify_steps, self.spec_draft_tokens, self.spec_accepted_tokens

    @property
    def spec_accept_length(self) -> float | None:
        return accept_length(self.spec_counts)

    @property
    def spec_accept_rate(self) -> float | None:
        return accept_rate(self.spec_counts)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: FinishReason, stop_reason: Any = None, error: str | None = None) -> None:
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error
        self.finish_time = time.monotonic()
