"""Prompt-lookup drafts: the request's own earlier tokens predict what follows a repeated n-gram.

Code edits, quoting answers and extraction repeat long runs of the prompt; where the last n tokens
occurred before, what followed them then is a good guess for what follows now. No weights, no KV,
every architecture.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from moeplex.interfaces import DraftRequest, Drafter, DrafterCaps, Drafts


def lookup(ids: np.ndarray, max_n: int, min_n: int, count: int) -> list[int]:
    """Up to `count` tokens that followed the latest earlier occurrence of the longest suffix of `ids`
    of length max_n .. min_n (an occurrence must be followed by at least one token)."""
    for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
        windows = sliding_window_view(ids[:-1], n)
        hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return ids[start : start + count].tolist()
    return []


class NgramDrafter(Drafter):
    caps = DrafterCaps()
    max_n = 4  # longest suffix matched
    min_n = 1  # shortest suffix matched
    window = 4096  # only the latest tokens are searched: a step costs O(window), not O(sequence)

    def propose(self, requests: Sequence[DraftRequest]) -> Drafts:
        tokens = []
        for request in requests:
            ids = np.asarray(request.token_ids[-self.window :], dtype=np.int64)
            tokens.append(lookup(ids, self.max_n, self.min_n, self.num_steps) if ids.size > 1 else [])
        return Drafts(tokens)
