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
    of length max_n .. min_n (an occurrence must be followed by at least one token).

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


class History:
    """One request's token ids as a growing numpy array: each step appends only the tokens added since the last
    (a list of the whole sequence turned into an array every step costs O(sequence) per request)."""

    def __init__(self):
        self.ids = np.empty(256, dtype=np.int64)
        self.size = 0

    def sync(self, token_ids: Sequence[int]) -> np.ndarray:
        """The ids so far, given the request's token_ids (which only grow; a shorter or different sequence under
        the same rid is rebuilt)."""
        n = len(token_ids)
        if n < self.size or (self.size and token_ids[self.size - 1] != self.ids[self.size - 1]):
            self.size = 0
        if n > self.ids.size:
            grown = np.empty(max(n, 2 * self.ids.size), dtype=np.int64)
            grown[: self.size] = self.ids[: self.size]
            self.ids = grown
        if n > self.size:
            self.ids[self.size : n] = token_ids[self.size : n]
            self.size = n
        return self.ids[:n]


class NgramDrafter(Drafter):
    # a suffix match over the host token list, or over a device-side buffer (ngram_device.py): the same drafts
    caps = DrafterCaps(cheap_proposals=True, drafts_on_device=True)
    max_n = 4  # longest suffix matched
    min_n = 1  # shortest suffix matched
    window = 4096  # only the latest tokens are searched: a step costs O(window), not O(sequence)

    def __init__(self, num_steps: int):
        super().__init__(num_steps)
        self._history: dict[str, History] = {}
        self._device = torch.device("cpu")
        self._on_device: DeviceHistories | None = None  # made on the first propose_on_device

    def bind(self, context: DrafterContext) -> None:
        self._device = torch.device(context.device)

    def propose(self, requests: Sequence[DraftRequest]) -> Drafts:
        tokens = []
        for request in requests:
            history = self._history.get(request.rid)
            if history is None:
                history = self._history[request.rid] = History()
            ids = history.sync(request.token_ids)[-self.window :]
            tokens.append(lookup(ids, self.max_n, self.min_n, self.num_steps) if ids.size > 1 else [])
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
