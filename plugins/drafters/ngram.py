"""Prompt-lookup drafts: the request's own earlier tokens predict what follows a repeated n-gram.

Code edits, quoting answers and extraction repeat long runs of the prompt; where the last n tokens
occurred before, what followed them then is a good guess for what follows now. No weights, no KV,
every architecture.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from moeplex.interfaces import (DeviceDrafts, DeviceTokens, DraftRequest, Drafter, DrafterCaps, DrafterContext, Drafts,
                                StaticProposer)

from .ngram_device import DeviceHistories, StaticLookup, lookup_batch


def lookup(ids: np.ndarray, max_n: int, min_n: int, count: int) -> list[int]:
    """Up to `count` tokens that followed the latest earlier occurrence of the longest suffix of `ids`
    of length max_n .. min_n (an occurrence must be followed by at least one token). The definition of ngram's
    drafts: SuffixIndex (the host path) and the device lookup are tested against it.

    One comparison over the sequence finds the earlier positions holding the last token; the suffix is then
    matched backwards from those few candidates only: O(len(ids) + candidates x max_n), not O(len x max_n).
    """
    last = len(ids) - 1
    ends = np.flatnonzero(ids[:last] == ids[last])  # where an occurrence may end
    if ends.size == 0:
        return []
    matched = np.ones(ends.size, dtype=np.int64)  # suffix tokens matched backwards from each end
    for k in range(1, max_n):
        more = (matched == k) & (ends >= k)
        more[more] = ids[ends[more] - k] == ids[last - k]
        if not more.any():
            break
        matched += more
    n = int(matched.max())
    if n < min_n:
        return []
    start = int(ends[np.flatnonzero(matched == n)[-1]]) + 1
    return ids[start : start + count].tolist()


class SuffixIndex:
    """One request's ids and, per n-gram of length min_n .. max_n that a token has followed, the latest position
    where it ended: `draft` is then a few dict reads per step where `lookup` compares the whole window. Its
    drafts are lookup's over the latest `window` ids (the latest end of the longest matching suffix; an n-gram
    that ended before the window counts for nothing, and then neither does any earlier one). Only the latest
    2 x window ids are indexed (rebuilt from the latest window when they outgrow that), so its size is bounded
    whatever the sequence's length. (CPU, tiny DeepSeek-V3, batch 1: lookup and the history's copy cost ~40 us
    a step, 3% of a step, at every step ngram is asked.)"""

    def __init__(self, max_n: int, min_n: int, window: int):
        self.max_n, self.min_n, self.window = max_n, min_n, window
        self.ids: list[int] = []
        self.base = 0  # the position of ids[0] in the request's sequence
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram -> the position (in ids) where it last ended

    def sync(self, token_ids: Sequence[int]) -> None:
        """Add the ids after those seen (token_ids only grow; a shorter or different sequence is a new one)."""
        n, seen = len(token_ids), self.base + len(self.ids)
        if n < seen or (self.ids and token_ids[seen - 1] != self.ids[-1]):
            self.ids, self.base, self.latest, seen = [], 0, {}, 0
        if n == seen:
            return
        if n - self.base > 2 * self.window:  # start again from the latest window ids (no earlier one can match)
            self.base = n - self.window
            self.ids, self.latest = list(token_ids[self.base : n]), {}
            self._index(0)
            return
        before = len(self.ids)
        self.ids.extend(token_ids[seen:n])
        self._index(max(before - 1, 0))

    def _index(self, first: int) -> None:
        """Record the n-grams ending at each position from `first` on that a token follows."""
        ids, latest = self.ids, self.latest
        for end in range(first, len(ids) - 1):
            for k in range(self.min_n, min(self.max_n, end + 1) + 1):
                latest[tuple(ids[end - k + 1 : end + 1])] = end

    def draft(self, count: int) -> list[int]:
        ids = self.ids
        last = len(ids) - 1
        floor = max(len(ids) - self.window, 0)  # the window's first position
        for k in range(min(self.max_n, last + 1 - floor), self.min_n - 1, -1):
            end = self.latest.get(tuple(ids[last - k + 1 :]))
            if end is not None and end - k + 1 >= floor:
                return ids[end + 1 : end + 1 + count]
        return []


class NgramDrafter(Drafter):
    # a suffix match over the host token list, or over a device-side buffer (ngram_device.py): the same drafts
    caps = DrafterCaps(cheap_proposals=True, drafts_on_device=True)
    max_n = 4  # longest suffix matched
    min_n = 1  # shortest suffix matched
    window = 4096  # only the latest tokens are searched: a step costs O(window), not O(sequence)

    def __init__(self, num_steps: int):
        super().__init__(num_steps)
        self._history: dict[str, SuffixIndex] = {}
        self._device = torch.device("cpu")
        self._on_device: DeviceHistories | None = None  # made on the first propose_on_device

    def bind(self, context: DrafterContext) -> None:
        self._device = torch.device(context.device)

    def propose(self, requests: Sequence[DraftRequest]) -> Drafts:
        tokens = []
        for request in requests:
            index = self._history.get(request.rid)
            if index is None:
                index = self._history[request.rid] = SuffixIndex(self.max_n, self.min_n, self.window)
            index.sync(request.token_ids)
            tokens.append(index.draft(self.num_steps) if len(index.ids) > 1 else [])
        return Drafts(tokens)

    def propose_on_device(self, requests: Sequence[DraftRequest], pending: DeviceTokens | None = None) -> DeviceDrafts:
        if self._on_device is None:
            self._on_device = DeviceHistories(self.window, self._device)
        history, lengths = self._on_device.view(requests, pending)
        tokens, counts = lookup_batch(history, lengths, self.max_n, self.min_n, self.num_steps, self.window)
        return DeviceDrafts(tokens, counts)

    def static_proposer(self, max_rows: int, pending_width: int) -> StaticProposer:
        """Device drafting at fixed shapes; the history buffer is made with a row per request up front (growing it
        would leave the graphs reading the old one)."""
        if self._on_device is None or self._on_device.scratch < max_rows:
            self._on_device = DeviceHistories(self.window, self._device, slots=max_rows)
        return StaticLookup(self._on_device, max_rows, pending_width, self.max_n, self.min_n, self.num_steps)

    def finished(self, rid: str) -> None:
        self._history.pop(rid, None)
        if self._on_device is not None:
            self._on_device.drop(rid)
